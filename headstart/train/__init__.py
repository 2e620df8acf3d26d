"""Training (`headstart train`): a Lightning trainer for every head family, from shards or online,
with acceptance measured by the engine itself during validation."""

from headstart.train.run import run_train

__all__ = ["run_train"]
