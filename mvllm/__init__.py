"""mvllm: serve a language model on CPU and GPU backends at once, and route whole requests between them.

The offline API (`LLM`, `SamplingParams`, `RequestOutput`) loads on first use, so that `mvllm --help` and the
torch-free commands start without importing torch."""

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "SamplingParams":
        from mvllm.engine.params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from mvllm import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'mvllm' has no attribute {name!r}")
