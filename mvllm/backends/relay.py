"""What goes to a remote OpenAI server and what comes back: the request body, an error's message, and
token ids from its streamed chunks, from an id field where the server sends one, else from its text.

mvllm and vLLM (asked with `return_token_ids`) put each chunk's ids in `choices[i].token_ids`; llama.cpp's
native /completion stream (asked with `return_tokens`) puts them in `tokens`. A server that streams text
only (llama.cpp's /v1/completions, SGLang, others) is relayed by text: each chunk's text is tokenized with
the router's own tokenizer, so the rest of the pipeline (detokenization, usage, shadow index) sees ids.

The ids are chosen so that the router's detokenizer gives back exactly the remote's text: byte-level BPE
(SmolLM2, Qwen2.5, Llama 3) round-trips any text chunk by chunk; SentencePiece tokenizers that prepend a
space to every text (Llama 2, Mistral) would add one per chunk, so such a chunk is tokenized after a
newline anchor and the anchor's ids dropped. Each chunk is checked by decoding it as the router will: after
the anchor, or alone for a completion's first chunk (whose leading space such a decoder strips once); a
chunk that still differs is relayed as tokenized and counted (/health: `text_tokens.mismatches`). The ids need not be the
ones the remote sampled, so the relayed completion_tokens and the shadow index's answer blocks may differ
from the remote's; its own completion_tokens is shown beside ours in /health.
"""

from __future__ import annotations

import functools

import httpx

from mvllm.engine.params import SamplingParams

ANCHOR = "\n"


def remote_message(response: httpx.Response) -> str:
    """The error message an OpenAI-shaped error body carries, else the status line."""
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("detail")
        if isinstance(message, str):
            return f"HTTP {response.status_code}: {message[:300]}"
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return f"HTTP {response.status_code} {response.reason_phrase}"


def completion_body(model: str, token_ids: list[int], p: SamplingParams) -> dict:
    body = {"model": model, "prompt": token_ids, "max_tokens": p.max_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM's switch for token ids in its chunks; mvllm sends them anyway
            "return_tokens": True}  # llama.cpp's (ids in `tokens`; its /v1/completions chunks carry text only)
    extra = {"top_k": p.top_k if p.top_k > 0 else None, "seed": p.seed, "stop": p.stop or None,
             "stop_token_ids": p.stop_token_ids or None, "ignore_eos": p.ignore_eos or None,
             "min_tokens": p.min_tokens or None, "benchmark_length": p.stop_at}
    return body | {k: v for k, v in extra.items() if v is not None}


def chunk_ids(chunk: dict, choice: dict) -> list[int] | None:
    """The choice's token ids from whichever id field the server sent, else None (a text-only chunk).
    llama.cpp leaves `tokens` empty unless asked, so an empty `tokens` is no ids; an empty `token_ids` is."""
    for ids in (choice.get("token_ids"), choice.get("tokens") or None, chunk.get("tokens") or None):
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
    return None


@functools.lru_cache(maxsize=4)
def load_text_ids(model: str) -> TextIds | None:
    """The router's tokenizer for `model` (the same spec the server loads), or None: a synthetic model or
    weights without a tokenizer cannot turn text into ids."""
    from mvllm.model.loader import load_tokenizer, resolve

    hf = load_tokenizer(resolve(model))
    return None if hf is None else TextIds(hf)


class TextIds:
    def __init__(self, hf):
        self.hf = hf
        self.anchor_ids = self._encode(ANCHOR)
        self.anchor_text = self._decode(self.anchor_ids)
        self.mismatches = 0

    def _encode(self, text: str) -> list[int]:
        # split_special_tokens: a literal "<|im_end|>" in the text stays text, not the special token
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def _decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)  # as the router's detokenizer does

    def encode(self, text: str, first: bool = False) -> list[int]:
        """Ids whose decoding adds exactly `text` after the completion so far (first: at its start)."""
        before_ids, before = ([], "") if first else (self.anchor_ids, self.anchor_text)
        ids = self._encode(text)
        if self._decode(before_ids + ids) == before + text:
            return ids
        anchored, n = self._encode(ANCHOR + text), len(self.anchor_ids)
        if anchored[:n] == self.anchor_ids and self._decode(before_ids + anchored[n:]) == before + text:
            return anchored[n:]
        self.mismatches += 1
        return ids
