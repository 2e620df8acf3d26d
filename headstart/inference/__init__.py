"""The inference engine: paged KV cache, scheduler, attention backends, sampler."""

from headstart.inference.engine import Engine
from headstart.inference.outputs import EngineStats, RequestOutput
from headstart.inference.sampler import SamplingParams

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams"]
