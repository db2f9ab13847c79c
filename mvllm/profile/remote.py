"""`mvllm profile` of a remote backend (NAME=http://...): the same measurements as profile.py, taken from
outside over the OpenAI API, into the same profile shape, so that eta and mixed can route to any server.

- cold prefill: time to the first streamed token of a unique prompt (max_tokens 1);
- warm prefill: the same after the prompt's first WARM_CACHED tokens were sent once (and so cached);
- decode: b concurrent streams over a cached prefix; the step time at batch b is the median gap between a
  stream's tokens while all b streams are decoding.
Times include the HTTP round trip and the server's own overhead, as the router will see them.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import httpx

from mvllm.backends.remote import RemoteBackend, remote_message
from mvllm.backends.spec import BackendSpec
from mvllm.errors import MvllmError
from mvllm.profile.plan import DECODE_NEW, DECODE_PREFIX, WARM_CACHED, WARM_NEW, Progress, Tokens
from mvllm.routing.rates import choose_rates


class Remote:
    def __init__(self, spec: BackendSpec, client: httpx.AsyncClient, model: str):
        self.spec, self.client, self.model = spec, client, model
        self.cached: int | None = None

    async def stream(self, prompt: list[int], max_tokens: int) -> list[float]:
        """perf_counter stamps: the send, then the arrival of each chunk that carries tokens."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        stamps = [time.perf_counter()]
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise httpx.HTTPStatusError(remote_message(r), request=r.request, response=r)
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("token_ids") or choices[0].get("text")):
                    stamps.append(now)
                usage = chunk.get("usage") or {}
                self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", self.cached)
        return stamps

    async def ttft(self, prompt: list[int]) -> tuple[float, int | None]:
        """Seconds to the first token, and the cached prompt tokens the remote reported (None: not reported)."""
        self.cached = None
        stamps = await self.stream(prompt, 1)
        return stamps[1] - stamps[0], self.cached


def reported(runs: list[tuple[float, int | None]]) -> int | None:
    """The fewest cached tokens the remote reported over the runs; None where it reports none."""
    found = [c for _, c in runs if c is not None]
    return min(found) if found else None


def decode_steps(runs: list[list[float]]) -> list[float]:
    """Token gaps of every stream inside the window where all of them were decoding."""
    start = max(s[1] for s in runs)
    end = min(s[-1] for s in runs)
    gaps = []
    for s in runs:
        gaps += [b - a for a, b in zip(s[1:], s[2:]) if a >= start and b <= end]
    return gaps


async def measure(spec: BackendSpec, model: str, vocab: int, lengths: tuple[int, ...], repeats: int, steps: int,
                  progress: Progress) -> dict:
    handle = RemoteBackend(spec, model)  # the model spec: the tokenizer a text-only remote's chunks need
    await asyncio.to_thread(handle.wait_ready, 30.0)
    tokens = Tokens(vocab, seed=int.from_bytes(os.urandom(4), "little"))  # a remote outlives this run: new
    # prompts each time, or a second profile would find the first one's prompts cached
    max_len = handle.info.get("max_model_len") or 2048
    out = {"device": spec.device, "device_name": f"remote {'mvllm' if handle.mvllm else 'OpenAI'} server "
           f"({handle.model})", "remote": True, "max_active": spec.max_active, "measured": "from outside, over HTTP",
           "prefill": [], "decode": []}
    async with httpx.AsyncClient(base_url=handle.base, headers=handle.headers(), timeout=handle.timeout()) as client:
        remote = Remote(spec, client, handle.model)
        await remote.ttft(tokens(min(lengths)))  # warm-up: connections, the remote's allocators
        for n in lengths:
            if n + 1 >= max_len:
                continue
            progress(f"{spec.name}: cold prefill, {n} tokens")
            runs = [await remote.ttft(tokens(n)) for _ in range(repeats)]
            ms = 1000 * statistics.median(t for t, _ in runs)
            out["prefill"].append({"kind": "cold", "tokens": n, "cached": reported(runs), "ms": ms,
                                   "tok_s": n / ms * 1000})
        progress(f"{spec.name}: warm prefill, {WARM_NEW} new after {WARM_CACHED} cached")
        prefix = tokens(WARM_CACHED)
        await remote.ttft(prefix)
        runs = [await remote.ttft(prefix + tokens(WARM_NEW)) for _ in range(repeats)]
        ms = 1000 * statistics.median(t for t, _ in runs)
        out["prefill"].append({"kind": "warm", "tokens": WARM_NEW, "cached": reported(runs), "ms": ms,
                               "tok_s": WARM_NEW / ms * 1000})
        prefix = tokens(DECODE_PREFIX)
        await remote.ttft(prefix)
        for b in range(1, spec.max_active + 1):
            progress(f"{spec.name}: decode, {b} concurrent stream(s)")
            gaps, length = [], 2 * steps + 8
            for _ in range(3):  # streams that never decoded together (admitted too far apart): longer ones
                for _ in range(max(repeats // 2, 1)):
                    runs = await asyncio.gather(*(remote.stream(prefix + tokens(DECODE_NEW), length)
                                                  for _ in range(b)))
                    gaps += decode_steps(runs)
                if gaps or DECODE_PREFIX + DECODE_NEW + 2 * length >= max_len:
                    break
                length *= 2
            if not gaps:
                continue
            ms = 1000 * statistics.median(gaps)
            out["decode"].append({"batch": b, "context": DECODE_PREFIX + DECODE_NEW + (steps + 1) // 2,
                                  "step_ms": ms, "tok_s": b / ms * 1000, "itl_samples": len(gaps)})
    out.update(choose_rates(out))
    out["accuracy"] = {"note": "not measured: a remote server's logits are not reachable"}
    return out


def measure_remote(spec: BackendSpec, model: str, vocab: int, lengths: tuple[int, ...], repeats: int, steps: int,
                   progress: Progress) -> dict:
    try:
        return asyncio.run(measure(spec, model, vocab, lengths, repeats, steps, progress))
    except httpx.HTTPError as e:  # one line: the remote's own message (e.g. a context shorter than a length)
        raise MvllmError(f"backend {spec.name}: the remote failed a profiling request: {e}") from None
