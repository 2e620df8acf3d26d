"""Target model families (one file each) and weight loading."""

from headstart.models.llama import LlamaConfig, LlamaForCausalLM, load_llama

__all__ = ["LlamaConfig", "LlamaForCausalLM", "load_llama"]
