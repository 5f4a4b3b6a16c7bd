"""ferry: an LLM inference engine where every step is a ferry with a fixed token budget."""
from ferry.core.sampling_params import SamplingParams, StructuredOutputs
from ferry.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; load it only when asked so the pure-Python parts stay light.
    if name == "LLM":
        from ferry.llm import LLM

        return LLM
    raise AttributeError(name)
