"""Per-request records and the run summary, with `vllm bench serve`'s key names and definitions.

All times are seconds from the start of the replay, taken on the client. A request's latency counts
from its scheduled send time (`arrival`), so a late client cannot hide queueing:
ttft = first_token - arrival, e2el = finish - arrival, tpot = (e2el - ttft) / (output_tokens - 1),
itl = the gaps between streamed chunks, pooled over requests (max_itl_ms the worst; per backend its p99 and worst in
backend_p99_itl_ms and backend_max_itl_ms); a chunk may carry several tokens (a server's response that fell behind
its engine sends what it holds in one chunk): its gap counts once, as vLLM's bench counts it, and
mean_tokens_per_chunk says how many each carried (1.0: every token in its own). Percentiles interpolate linearly
between ranks (numpy's default, as vLLM). max_send_delay_ms: how late the client sent its latest
request against the schedule (a check that the client kept up).

Traffic keys: hit_rate = cached / prompt tokens over completed requests that reported cached tokens (per
backend in backend_hit_rate; None where none reported); buckets = TTFT and E2EL median/p95 and count per
prompt-length bucket (edges BUCKET_EDGES: powers of 4, from 64 to 65536 tokens); with SLOs given,
request_goodput = vLLM's goodput: completed requests meeting every SLO (ttft, tpot, e2el in ms, each at most
its bound; a one-token reply has tpot 0, as in vLLM) per second of duration, good_requests their count, and
slo the SLOs themselves.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import sub

import numpy as np

from mvllm.slo import SLO_KEYS, SloError

PERCENTILES = (95, 99)
BUCKET_EDGES = (64, 256, 1024, 4096, 16384, 65536)  # prompt tokens; powers of 4


@dataclass(slots=True)
class RequestRecord:
    id: int
    arrival: float
    prompt_tokens: int = 0
    sent: float | None = None
    first_token: float | None = None
    finish: float | None = None
    backend: str = ""
    cached_tokens: int | None = None
    output_tokens: int = 0
    chunks: list[float] = field(default_factory=list)  # the arrival of each chunk that carried tokens
    error: str = ""
    max_tokens: int | None = None  # the cap the client sent (None: none)
    target_tokens: int | None = None  # the workload's true length: where the request was to end
    finish_reason: str = ""
    parent: int | None = None  # a follow-up turn: the request it follows
    chunk_tokens: list[int] = field(default_factory=list)  # the tokens each carried (empty: not recorded)

    @property
    def ok(self) -> bool:
        return not self.error and self.finish is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    return ranked(sorted(values), p)


def ranked(xs: list[float], p: float) -> float:
    """percentile of values sorted already."""
    if not len(xs):
        raise ValueError("percentile of no values")
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def stats(name: str, values_s: list[float]) -> dict:
    """mean/median/std/p95/p99 of one metric, in ms; None where there are no values."""
    return stats_ms(name, [1000.0 * v for v in values_s])


def stats_ms(name: str, ms: list[float] | np.ndarray) -> dict:
    """stats of values in ms already (a list, or an array: sorted by numpy, summed as the list is)."""
    out: dict = {}
    if not len(ms):
        for key in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key}_{name}_ms"] = None
        return out
    xs = np.sort(ms) if isinstance(ms, np.ndarray) else sorted(ms)
    if isinstance(ms, np.ndarray):
        ms = ms.tolist()
    mean = sum(ms) / len(ms)
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = ranked(xs, 50)
    squares = map(pow, map(sub, ms, repeat(mean)), repeat(2))  # (x - mean) ** 2, in C's loops
    out[f"std_{name}_ms"] = math.sqrt(sum(squares) / len(ms))
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = ranked(xs, p)
    return out


def check_slo(slo, where: str) -> dict[str, float]:
    """The experiment file's `goodput` table (e.g. {ttft_ms = 500, e2el_ms = 5000}): known keys, positive ms."""
    if not isinstance(slo, dict):
        raise SloError(f"{where}: key 'goodput' must be a table such as {{ttft_ms = 500, e2el_ms = 5000}}, "
                       f"got {slo!r}")
    for key, value in slo.items():
        if key not in SLO_KEYS:
            raise SloError(f"{where}: unknown key 'goodput.{key}'; known: "
                           f"{', '.join('goodput.' + k for k in SLO_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise SloError(f"{where}: key 'goodput.{key}' must be a positive number of milliseconds, got {value!r}")
    return {k: float(v) for k, v in slo.items()}


def meets(slo: dict[str, float], r: RequestRecord) -> bool:
    """A completed request within every SLO given (vLLM's rule: a one-token reply's tpot counts as 0)."""
    got = {"ttft_ms": 1000.0 * r.ttft, "tpot_ms": 1000.0 * (r.tpot or 0.0), "e2el_ms": 1000.0 * r.e2el}
    return all(got[k] <= bound for k, bound in slo.items())


def hit_rates(done: list[RequestRecord]) -> tuple[float | None, dict[str, float | None]]:
    """(overall, per backend) cached / prompt tokens over the requests that reported cached tokens."""
    sums: dict[str, list[int]] = {}
    for r in done:
        c = sums.setdefault(r.backend, [0, 0])
        if r.cached_tokens is not None:
            c[0] += r.cached_tokens
            c[1] += r.prompt_tokens
    cached, prompt = sum(c for c, _ in sums.values()), sum(p for _, p in sums.values())
    per = {b: (c / p if p else None) for b, (c, p) in sorted(sums.items())}
    return (cached / prompt if prompt else None), per


def bucket_label(i: int) -> str:
    lo = 0 if i == 0 else BUCKET_EDGES[i - 1]
    return f"{lo}+" if i == len(BUCKET_EDGES) else f"{lo}-{BUCKET_EDGES[i] - 1}"


def buckets(done: list[RequestRecord]) -> list[dict]:
    """TTFT and E2EL median and p95 (ms) and the count of each prompt-length bucket that holds a request."""
    groups: dict[int, list[RequestRecord]] = {}
    for r in done:
        groups.setdefault(sum(r.prompt_tokens >= e for e in BUCKET_EDGES), []).append(r)
    out = []
    for i, rs in sorted(groups.items()):
        b = {"prompt_tokens": bucket_label(i), "lo": 0 if i == 0 else BUCKET_EDGES[i - 1],
             "hi": BUCKET_EDGES[i] if i < len(BUCKET_EDGES) else None, "count": len(rs)}
        for name in ("ttft", "e2el"):
            ms = [1000.0 * getattr(r, name) for r in rs]
            b[f"median_{name}_ms"], b[f"p95_{name}_ms"] = percentile(ms, 50), percentile(ms, 95)
        out.append(b)
    return out


def itl_gaps(done: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Each request's gaps between chunks in ms (`1000 * (b - a)`, as r.itl), pooled in request order, the index
    of each one's backend, and the backends (a simulated trace has millions of gaps: numpy's arrays)."""
    lens = np.array([len(r.chunks) for r in done], dtype=np.int64)
    times = np.array(list(chain.from_iterable(r.chunks for r in done)), dtype=np.float64)
    names = sorted({r.backend for r in done})
    index = {name: i for i, name in enumerate(names)}
    owner = np.repeat(np.array([index[r.backend] for r in done], dtype=np.int64), lens)
    if len(times) < 2:
        return np.empty(0), np.empty(0, dtype=np.int64), names
    keep = np.ones(len(times) - 1, dtype=bool)  # gap i lies between times i and i + 1: not across two requests
    starts = np.cumsum(lens)[:-1]
    keep[starts[(starts > 0) & (starts < len(times))] - 1] = False
    return 1000.0 * (times[1:] - times[:-1])[keep], owner[:-1][keep], names


def itl_tails(gaps: np.ndarray, owner: np.ndarray, names: list[str]) -> tuple[float | None, dict, dict]:
    """The worst gap between two chunks of one request (ms), and per backend its ITL p99 and worst gap: what a
    long prompt's prefill costs the requests decoding beside it (itl_gaps' arrays)."""
    per = {name: np.sort(gaps[owner == i]) for i, name in enumerate(names)}
    per = {k: v for k, v in per.items() if len(v)}
    worst = {k: float(v[-1]) for k, v in per.items()}
    return max(worst.values(), default=None), {k: ranked(v, 99) for k, v in per.items()}, worst


def tails(records: list[RequestRecord]) -> dict:
    """summarize's makespan, p95_ttft_ms and p95_e2el_ms alone, the same values (what simulate's band reads)."""
    done = [r for r in records if r.ok]
    start = min((r.arrival for r in records), default=0.0)
    out = {"makespan": max((r.finish for r in done), default=start) - start}
    for name in ("ttft", "e2el"):
        out[f"p95_{name}_ms"] = percentile([1000.0 * getattr(r, name) for r in done], 95) if done else None
    return out


def summarize(records: list[RequestRecord], duration: float | None = None, slo: dict | None = None) -> dict:
    """The run summary. `duration` is the replay's wall time (start to the last response, done or
    failed); makespan is the batch completion time: first send to the last completed response. `slo`
    ({"ttft_ms": 500, ...}, any subset) adds goodput."""
    done = [r for r in records if r.ok]
    ends = [r.finish if r.finish is not None else r.arrival for r in records]
    if duration is None:
        duration = max(ends, default=0.0)
    start = min((r.arrival for r in records), default=0.0)
    makespan = max((r.finish for r in done), default=start) - start
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    per = duration if duration > 0 else float("nan")
    s = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / per,
        "output_throughput": out_tokens / per,
        "total_token_throughput": (in_tokens + out_tokens) / per,
        "makespan": makespan,
        "max_send_delay_ms": 1000.0 * max((r.sent - r.arrival for r in records if r.sent is not None), default=0.0),
    }
    s.update(stats("ttft", [r.ttft for r in done]))
    s.update(stats("tpot", [t for r in done if (t := r.tpot) is not None]))
    gaps = itl_gaps(done)  # each r.itl in ms, in one pass (a simulated trace has millions)
    s.update(stats_ms("itl", gaps[0]))
    s.update(stats("e2el", [r.e2el for r in done]))
    chunks = sum(len(r.chunks) for r in done)
    s["mean_tokens_per_chunk"] = sum(sum(r.chunk_tokens) or r.output_tokens for r in done) / chunks if chunks else None
    s["max_itl_ms"], s["backend_p99_itl_ms"], s["backend_max_itl_ms"] = itl_tails(*gaps)
    s["backend_requests"] = dict(sorted(Counter(r.backend for r in done).items()))
    cached: dict[str, int] = {}
    for r in done:
        cached[r.backend] = cached.get(r.backend, 0) + (r.cached_tokens or 0)
    s["backend_cached_tokens"] = dict(sorted(cached.items()))
    s["total_cached_tokens"] = sum(cached.values())
    s["hit_rate"], s["backend_hit_rate"] = hit_rates(done)
    s["buckets"] = buckets(done)
    if slo:
        good = sum(meets(slo, r) for r in done)
        s.update(request_goodput=good / per, good_requests=good, slo=dict(slo))
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
