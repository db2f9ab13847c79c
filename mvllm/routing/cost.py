"""The reference router's cost score (the published CPU/GPU offload experiment; docs/routing.md), exactly:

    score(backend) = pending_prefill_tokens / prefill_rate + pending_decode_tokens / decode_rate

Queued requests keep the cache estimate made when they were routed; active requests count their remaining
prefill and unused max_tokens budget; the new request counts its prompt minus what the backend caches now.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Booking:
    """One request as the router sees it on the backend it was placed on."""

    request_id: str
    prompt_tokens: int
    estimated_cached: int
    max_tokens: int
    active: bool = False
    actual_cached: int | None = None
    generated: int = 0
    length: int | None = None  # the true length, where a benchmark sends it (the oracle's; nothing else reads it)
    left: int = -1  # decode tokens expected still to come, by the router's policy's lengths (at first the cap's)

    def __post_init__(self):
        if self.left < 0:
            self.left = self.pending_decode

    @property
    def pending_prefill(self) -> int:
        if not self.active:
            return self.prompt_tokens - self.estimated_cached
        if self.generated:
            return 0
        cached = self.actual_cached if self.actual_cached is not None else self.estimated_cached
        return self.prompt_tokens - cached

    @property
    def pending_decode(self) -> int:
        return max(self.max_tokens - self.generated, 0)


@dataclass(slots=True)
class Candidate:
    """One backend as the router prices it for a request: the cost score's terms, and eta's model's times
    where the policy or the routing log reads them."""

    backend: str
    pending_prefill: int
    pending_decode: int
    prefill_rate: float
    decode_rate: float
    cached_prefix: int
    expected_decode: int | None = None  # pending decode as the policy's lengths expect it (None: the caps)
    eta: float | None = None
    drain: float | None = None  # this backend's queue drained, the new request included (makespan)
    idle_drain: float | None = None  # ... and without it

    @property
    def score(self) -> float:
        if not (self.prefill_rate and self.decode_rate):
            return float("inf")
        return self.pending_prefill / self.prefill_rate + self.pending_decode / self.decode_rate

    def as_dict(self) -> dict:
        return {"pending_prefill": self.pending_prefill, "pending_decode": self.pending_decode,
                "prefill_rate": self.prefill_rate, "decode_rate": self.decode_rate,
                "cached_prefix": self.cached_prefix, "score": round(self.score, 6),
                **({"expected_decode": self.expected_decode} if self.expected_decode is not None else {}),
                **({"eta": round(self.eta, 6)} if self.eta is not None else {}),
                **({"drain": round(self.drain, 6)} if self.drain is not None else {})}


def candidate(backend: str, bookings: list[Booking], prompt_tokens: int, cached_prefix: int, max_tokens: int,
              prefill_rate: float, decode_rate: float) -> Candidate:
    prefill = sum(b.pending_prefill for b in bookings) + prompt_tokens - cached_prefix
    decode = sum(b.pending_decode for b in bookings) + max_tokens
    return Candidate(backend, prefill, decode, prefill_rate, decode_rate, cached_prefix)
