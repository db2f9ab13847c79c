"""Output lengths the router is not told: how many tokens a running request still has to make.

A client sends a cap (`max_tokens`), not a length. Counting the whole cap as pending decode over-counts a
conversation trace's decode work about fivefold (a 2,048 cap against a median of 350), so the router learns
the lengths from the requests that finished: a Kaplan-Meier survival curve S(t) = P(L > t) over the last
`window` of them. A request that stopped by itself is an observed length; one that reached its cap, or whose
client went away, says only that its length was at least what it made (a censored observation). The tokens
still to come of a request that made g of its cap C are then

    E[min(L, C) - g | L > g] = sum of S(t) / S(g) for t from g to C - 1,

at least one. Where every request ends at its cap (lengths told: max_tokens is the length) the curve never
falls and the estimate is the cap, so told-length runs route as they always did. Until `min_finished`
requests have finished, and for a request that outlived every length seen, the estimate is the cap (the
prior; the routing log says which). One pool serves all backends: a length belongs to the prompt and the
model, not to the device that runs it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque


class Lengths:
    def __init__(self, window: int = 2048, min_finished: int = 16, refit_every: int = 16):
        self.seen: deque[tuple[int, bool]] = deque(maxlen=window)  # (tokens made, stopped by itself)
        self.counts: dict[int, list[int]] = {}  # tokens made -> [stopped by itself, all] of those in `seen`
        self.min_finished, self.refit_every = min_finished, refit_every
        self.fresh = 0  # finished since the last fit
        self.fits = 0  # fits so far: an estimate made before the last one is stale
        self.times: list[int] = []  # the distinct observed lengths where S falls
        self.surv: list[float] = []  # S(t) for times[j] <= t < times[j + 1]
        self.area: list[float] = []  # A(times[j]) = sum of S(t) for t < times[j]

    @property
    def ready(self) -> bool:
        return len(self.seen) >= self.min_finished

    def finished(self, generated: int, stopped: bool) -> None:
        """A request ended after `generated` tokens; `stopped`: by itself (not at its cap, not aborted)."""
        if generated <= 0:
            return
        seen, counts = self.seen, self.counts
        if len(seen) == seen.maxlen:  # the oldest leaves the window
            t, was = seen[0]
            c = counts[t]
            c[0] -= was
            c[1] -= 1
            if not c[1]:
                del counts[t]
        seen.append((generated, stopped))
        c = counts.setdefault(generated, [0, 0])
        c[0] += stopped
        c[1] += 1
        self.fresh += 1
        if self.ready and (self.fresh >= self.refit_every or len(self.seen) <= self.min_finished):
            self.fit()

    def fit(self) -> None:
        """Kaplan-Meier over the window: at each observed length, S falls by the share of those still running
        there that stopped there."""
        self.fresh = 0
        self.fits += 1
        counts = self.counts
        at_risk, s, area, last = len(self.seen), 1.0, 0.0, 0
        times, surv, areas = [], [], []
        for t in sorted(counts):
            stops, ended = counts[t]
            if stops:
                area += (t - last) * s
                s *= 1 - stops / at_risk
                times.append(t)
                surv.append(s)
                areas.append(area)
                last = t
            at_risk -= ended
        self.times, self.surv, self.area = times, surv, areas

    def left(self, generated: int, cap: int) -> int:
        """Expected tokens still to come of a request that made `generated` of its cap: (A(cap) - A(generated))
        / S(generated), A(x) the sum of S(t) for t < x (the router asks it of every booking after each fit)."""
        room, times = cap - generated, self.times
        if room <= 1 or not times:
            return max(room, 0)
        a_cap = self._a(cap)
        if not generated:  # a waiting request: S(0) = 1 and A(0) = 0, every length seen being at least 1
            return max(1, min(room, round(a_cap)))
        j = bisect_right(times, generated) - 1  # S(generated): _s inline, asked of every booking
        s = self.surv[j] if j >= 0 else 1.0
        if s <= 0.0:  # it outlived every length seen
            return room
        return max(1, min(room, round((a_cap - self._a(generated)) / s)))

    def ends_by(self, generated: int, cap: int, length: int) -> float:
        """P(L <= length | L > generated): the chance that a request that made `generated` of its cap ends within
        `length` tokens in all (1 where the cap does; before a fit, or where lengths are told, the cap is the
        length)."""
        if cap <= length:
            return 1.0
        if length <= generated or not self.times:
            return 0.0
        alive = self._s(generated)
        return 1.0 - self._s(length) / alive if alive > 0 else 0.0

    def _s(self, t: int) -> float:
        """S(t) = P(L > t)."""
        j = bisect_right(self.times, t) - 1
        return 1.0 if j < 0 else self.surv[j]

    def _a(self, x: int) -> float:
        """A(x): the sum of S(t) for t < x."""
        j = bisect_right(self.times, x - 1) - 1
        return x if j < 0 else self.area[j] + (x - self.times[j]) * self.surv[j]

    def state(self) -> str:
        """What the estimate rests on, for the routing log."""
        return f"estimate ({len(self.seen)} finished)" if self.ready else f"prior: the cap ({len(self.seen)} finished)"


class TokenRatio:
    """SGLang's new_token_ratio, per backend: a request is expected to make min(cap - generated, 4096) x ratio
    more tokens. The ratio starts at 0.7, falls by (0.7 - 0.098) / 600 a decode step to 0.098, and after a
    preemption (SGLang's retraction) is reset to what the backend's running requests have used of their caps,
    plus 20 steps each, at most 1."""

    INIT, FLOOR, STEPS, CLIP, RETRACT_STEPS = 0.7, 0.7 * 0.14, 600, 4096, 20

    def __init__(self):
        self.ratio = self.INIT

    def step(self) -> None:
        self.ratio = max(self.FLOOR, self.ratio - (self.INIT - self.FLOOR) / self.STEPS)

    def retracted(self, generated: int, caps: int, running: int) -> None:
        self.ratio = min(1.0, (generated + self.RETRACT_STEPS * running) / caps) if caps else self.INIT
