"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from dataclasses import dataclass

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams, check_budget
from mvllm.engine.sequence import Sequence, Times
from mvllm.errors import InvalidRequestError
from mvllm.model.loader import load_tokenizer
from mvllm.model.presets import DEFAULT_MODEL
from mvllm.model.tokenizer import Prompt, Tokenizer


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_cached_tokens: int
    finish_reason: str | None
    metrics: Times


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | None = None,
                 max_active: int | None = None, **engine_kwargs):
        """max_active None: 4 on the CPU and MPS; on CUDA what the KV pool holds, at most 256 (engine/sizes.py)."""
        self.engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, max_active=max_active,
                                          **engine_kwargs))
        self.tokenizer = Tokenizer(load_tokenizer(self.engine.source), model)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        if not isinstance(prompts, (str, list, tuple)):
            raise InvalidRequestError("prompts must be a string, a list of token ids, or a list of those", "prompt")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.tokenizer.encode(p) for p in prompts], params or SamplingParams())

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self._run([self.tokenizer.apply_chat_template(messages)], params or SamplingParams())[0]

    def _run(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        params.validate()
        if params.stop and self.tokenizer.hf is None:
            raise InvalidRequestError(f"model {self.tokenizer.model_spec} has no tokenizer, so stop strings "
                                      "cannot be matched; use stop_token_ids", "stop")
        for ids in prompt_ids:
            self.engine.check_prompt(ids)
            check_budget(len(ids), params.max_tokens, self.engine.max_model_len)
        seqs = [self.engine.add_request(ids, params) for ids in prompt_ids]
        texts: dict[str, str] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if params.stop:
                    self._match_stop(out.seq, out.finished, texts)
        return [self._output(s, texts.get(s.request_id)) for s in seqs]

    def _match_stop(self, seq: Sequence, finished: bool, texts: dict[str, str]) -> None:
        """End a request whose text holds a stop string; its text stops before it, as in vLLM."""
        text = self.tokenizer.decode(seq.output_ids)
        cuts = [i for i in (text.find(s) for s in seq.params.stop) if i != -1]
        if cuts:
            texts[seq.request_id] = text[:min(cuts)]
            if not finished:
                self.engine.abort(seq.request_id)
            seq.finish_reason = "stop"

    def _output(self, seq: Sequence, text: str | None = None) -> RequestOutput:
        out = seq.output_ids
        text = self.tokenizer.decode(out) if text is None else text
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], out, text,
                             seq.num_cached_tokens, seq.finish_reason, seq.times)
