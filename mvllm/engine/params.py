"""Sampling parameters, shaped like vLLM's, and the checks a request passes before any engine sees it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mvllm.errors import ContextLengthError, InvalidRequestError, PromptTooLongError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    # benchmark only: end the sequence after this many tokens with finish_reason "stop", as if the model had
    # emitted EOS there (a replayed request's true length); nothing that routes or schedules reads it
    stop_at: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(param: str, why: str):
            raise InvalidRequestError(f"{param} {why}", param=param)

        for name in ("max_tokens", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                bad(name, f"must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")
        if self.stop_at is not None and (not _is_int(self.stop_at) or not 1 <= self.stop_at < 2**63):
            bad("benchmark_length", f"must be a positive integer, got {self.stop_at!r}")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be integer token ids, got {self.stop_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be non-empty strings, got {self.stop!r}")
        for name in ("max_tokens", "top_k", "min_tokens", "seed"):
            value = getattr(self, name)
            if value is not None and not -2**63 <= value < (2**64 if name == "seed" else 2**63):
                bad(name, f"must fit in 64 bits, got {value}")
        if not all(-2**63 <= t < 2**63 for t in self.stop_token_ids):
            bad("stop_token_ids", "must fit in 64 bits")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt must be non-empty token ids of the vocabulary, leaving room for one generated token.
    (The KV pool always holds max_model_len tokens: Engine caps max_model_len at the pool's size.)"""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # C's loops, not one of Python's a token
        raise InvalidRequestError(f"prompt holds token ids outside the vocabulary [0, {vocab_size})", "prompt")
    if len(token_ids) >= max_model_len:
        raise PromptTooLongError(f"the prompt has {len(token_ids)} tokens but this model's context is "
                                 f"{max_model_len}; shorten the prompt", "prompt")


def check_budget(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """An explicit max_tokens must fit the context with the prompt, as vLLM and OpenAI require."""
    if prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                 f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                                 f"{max_tokens} in the completion). Please reduce the length of the messages or "
                                 "completion.", "max_tokens")
