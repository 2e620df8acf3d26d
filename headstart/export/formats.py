"""The serving layouts (docs/formats.md), checked against the loaders' sources:

| format         | heads                  | loader it targets                                                      |
|----------------|------------------------|------------------------------------------------------------------------|
| `sglang`       | eagle3, eagle1, dflash | SGLang `LlamaForCausalLMEagle3` / `LlamaForCausalLMEagle` (EAGLE code) |
|                |                        | / `DFlashDraftModel` (sglang_dflash.py)                                 |
| `vllm`         | eagle3, mtp (Qwen3),   | vLLM speculators format (`speculators` 0.9.0 `eagle3` / `mtp` /        |
|                | dflash, eagle1         | `dflash`); eagle1: vLLM's own EAGLE directory (`EagleLlamaForCausalLM`) |
| `deepseek-mtp` | deepseek_mtp, mtp      | DeepSeek-V3 MTP module at `model.layers.{L}` (vLLM/SGLang MTP loaders), |
|                |                        | DeepSeek targets only: those loaders build a DeepSeek block            |
| `medusa`       | medusa                 | vLLM `Medusa` (`blocks.*`, `lm_heads.*`, `token_map`)                 |
| `hf`           | draft_lm               | a plain HF `LlamaForCausalLM` directory (any engine's draft model)    |

Aux-layer ids: ours name the hidden state ENTERING a layer (HF hidden_states[j]); vLLM's
`eagle_aux_hidden_state_layer_ids` use the same convention, SGLang's name a layer's OUTPUT (it
captures at id + 1), so SGLang exports write j - 1.
"""

from __future__ import annotations

from headstart.export.deepseek_mtp import DeepSeekMTP
from headstart.export.hf import HF
from headstart.export.layout import Layout
from headstart.export.medusa import Medusa
from headstart.export.sglang import SGLang
from headstart.export.vllm_speculators import VLLM

LAYOUTS: dict[str, Layout] = {x.name: x for x in (SGLang(), VLLM(), DeepSeekMTP(), Medusa(), HF())}
LAYOUTS["eagle"] = LAYOUTS["sglang"]  # the EAGLE research code's checkpoints use SGLang's names
