"""Estimated finish time of a new request on one backend, from the profile's per-batch step times.

The brief's score divides all pending decode tokens by one aggregate rate, so it prices a lone request on
an idle CPU at the CPU's full-batch throughput, though that request decodes at the batch-1 speed. This model
replays the backend's FCFS queue instead: at most max_active requests run, each decode step costs the
profiled step time at the current batch size, and a request starts decoding after its uncached prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from mvllm.routing.cost import Booking


@dataclass(slots=True)
class Timing:
    prefill_rate: float
    step_s: list[float]  # step_s[b - 1]: seconds per decode step with b running requests

    @classmethod
    def from_profile(cls, entry: dict) -> Timing | None:
        table = {d["batch"]: d["step_ms"] / 1000 for d in entry.get("decode", []) if "step_ms" in d}
        if not table:
            return None
        # up to the batch the backend serves (`max_active`, set by serve) even where the profile stopped short
        top = max(max(table), int(entry.get("max_active") or 0))
        steps = [table.get(b) for b in range(1, top + 1)]
        for i, s in enumerate(steps):  # fill unmeasured batch sizes from the nearest smaller one
            steps[i] = s if s is not None else steps[i - 1]
        return cls(float(entry["prefill_rate"]), steps)

    @property
    def max_active(self) -> int:
        return len(self.step_s)


def finish_time(timing: Timing, bookings: list[Booking], new_prefill: int, new_decode: int) -> float:
    """Seconds from now until the new request would finish if it were queued behind `bookings`."""
    return replay(timing, bookings, (new_prefill, new_decode))


def drain_time(timing: Timing, bookings: list[Booking], new: tuple[int, int] | None = None) -> float:
    """Seconds from now until every booked request (and `new`, (prefill, decode), if given) has finished."""
    return replay(timing, bookings, new, until_all=True)


def replay(timing: Timing, bookings: list[Booking], new: tuple[int, int] | None, until_all: bool = False) -> float:
    """The FCFS replay both share: the time the new request finishes, or with until_all the last one."""
    running = [[b.pending_decode, False] for b in bookings if b.active]
    queue = [(b.pending_prefill, b.pending_decode, False) for b in bookings if not b.active]
    if new is not None:
        queue.append((*new, True))
    if not running and not queue:
        return 0.0
    t = sum(b.pending_prefill for b in bookings if b.active) / timing.prefill_rate
    top, head = timing.max_active, 0
    while True:
        while head < len(queue) and len(running) < top:
            prefill, decode, is_new = queue[head]
            head += 1
            t += prefill / timing.prefill_rate
            running.append([decode, is_new])
        step = timing.step_s[min(len(running), top) - 1]
        k = min(r[0] for r in running)
        t += k * step
        for r in running:
            r[0] -= k
        if not until_all and any(is_new for left, is_new in running if left <= 0):
            return t
        running = [r for r in running if r[0] > 0]
        if until_all and not running and head == len(queue):
            return t
