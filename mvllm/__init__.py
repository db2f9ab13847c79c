"""mvllm: serve a language model on CPU and GPU backends at once, and route whole requests between them."""

from mvllm.engine.params import SamplingParams
from mvllm.llm import LLM, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
