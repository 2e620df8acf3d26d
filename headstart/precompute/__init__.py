"""Precompute: the target's hidden states on disk (shards + manifest), and response regeneration."""

from headstart.precompute.manifest import iter_shards, read_manifest, summary, verify
from headstart.precompute.run import output_dir, run_precompute

__all__ = ["iter_shards", "output_dir", "read_manifest", "run_precompute", "summary", "verify"]
