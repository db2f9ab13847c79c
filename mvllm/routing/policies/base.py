"""The protocol every routing policy follows, and what the router hands it.

A policy is one object per run: `Router.set_policy` builds a fresh one (from the registry) and calls `start`;
from then on the router calls `choose` for each request and the hooks below as its bookings change. A policy
keeps its own state (what it remembers sending, a counter, a ratio per backend) and reads the router's
(`router.bookings`, `router.lengths`, `router.backends`) through the router `start` gave it.

The router keeps the bookings, the length estimate and the routing log, and prices each backend for the
policies that route by its cost model (routing/cost.py, routing/eta.py): the class attributes say what to price
and what the profile must hold, and `lengths` which output lengths the router expects of each booking
(`Router.expect`): "cap" (the max_tokens a client sent), "estimate" (learned from finished requests,
routing/lengths.py), "ratio" (SGLang's new_token_ratio, before the policy's `scale`), "true" (the benchmark's
own lengths, the oracle's).
"""

from __future__ import annotations

from dataclasses import dataclass

from mvllm.errors import InvalidRequestError
from mvllm.routing.cost import Booking, Candidate


@dataclass(slots=True)
class Request:
    """The request being routed, as the router was told it."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached: dict[str, int]  # each backend's cached prefix of the prompt now, in tokens
    blocks: list[int] | None  # the hash chain of the prompt's full blocks (given where needs_blocks is set)
    length: int | None  # the true output length, where a benchmark sends it


class Policy:
    """The base of every policy: a policy sets its name and the attributes below, defines `choose`, and
    defines the hooks it uses (the others do nothing)."""

    name = ""
    lengths = "cap"
    needs_rates = False  # the profile's prefill_rate and decode_rate of every backend (set_policy checks them)
    needs_score = False  # candidates carry the reference cost score: pending prefill and decode under the caps
    needs_timing = False  # candidates carry `eta`, the request's predicted finish (needs per-batch step times)
    needs_drain = False  # candidates carry `drain` and `idle_drain`, each backend's queue's end with and without it
    needs_blocks = False  # the request carries its block hashes (callers hash the prompt only where this is set)
    every_backend = False  # candidates (and the routing log) list backends without rates too, at rate 0
    uses_slo = False  # routes by an SLO (`slo`, set by the router before `start`); others refuse one
    # (the router prices candidates only from rates: set needs_rates with needs_score, needs_timing or needs_drain)

    def start(self, router) -> None:
        """Route for `router` (the routing/router.py Router) from now on, with fresh state."""
        self.router = router

    def choose(self, alive: list[str], candidates: dict[str, Candidate], request: Request | None = None) -> str:
        """The backend for `request`, one of `alive`. `candidates`: each backend's price, where the router
        prices (needs_rates, or a routing log), else empty."""
        raise NotImplementedError

    def scale(self, backend: str) -> float | None:
        """What every booking's expected length on this backend is multiplied by, where the policy scales
        them (None: it does not)."""
        return None

    # hooks, each called after the router has updated its bookings

    def routed(self, backend: str, request: Request) -> None:
        """The request was booked on `backend`."""

    def tokens(self, booking: Booking, count: int) -> None:
        """The booking made `count` more tokens (`generated` and `left` count them already)."""

    def step(self, backend: str) -> None:
        """The backend ran a decode step."""

    def preempted(self, backend: str) -> None:
        """The backend preempted one of its running requests."""

    def finished(self, backend: str, booking: Booking, reason: str | None) -> None:
        """The request left the backend: "stop", "length", "abort", or None (it failed)."""

    def dead(self, backend: str) -> None:
        """The backend stopped; the requests it held are no longer booked."""


def need(text: str, backends: list[str], *names: str) -> None:
    """Policy `text` routes to these backend names: each must be one of `backends`."""
    for n in names:
        if n not in backends:
            raise InvalidRequestError(f"policy {text} needs a backend named {n!r}; backends are "
                                      f"{', '.join(backends)}", "policy")
