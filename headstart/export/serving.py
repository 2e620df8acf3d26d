"""Where a head serves: for each engine, the first export layout of ours it loads that takes the head,
or, when none does, each layout's own refusal (`Layout.refuse`), so the answer is the exporter's.
`headstart plan` and `train` print it before any training starts."""

from __future__ import annotations

from dataclasses import dataclass

from headstart.export.formats import LAYOUTS
from headstart.heads import DraftHead

# The layouts each engine loads (formats.py names the loader of each).
ENGINE_LAYOUTS = {
    "vLLM": ("vllm", "deepseek-mtp", "medusa", "hf"),
    "SGLang": ("sglang", "deepseek-mtp", "hf"),
}

# A layout we write that the engine itself does not load for a family, though the format's library does.
NOT_LOADED = {
    ("vLLM", "vllm", "mtp"): "vLLM reads no speculators `mtp` config (0.32.0, run here: types eagle3, peagle, "
                             "dflash, dflash2, dspark; 0.34.0, read: eagle3, dflash; transformers_utils/configs/"
                             "speculators/algos.py), and its native MTP drafters "
                             "are Qwen3-Next / Qwen3.5 / MiMo / DeepSeek-family layers; --format vllm writes "
                             "speculators' own `mtp` layout, which the speculators library loads",
}


@dataclass
class Serving:
    engine: str
    format: str | None  # the --format that serves it there; None: no layout does
    why: str  # the loader it targets, or why every layout refuses the head

    def line(self) -> str:
        if self.format:
            return f"{self.engine}: yes (--format {self.format})"
        return f"{self.engine}: no ({self.why})"


def serving(head: DraftHead) -> list[Serving]:
    """One entry per engine, then ours (the engine in headstart/inference runs every head)."""
    out = []
    for engine, formats in ENGINE_LAYOUTS.items():
        holders = [f for f in formats if head.config.head_type in LAYOUTS[f].families]
        refusals = {f: NOT_LOADED.get((engine, f, head.config.head_type)) or LAYOUTS[f].refuse(head)
                    for f in holders}
        ok = next((f for f in holders if refusals[f] is None), None)
        if ok:
            out.append(Serving(engine, ok, f"the {ok} layout"))
        elif holders:
            out.append(Serving(engine, None, "; ".join(f"--format {f}: {refusals[f]}" for f in holders)))
        else:
            out.append(Serving(engine, None, f"none of its layouts ({', '.join(formats)}) holds a "
                                             f"{head.config.head_type} head"))
    out.append(Serving("headstart", "native", "our engine runs every head"))
    return out


def summary(head: DraftHead) -> list[str]:
    return [s.line() for s in serving(head)]


__all__ = ["ENGINE_LAYOUTS", "NOT_LOADED", "Serving", "serving", "summary"]
