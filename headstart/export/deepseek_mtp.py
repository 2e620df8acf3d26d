"""The DeepSeek-V3 MTP layout: one MTP module at `model.layers.{L}` (enorm, hnorm, eh_proj, the decoder
block, shared_head), as vLLM's DeepSeekMTP and SGLang's NextN loaders read it, for DeepSeek targets only.
"""

from __future__ import annotations

from headstart.errors import AssetError
from headstart.export.layout import Layout, invert, join_fused, native_state, rename, split_fused, target_hf_config
from headstart.export.layout_configs import export_record, imported_head_config, norm_flags, refuse_prenorm
from headstart.heads import DraftHead, HeadConfig
from headstart.models.deepseek import SUPPORTED_MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from headstart.models.llama import LlamaForCausalLM

# Targets whose decoder block the DeepSeek MTP loaders build: vLLM's DeepSeekMTP and SGLang's
# DeepseekV3ForCausalLMNextN construct the MTP layer's block from the target's config as a DeepSeek
# (MLA + MoE) layer, so a Llama-family block under model.layers.{L} is read by none of them.


def _not_deepseek(target: LlamaForCausalLM) -> str | None:
    kind = target.config.model_type
    if kind in DEEPSEEK_MODEL_TYPES:
        return None
    return (f"DeepSeek MTP loaders (vLLM DeepSeekMTP, SGLang NextN) build the MTP block as a DeepSeek (MLA + MoE) "
            f"layer from the target's config; this target is {kind!r}, whose layer no such loader reads. Use "
            "--format native (or, for a Qwen3-family target, --format vllm: speculators' own `mtp` layout, which the "
            "speculators library loads and vLLM does not)")


class DeepSeekMTP(Layout):
    name = "deepseek-mtp"
    families = ("deepseek_mtp", "mtp")

    def refuse(self, head: DraftHead) -> str | None:
        why = super().refuse(head) or _not_deepseek(head.target.model) or refuse_prenorm(head, "vLLM / SGLang")
        if why:
            return why
        cfg = head.config
        if cfg.num_layers != 1:
            return f"the DeepSeek MTP module holds one decoder block; this head has {cfg.num_layers}"
        if cfg.dense_block and head.target.model.config.is_moe_layer(head.target.model.config.num_hidden_layers):
            return ("the DeepSeek MTP loaders build the block at model.layers.{L} from the target's config, which "
                    "routes experts there; this head has a dense MLP (head.dense_block): export it as native")
        if cfg.head_type == "mtp" and norm_flags(cfg) != norm_flags(HeadConfig(head_type="mtp")):
            return "only an mtp head with the default norm flags maps onto enorm / hnorm / eh_proj / shared_head.norm"
        return None

    @staticmethod
    def _rules(head_type: str, layer: int) -> list[tuple[str, str]]:
        p = f"model.layers.{layer}"
        if head_type == "mtp":
            return [("embed_norm", f"{p}.enorm"), ("hidden_norm", f"{p}.hnorm"), ("fc", f"{p}.eh_proj"),
                    ("norm", f"{p}.shared_head.norm"), ("layers.0", p)]
        return [("enorm", f"{p}.enorm"), ("hnorm", f"{p}.hnorm"), ("eh_proj", f"{p}.eh_proj"),
                ("shared_head", f"{p}.shared_head"), ("layers.0", p)]

    def write(self, head, target):  # noqa: ANN001, ANN201
        n = target.config.num_hidden_layers
        state = split_fused(rename(native_state(head), self._rules(head.config.head_type, n)), head.config)
        # DeepSeek-V3 ships the shared embedding and head inside the MTP layer; loaders may read them there.
        state[f"model.layers.{n}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().cpu().clone()
        state[f"model.layers.{n}.shared_head.head.weight"] = target.lm_head.weight.detach().cpu().clone()
        config = target_hf_config(target)
        config.update(num_nextn_predict_layers=1, headstart=export_record(head, self.name))
        return config, state

    def tensor_prefix(self, config):  # noqa: ANN001, ANN201
        # An export of ours holds only the MTP layer; a DeepSeek-V3 / R1 checkpoint holds it after its
        # decoder layers: either way it is model.layers.{num_hidden_layers}.
        n = config.get("num_hidden_layers")
        return f"model.layers.{n}." if isinstance(n, int) and not isinstance(n, bool) else None

    def recognise(self, config):  # noqa: ANN001, ANN201
        if config.get("num_nextn_predict_layers") == 1:
            return None
        return f"num_nextn_predict_layers {config.get('num_nextn_predict_layers')!r} (expected 1)"

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        why = _not_deepseek(target)
        if why:
            raise AssetError(f"not importable onto this target: {why}")
        n = target.config.num_hidden_layers
        meta = config.get("headstart") or {}
        kind = "mtp" if meta.get("head_type") == "mtp" else "deepseek_mtp"
        p = f"model.layers.{n}"
        shared = (f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight")
        state = {k: v for k, v in tensors.items() if k not in shared}
        state = rename(join_fused(state), invert(self._rules(kind, n)))
        return imported_head_config(config, kind, target, postnorm_features=True), state  # what the MTP loaders feed it
