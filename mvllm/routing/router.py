"""The Router: books each whole request on one backend at the moment it decides, and keeps each
backend's bookings current from the events its worker sends back."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

from mvllm.errors import InvalidRequestError, MvllmError
from mvllm.routing.cost import Booking, Candidate, candidate
from mvllm.routing.eta import Timing, drain_time, finish_time
from mvllm.routing.policies import make_policy


class NoBackendError(MvllmError):
    pass


class Router:
    def __init__(self, backends: list[str], policy: str, rates: dict[str, dict] | None = None,
                 log_path: str | Path | None = None):
        self.backends = list(backends)
        self.rates = rates or {}
        self.timings = {b: Timing.from_profile(r) for b, r in self.rates.items() if "prefill_rate" in r}
        self.set_policy(policy)
        self.bookings: dict[str, dict[str, Booking]] = {b: {} for b in self.backends}
        self.alive = {b: True for b in self.backends}
        self.decisions = {b: 0 for b in self.backends}
        self.estimated: set[str] = set()  # backends whose cached prefix is a shadow estimate (remote servers)
        self.external: dict[str, int] = {b: 0 for b in self.backends}
        self.recent_max_tokens: list[int] = []
        self.log: IO[str] | None = open(log_path, "a", buffering=1) if log_path else None

    def set_policy(self, text: str) -> None:
        """Route new requests by this policy (fresh state: split:K counts from zero again)."""
        policy = make_policy(text, self.backends)
        if policy.needs_rates:
            missing = [b for b in self.backends if not {"prefill_rate", "decode_rate"} <= set(self.rates.get(b, {}))]
            if missing:
                raise InvalidRequestError(f"policy {text} needs prefill_rate and decode_rate for backend(s) "
                                          f"{', '.join(missing)}: pass --profile (made by `mvllm profile`)", "policy")
        if policy.needs_timing or policy.needs_drain:
            missing = [b for b in self.backends if not self.timings.get(b)]
            if missing:
                raise InvalidRequestError(f"policy {policy.name} needs per-batch decode step times for backend(s) "
                                          f"{', '.join(missing)}: pass a --profile made by `mvllm profile`", "policy")
        self.policy = policy

    def alive_backends(self) -> list[str]:
        return [b for b in self.backends if self.alive[b]]

    def candidates(self, prompt_tokens: int, max_tokens: int, cached: dict[str, int]) -> dict[str, Candidate]:
        out = {}
        for b in self.alive_backends():
            r = self.rates.get(b)
            if r:
                booked = list(self.bookings[b].values())
                c = candidate(b, booked, prompt_tokens, cached.get(b, 0), max_tokens, float(r["prefill_rate"]),
                              float(r["decode_rate"]))
                timing = self.timings.get(b)
                if timing and (self.policy.needs_timing or self.log):
                    c.eta = finish_time(timing, booked, prompt_tokens - cached.get(b, 0), max_tokens)
                if timing and self.policy.needs_drain:
                    c.drain = drain_time(timing, booked, (prompt_tokens - cached.get(b, 0), max_tokens))
                    c.idle_drain = drain_time(timing, booked)
                out[b] = c
        return out

    def route(self, request_id: str, prompt_tokens: int, max_tokens: int, cached: dict[str, int],
              exclude: tuple[str, ...] = ()) -> str:
        """Choose a backend and book the request there. `cached`: each backend's cached prefix now.
        `exclude`: backends not to choose (one that just failed this request)."""
        alive = [b for b in self.alive_backends() if b not in exclude]
        if not alive:
            raise NoBackendError("no backend is alive to serve the request")
        self.recent_max_tokens = (self.recent_max_tokens + [max_tokens])[-32:]
        # scores only where the policy or the routing log reads them: eta's replay costs O(queue) per backend
        cands = self.candidates(prompt_tokens, max_tokens, cached) if self.policy.needs_rates or self.log else {}
        choice = self.policy.choose(alive, cands)
        self.bookings[choice][request_id] = Booking(request_id, prompt_tokens, cached.get(choice, 0), max_tokens)
        self.decisions[choice] += 1
        if self.log:
            self.log.write(json.dumps({
                "request_id": request_id, "time": time.time(), "policy": self.policy.name, "choice": choice,
                "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                "candidates": {b: c.as_dict() for b, c in cands.items()},
                **({"estimated_cache": sorted(self.estimated), "cached_prefix": cached} if self.estimated else {}),
                **({"external": {b: n for b, n in self.external.items() if n}} if any(self.external.values())
                   else {})}) + "\n")
        return choice

    def set_external(self, backend: str, count: int) -> None:
        """A remote runs `count` requests for other clients: book each as one running request of ours, priced at
        the mean max_tokens of the last 32 routed here (their real lengths are unknown)."""
        self.external[backend] = count
        book = self.bookings[backend]
        for rid in [r for r in book if r.startswith("external-")]:
            del book[rid]
        size = round(sum(self.recent_max_tokens) / len(self.recent_max_tokens)) if self.recent_max_tokens else 0
        for i in range(count if self.alive[backend] else 0):
            book[f"external-{i}"] = Booking(f"external-{i}", 0, 0, size, active=True)

    def note(self, record: dict) -> None:
        """An extra line in the routing log (no "candidates": readers of decisions skip it)."""
        if self.log:
            self.log.write(json.dumps(record) + "\n")

    def on_scheduled(self, backend: str, request_id: str, cached_tokens: int) -> None:
        booking = self.bookings[backend].get(request_id)
        if booking:
            booking.active, booking.actual_cached = True, cached_tokens

    def on_tokens(self, backend: str, request_id: str, count: int) -> None:
        booking = self.bookings[backend].get(request_id)
        if booking:
            booking.active = True
            booking.generated += count

    def on_finished(self, backend: str, request_id: str) -> None:
        self.bookings[backend].pop(request_id, None)

    def on_dead(self, backend: str) -> list[str]:
        """Stop choosing a backend; returns the ids of the requests it held."""
        self.alive[backend] = False
        held = list(self.bookings[backend])
        self.bookings[backend].clear()
        return held

    def revive(self, backend: str) -> None:
        """A restarted backend takes requests again."""
        self.alive[backend] = True

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.log = None
