"""slo: the backend that meets a service-level objective (TTFT, TPOT, E2E bounds in ms), by eta's model.

eta sends a request where it is predicted to finish first, so it keeps everything on the GPU until the GPU's
queue is far past any TTFT bound: a CPU that decodes several times slower never finishes a request first, and
its capacity goes unused. This policy asks the SLO instead: where would this request get its first token in
time, and decode fast enough, without slowing the requests running there past the bound?"""

from __future__ import annotations

from heapq import heappop

from mvllm.routing.cost import Booking
from mvllm.routing.eta import Queued, Timing
from mvllm.routing.policies.eta import ETA_MARGIN, Eta

HEADROOM = 0.1  # a backend "meets" first only with its predicted TTFT and E2E this far inside their bounds
LIGHT = 0.25  # the GPU is "light" while its predicted TTFT is within this share of the bound
EARLY = 0.1  # ... or within this share, where a slower backend fits easily:
EASY_TTFT, EASY_TPOT = 0.1, 0.5  # its first token within this share of the TTFT bound, its step of the TPOT bound
RISK = 0.05  # a backend takes a prefill whose stall is expected to push at most this many running requests past TPOT


def first_token(timing: Timing, q: Queued, prefill: int) -> tuple[float, int]:
    """(seconds until a new request queued behind `q` makes its first token, the batch it joins)."""
    marks, t, done, full = list(q.marks), q.t, q.done, timing.step_s[-1]
    while len(marks) >= timing.max_active:  # it waits for a slot: full-batch steps until one frees
        end = heappop(marks)
        t += (end - done) * full
        done = end
    batch = len(marks) + 1
    return timing.request_s + t + timing.priced(prefill) + timing.step_s[batch - 1], batch


def idle_misses(timing: Timing, slo: dict[str, float]) -> list[str]:
    """The bounds a lone short request on this idle backend misses: its first decode step is over ttft or
    tpot (the prompt's prefill comes on top)."""
    first, step = timing.request_s + timing.step_s[0], timing.step_s[0]
    got = {"ttft_ms": first, "tpot_ms": step, "e2el_ms": first}
    return [k.removesuffix("_ms") for k, bound in slo.items() if 1000 * got[k] > bound]


class Slo(Eta):
    """For each backend, eta's replay of its queue (the router's length estimates) predicts this request's
    TTFT (its wait for a slot, prefill and first step), TPOT (the step of the batch it joins, context depth
    included, plus the prefills of the requests that will take the slots freed while it runs) and E2E (eta's
    finish); a backend where its prefill would likely push a running request past the TPOT bound (`_stalls`)
    does not meet the SLO. Then (docs/routing.md, "Routing by the SLO"):
    1. while the home backend (the fastest decoder, and its peers) fits with its TTFT within LIGHT of the bound
       (EARLY where a slower backend fits easily: first token and step well inside theirs), eta's rule among the
       backends that do;
    2. else a slower backend that fits (TTFT and E2E with HEADROOM to spare), else any that fits, else any that
       meets the SLO, eta's rule among them;
    3. else the request is lost wherever it goes: it goes where it takes nothing from requests that can still
       meet it, a backend that meets the SLO for no request even idle (the earliest finish among them); with
       none, eta's choice.
    Below the home backend's capacity this is eta. Near it, a request that would wait past the TTFT bound on
    the GPU goes to a CPU that meets it, instead of queueing where it finishes first but late."""

    name, lengths, uses_slo = "slo", "estimate", True

    def __init__(self, slo: dict[str, float] | None = None):
        self.slo = slo

    def start(self, router):
        super().start(router)
        self.useless = {b for b, t in router.timings.items() if idle_misses(t, self.slo)}

    def _stalls(self, booked, timing: Timing, uncached: int, tpot: float) -> bool:
        """Its prefill stalls every request running there: one of L tokens in all misses the TPOT bound where
        step + prefill / (L - 1) > tpot. True where the requests expected to miss so (each one's chance of so
        short a length, by the router's lengths: certain where lengths are told) are more than RISK."""
        full = timing.step_s[min(len(booked), timing.max_active) - 1]
        if full >= tpot:
            return True
        short = 1 + int(timing.priced(uncached) / (tpot - full))  # a length at or below this misses
        lengths = self.router.lengths
        return sum(lengths.ends_by(x.generated, x.max_tokens, short) for x in booked if x.active) > RISK

    def choose(self, alive, candidates, request=None):
        slo = self.slo
        ttft, tpot, e2el = (slo.get(k, float("inf")) / 1000 for k in ("ttft_ms", "tpot_ms", "e2el_ms"))
        keep = 1 - HEADROOM
        own = self.router.expect("", Booking("", request.prompt_tokens, 0, request.max_tokens))
        timed, fits, close = [], [], []
        for b in alive:
            c, timing = candidates[b], self.router.timings[b]
            booked = list(self.router.bookings[b].values())
            q = self.router.queued(b, booked)
            uncached = request.prompt_tokens - c.cached_prefix
            first, batch = first_token(timing, q, uncached)
            step = timing.step_s[batch - 1]
            if timing.depth_s:
                held = sum(x.prompt_tokens + x.generated for x in booked if x.active)
                step = timing.at_depth(batch, held + request.prompt_tokens - batch * timing.depth_ref)
            if booked and self._stalls(booked, timing, uncached, tpot):
                step = float("inf")
            elif booked:
                # each booked request that ends before this one frees a slot a later request takes: that
                # prefill (priced as this one's) stalls this request's decode too
                refills = min(sum(x.left < own for x in booked), timing.max_active - 1)
                step += refills * timing.priced(uncached) / max(own - 1, 1)
            if step <= tpot and first <= ttft and c.eta <= e2el:
                close.append(b)
                if first <= ttft * keep and c.eta <= e2el * keep:
                    fits.append(b)
                    timed.append((b, first, step))
        home = max(alive, key=lambda b: candidates[b].decode_rate)
        floor = candidates[home].decode_rate * (1 - ETA_MARGIN)
        fast = {b for b in alive if candidates[b].decode_rate >= floor}
        easy = any(b not in fast and f <= ttft * EASY_TTFT and st <= tpot * EASY_TPOT for b, f, st in timed)
        light = [b for b, f, _ in timed if f <= ttft * (EARLY if easy else LIGHT)]
        if fast & set(light):
            return super().choose(light, candidates, request)
        for group in ([b for b in fits if b not in fast], fits, close):
            if group:
                return super().choose(group, candidates, request)
        lost = [b for b in alive if b in self.useless]
        if lost:
            return min(lost, key=lambda b: candidates[b].eta)
        return super().choose(alive, candidates, request)
