"""Estimated finish time of a new request on one backend, from the profile's per-batch step times.

The reference router's cost score (routing/cost.py) divides all pending decode tokens by one aggregate rate,
so it prices a lone request on an idle CPU at the CPU's full-batch throughput, though that request decodes at
the batch-1 speed. This model replays the backend's FCFS queue instead: at most max_active requests run,
each decode step costs the profiled step time at the current batch size, and a request starts decoding after
its uncached prefill.

This is the one timing model of a backend; `mvllm simulate` steps it through time. What it prices, and from
which measurement of the profile entry:
- a decode step at batch b: `decode[b].step_ms`, plus `serving.step_ms` (host work per step while serving:
  the worker's events, the other backend's load on the host's cores); where the profile decoded at several
  depths (`contexts`), the simulator adds `depth_s` for each token of context the running requests hold
  beyond the decode table's (attention reads every cached token each step: `at_depth`);
- a prefill chunk in a step (a profile with `chunks` rows and the budget it ran under, `max_step_tokens`):
  `chunk_s`, the extra time over the decode step of the same batch, as the step model below prices it;
- the prefill of a request admitted whole (a profile without `chunks` rows: made before steps had a budget):
  the extra time over a decode step that `mixed` measures (a step admitting one prompt while max_active - 1
  decode), else that the lone `prefill` steps measure (warm and cold, interpolated by uncached tokens), else
  uncached tokens / `prefill_rate` (a hand-written profile);
- `serving.step_ms_alone`: the same host work while every other backend idles; `mvllm simulate` prices a step
  started while no other backend has work by it (`alone_s` less), where the others' threads no longer share
  the cores; eta's own estimates keep `step_ms`, the busier host;
- `serving.request_ms`: the time a request spends outside the backend (HTTP, routing, the pipes, the first
  chunk back); it delays admission and every token, but occupies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace


@dataclass(slots=True)
class Chunks:
    """A prefill chunk's price in a step, fitted from the profile's `chunks` rows: each row is one step that
    computes `tokens` uncached tokens of one prompt whose first `offset` tokens are in its KV already, beside
    `decodes` requests decoding, and its `ms` over the decode step of the same batch is the chunk's extra time.

    The model is Vidur's in small: a step's time is the sum of what its tokens cost in the GEMMs, linear in the
    chunk's tokens, and what its attention reads, the pairs of a query and a key it scores. A chunk of c tokens
    after o cached ones scores c x (o + c / 2) pairs. The rows at offset 0 give `line(c)`: the chunk alone,
    linear between the measured sizes (the GEMMs' and the c^2 / 2 pairs' cost together, as measured, so small
    chunks that a GPU runs at the same speed as larger ones are priced as measured); the rows at larger offsets
    give `per_pair`, the seconds per pair that the offset adds (c x o more pairs), by least squares through the
    origin over (c x o, extra - line(c)). A chunk never exceeds the budget the profile measured up to, so
    nothing is extrapolated past the longest chunk; an offset past the largest measured one follows the pair
    count, as attention's cost does. Decodes beside the chunk are priced as any decode step (`at_depth`): the
    rows with decodes fit the same line, their extra over that decode step."""

    sizes: list[tuple[int, float]]  # (chunk tokens, extra seconds at offset 0), sorted
    per_pair: float = 0.0
    memo: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def fit(cls, rows: list[dict], steps: list[float], depth: tuple[float, float]) -> Chunks | None:
        """`steps`: the decode table (seconds by batch - 1); `depth`: (depth_s, depth_ref) to price the decodes
        in each row at the context they held (`context`)."""
        def extra(r: dict) -> float:
            d = r.get("decodes", 0)
            base = steps[min(d, len(steps) - 1)]  # the decode step of the row's batch (its decodes + the chunk)
            if d and depth[0]:
                base = max(base + depth[0] * d * (r.get("context", depth[1]) - depth[1]), base / 2)
            return r["ms"] / 1000 - base
        got = [(r["tokens"], r.get("offset", 0), extra(r)) for r in rows if "ms" in r]
        sizes = _mean([(c, e) for c, o, e in got if o == 0])
        if not sizes:
            return None
        out = cls(sizes)
        far = [(c * o, e - out.line(c)) for c, o, e in got if o > 0]
        den = sum(x * x for x, _ in far)
        out.per_pair = max(sum(x * y for x, y in far) / den, 0.0) if den else 0.0
        return out

    def line(self, tokens: int) -> float:
        got = self.memo.get(tokens)
        if got is None:
            pts = self.sizes
            if len(pts) == 1:
                got = pts[0][1] * tokens / pts[0][0]
            else:
                i = next((i for i in range(1, len(pts) - 1) if tokens < pts[i][0]), len(pts) - 1)
                (n0, s0), (n1, s1) = pts[i - 1], pts[i]
                got = s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
            got = self.memo[tokens] = max(got, 0.0)
        return got

    def __call__(self, tokens: int, offset: int) -> float:
        return self.line(tokens) + self.per_pair * tokens * offset


@dataclass(slots=True)
class Timing:
    prefill_rate: float
    step_s: list[float]  # step_s[b - 1]: seconds per decode step with b running requests, host work included
    prefill_points: list[tuple[int, float]] = field(default_factory=list)  # (uncached tokens, extra seconds)
    request_s: float = 0.0
    overlap: bool = False  # the profile's backend scheduled each step while the one before it ran
    depth_s: float = 0.0  # seconds a step costs per token of context of each running request (0: not profiled)
    depth_ref: float = 0.0  # the mean context at which the decode table (step_s) was measured
    budget: int | None = None  # max_step_tokens the profile ran under (None: each prompt admitted whole)
    chunks: Chunks | None = None  # the chunk's price (None: a profile without chunk rows, priced by prefill_s)
    alone_s: float = 0.0  # seconds a step takes less while no other backend has work (serving.step_ms_alone)
    memo: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

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
        serving = entry.get("serving") or {}
        host = float(serving.get("step_ms", 0.0)) / 1000
        alone = min(host, float(serving.get("step_ms_alone", serving.get("step_ms", 0.0))) / 1000)
        depth = depth_cost(entry)
        chunks = Chunks.fit(entry.get("chunks", []), steps, depth) if entry.get("max_step_tokens") else None
        return cls(float(entry["prefill_rate"]), [s + host for s in steps], prefill_points(entry, table),
                   float(serving.get("request_ms", 0.0)) / 1000, bool(entry.get("overlap")), *depth,
                   entry["max_step_tokens"] if chunks else None, chunks, host - alone)

    @property
    def max_active(self) -> int:
        return len(self.step_s)

    def at_depth(self, batch: int, excess: float) -> float:
        """A decode step's seconds with `batch` running requests whose contexts exceed the decode table's by
        `excess` tokens in all (negative: fall short): the table's step plus depth_s a token, at least half it."""
        step = self.step_s[batch - 1]
        return max(step + self.depth_s * excess, step / 2)

    def chunk_s(self, tokens: int, offset: int) -> float:
        """Extra seconds a step takes for a prefill chunk of `tokens` tokens after `offset` in the KV: the fitted
        chunk model, else (a profile without chunk rows, each prompt admitted whole) prefill_s."""
        return self.chunks(tokens, offset) if self.chunks is not None else self.priced(tokens)

    def priced(self, tokens: int) -> float:
        """What a prompt of `tokens` uncached tokens adds to the replay: prefill_s (a prompt admitted whole), or
        under a budget its chunks (offsets 0, budget, ...; the first budget's pairs of a cached prefix are not
        priced: the bookings carry no prefix) and the steps after the first that they take (each a batch-1
        step: the replay runs a request's prefill before the steps of the others); remembered per token count."""
        got = self.memo.get(tokens)
        if got is None:
            if self.chunks is None or tokens <= 0:
                got = self.prefill_s(tokens)
            else:
                b, got = self.budget, 0.0
                for start in range(0, tokens, b):
                    got += self.chunks(min(b, tokens - start), start)
                got += (-(-tokens // b) - 1) * self.step_s[0]
            self.memo[tokens] = got
        return got

    def prefill_s(self, tokens: int) -> float:
        """Extra seconds a step takes for admitting a prompt with `tokens` uncached tokens: linear between the
        measured points; past the last one, the line and square through the last two (attention grows with the
        square of the prompt, and the longest prompts are the ones a real trace sends)."""
        if tokens <= 0:
            return 0.0
        pts = self.prefill_points
        if len(pts) < 2:
            return tokens / self.prefill_rate
        if tokens > pts[-1][0]:
            return _beyond(pts[-2], pts[-1], tokens)
        i = next((i for i in range(1, len(pts) - 1) if tokens < pts[i][0]), len(pts) - 1)
        (n0, s0), (n1, s1) = pts[i - 1], pts[i]  # the segment holding `tokens`, or the first one's line
        return max(s0 + (s1 - s0) * (tokens - n0) / (n1 - n0), 0.0)


def _beyond(p0: tuple[int, float], p1: tuple[int, float], tokens: int) -> float:
    """s(n) = a n + b n^2 through both points (b >= 0: never below the line through them)."""
    (n0, s0), (n1, s1) = p0, p1
    b = max((s1 / n1 - s0 / n0) / (n1 - n0), 0.0)
    line = s1 + (s1 - s0) * (tokens - n1) / (n1 - n0)
    return max(s1 + (s1 / n1 - b * n1) * (tokens - n1) + b * (tokens * tokens - n1 * n1), line)


def depth_cost(entry: dict) -> tuple[float, float]:
    """(depth_s, depth_ref): the slope of the step time over the context the batch holds (batch x context),
    fitted by least squares within each batch size of the profile's `contexts` rows and pooled (the rows measure
    batch 1 and 4 at each depth), and the mean context of its decode rows. (0, 0) without both."""
    ref = [d["context"] for d in entry.get("decode", []) if "context" in d]
    rows: dict[int, list[tuple[float, float]]] = {}
    for r in entry.get("contexts", []):
        if "step_ms" in r:
            rows.setdefault(r["batch"], []).append((r["batch"] * r["context"], r["step_ms"] / 1000))
    num = den = 0.0
    for pts in rows.values():
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    if not ref or not den:
        return 0.0, 0.0
    return max(num / den, 0.0), sum(ref) / len(ref)


def prefill_points(entry: dict, steps: dict[int, float]) -> list[tuple[int, float]]:
    """(uncached tokens, seconds over a decode step) for each measured admission: the profile's `mixed`
    steps (new profiles) over the decode step of the same batch, else its lone prefill steps over batch 1.
    Longer lone prefills than the longest mixed step extend the mixed points by what the lone ones grow past it
    (a profile measures mixed steps at the reference's 516 tokens, lone ones up to its longest --lengths)."""
    mixed = [(m["tokens"], m["ms"] / 1000 - steps.get(m["batch"], steps[max(steps)]))
             for m in entry.get("mixed", []) if m.get("batch") in steps]
    lone = [(p["tokens"], p["ms"] / 1000 - steps[min(steps)]) for p in entry.get("prefill", []) if "ms" in p]
    points = _mean(mixed or lone)
    if mixed and lone:
        top, at_top = points[-1]
        alone = _mean(lone)
        ref = Timing(1.0, [1.0], alone).prefill_s(top) if len(alone) >= 2 else None
        if ref is not None:
            points += [(n, at_top + s - ref) for n, s in alone if n > top]
    return points


def _mean(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    points: dict[int, list[float]] = {}
    for n, s in pairs:
        points.setdefault(n, []).append(s)
    return sorted((n, sum(v) / len(v)) for n, v in points.items())


# a backend's bookings: (decode tokens left of each admitted request, uncached prompt tokens of each admitted
# request that has not made a token yet, (prefill, decode) of each waiting request in FCFS order)
Work = tuple[list[int], list[int], list[tuple[int, int]]]


@dataclass(slots=True)
class Queued:
    """A backend's bookings replayed FCFS up to the admission of the last one waiting: the seconds that takes
    (`t`), the decode steps run by then (`done`), and a heap of the step at which each admitted request ends
    (`marks`). What a new request adds is priced from here (`finish`, `drain`), so a router that books more
    requests behind the same queue replays only those (`extend`)."""

    t: float
    done: int
    marks: list

    @classmethod
    def of(cls, timing: Timing, work: Work) -> Queued:
        running, admitting, waiting = work
        t = 0.0
        for n in admitting:
            t += timing.priced(n)
        q = cls(t, 0, list(running))
        heapify(q.marks)
        q.extend(timing, waiting)
        return q

    def extend(self, timing: Timing, waiting: list[tuple[int, int]]) -> None:
        """Queue these (prefill, decode) behind the rest: each is admitted, FCFS, as a slot frees. Each running
        request is a mark, the count of decode steps after which it ends; a stretch of steps between two ends
        costs its length times the step time of the batch that runs it, the full batch's while a queue waits."""
        prefill_s, top = timing.priced, timing.max_active
        full, memo, marks, t, done = timing.step_s[-1], timing.memo, self.marks, self.t, self.done
        queue = iter(waiting)
        if len(marks) < top:
            for prefill, decode in queue:  # free slots first (or more running than max_active: none free)
                t += prefill_s(prefill)
                heappush(marks, done + decode)
                if len(marks) == top:
                    break
        t, done = _run_down(marks, t, done, full, top)
        for prefill, decode in queue:  # the batch stays full: each one starts as the first of it ends
            end = marks[0]
            t += (end - done) * full
            done = end
            got = memo.get(prefill)
            t += got if got is not None else prefill_s(prefill)
            heapreplace(marks, done + decode)
        self.t, self.done = t, done

    def finish(self, timing: Timing, new: tuple[int, int]) -> float:
        """Seconds until a new request, (prefill, decode), queued behind all of it would finish."""
        marks = list(self.marks)
        t, done = _run_down(marks, self.t, self.done, timing.step_s[-1], timing.max_active - 1)
        t += timing.priced(new[0])
        marks.sort()
        return _walk(marks, timing.step_s, t, done, done + new[1], len(marks) + 1)

    def drain(self, timing: Timing, new: tuple[int, int] | None = None) -> float:
        """Seconds until all of it, and `new` if given, has finished."""
        marks, t, done, full, top = list(self.marks), self.t, self.done, timing.step_s[-1], timing.max_active
        if new is not None:
            t, done = _run_down(marks, t, done, full, top - 1)
            t += timing.priced(new[0])
            heappush(marks, done + new[1])
        t, done = _run_down(marks, t, done, full, top)
        return _walk(sorted(marks), timing.step_s, t, done)


def finish_time(timing: Timing, work: Work | Queued, new_prefill: int, new_decode: int) -> float:
    """Seconds from now until the new request would finish if it were queued behind `work`."""
    q = work if isinstance(work, Queued) else Queued.of(timing, work)
    return timing.request_s + q.finish(timing, (new_prefill, new_decode))


def drain_time(timing: Timing, work: Work | Queued, new: tuple[int, int] | None = None) -> float:
    """Seconds from now until all booked work (and `new`, (prefill, decode), if given) has finished."""
    q = work if isinstance(work, Queued) else Queued.of(timing, work)
    return (timing.request_s if new else 0.0) + q.drain(timing, new)


def _run_down(marks: list[int], t: float, done: int, full: float, keep: int) -> tuple[float, int]:
    """Full-batch steps until at most `keep` of the heap `marks` are left: (t, done) then."""
    while len(marks) > keep:
        end = heappop(marks)
        t += (end - done) * full
        done = end
    return t, done


def _walk(ends: list[int], steps: list[float], t: float, done: int = 0, last: int | None = None,
          n: int | None = None) -> float:
    """t after running from step `done` to each of the sorted `ends`, one request fewer after each, or with
    `last` given to `last` (the ends from it on do not come first); `n` requests run at first (default:
    len(ends))."""
    n = len(ends) if n is None else n
    if last is None:
        for m in ends:
            t += (m - done) * steps[n - 1]
            done, n = m, n - 1
        return t
    for m in ends:
        if m >= last:
            break
        t += (m - done) * steps[n - 1]
        done, n = m, n - 1
    return t + (last - done) * steps[n - 1]
