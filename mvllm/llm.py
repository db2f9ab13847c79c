"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from dataclasses import dataclass

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams
from mvllm.engine.sequence import Sequence, Times
from mvllm.errors import InvalidRequestError
from mvllm.model.loader import DEFAULT_MODEL, load_tokenizer

Prompt = str | list[int]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_cached_tokens: int
    finish_reason: str | None
    metrics: Times


class Tokenizer:
    """Text <-> ids for one model; a synthetic model has none and accepts only token ids."""

    def __init__(self, hf_tokenizer, model_spec: str):
        self.hf, self.model_spec = hf_tokenizer, model_spec

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.hf is None:
                raise InvalidRequestError(
                    f"model {self.model_spec} has no tokenizer; pass the prompt as a list of token ids", "prompt")
            return self.hf.encode(prompt, add_special_tokens=True)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("a prompt must be a string or a list of integer token ids", "prompt")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError(f"model {self.model_spec} has no chat template", "messages")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.hf is None else self.hf.decode(ids, skip_special_tokens=True)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | None = None,
                 max_active: int = 4, **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, max_active=max_active,
                                          **engine_kwargs))
        self.tokenizer = Tokenizer(load_tokenizer(self.engine.source), model)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.tokenizer.encode(p) for p in prompts], params or SamplingParams())

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self._run([self.tokenizer.apply_chat_template(messages)], params or SamplingParams())[0]

    def _run(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        for ids in prompt_ids:
            self.engine.check_prompt(ids, params)
        seqs = [self.engine.add_request(ids, params) for ids in prompt_ids]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self._output(s) for s in seqs]

    def _output(self, seq: Sequence) -> RequestOutput:
        out = seq.output_ids
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], out,
                             self.tokenizer.decode(out), seq.num_cached_tokens, seq.finish_reason, seq.times)
