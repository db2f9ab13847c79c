"""OpenAI request bodies (with vLLM's extensions) and the OpenAI error shape."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mvllm.engine.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # absent: the served model (vLLM and llama.cpp's server take it so)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    benchmark_length: int | None = None  # benchmark only (mvllm bench, lengths hidden): SamplingParams.stop_at

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k if self.top_k != 0 else -1, seed=self.seed,
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                              stop_token_ids=list(self.stop_token_ids or []), stop=stop,
                              stop_at=self.benchmark_length)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class WarmRequest(BaseModel):
    prompt: str | list[int]
    backend: str | None = None


class PolicyRequest(BaseModel):
    policy: str
    slo: str | None = None  # e.g. "ttft:2000 tpot:100", for a policy that routes by an SLO


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code or status}},
                        status_code=status)
