"""The Router: books each whole request on one backend at the moment it decides, and keeps each
backend's bookings current from the events its worker sends back.

It keeps the bookings, the length estimate (routing/lengths.py) and the routing log, and prices each backend
for the policy (routing/cost.py's score, routing/eta.py's finish times); the policy (routing/policies/) chooses,
keeps its own state, and hears of each booking's changes through its hooks."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import IO

from mvllm.errors import InvalidRequestError, MvllmError
from mvllm.routing.blocks import SentBlocks
from mvllm.routing.cost import Booking, Candidate, candidate
from mvllm.routing.eta import Queued, Timing, Work
from mvllm.routing.lengths import Lengths, TokenRatio
from mvllm.routing.policies.base import Policy, Request
from mvllm.routing.policies.registry import make_policy

REFRESH = 16  # tokens between two look-ups of a running request's length estimate (in between it counts down)


class NoBackendError(MvllmError):
    pass


def own_hook(policy: Policy, name: str):
    """The policy's hook `name` where its class defines one; None where it has the base's, which does nothing."""
    return getattr(policy, name) if getattr(type(policy), name) is not getattr(Policy, name) else None


class Router:
    def __init__(self, backends: list[str], policy: str, rates: dict[str, dict] | None = None,
                 log_path: str | Path | None = None, lengths: Lengths | None = None,
                 slo: dict[str, float] | None = None):
        self.backends = list(backends)
        self.target_slo = slo  # the SLO a policy that routes by one gets where set_policy is given none
        self.rates = rates or {}
        self.seen_before = lengths
        self.timings = {b: Timing.from_profile(r) for b, r in self.rates.items() if "prefill_rate" in r}
        self.bookings: dict[str, dict[str, Booking]] = {b: {} for b in self.backends}
        self.replayed: dict[str, tuple] = {}  # backend -> its bookings replayed by eta's model (`queued`)
        self.set_policy(policy, slo)
        self.alive = {b: True for b in self.backends}
        self.decisions = {b: 0 for b in self.backends}
        self.estimated: set[str] = set()  # backends whose cached prefix is a shadow estimate (remote servers)
        self.external: dict[str, int] = {b: 0 for b in self.backends}
        self.recent_max_tokens: list[int] = []
        self.stale = {b: 0 for b in self.backends}  # admissions that found less cached than was booked
        self.log: IO[str] | None = open(log_path, "a", buffering=1) if log_path else None

    def set_policy(self, text: str, slo: dict[str, float] | None = None) -> None:
        """Route new requests by this policy, a fresh one with fresh state (split:K counts from zero again,
        new-token-ratio starts at its first ratio, sglang-cache remembers sending nothing), and the length
        estimate starts from what the router was given (`lengths`: requests seen before it; else nothing: the
        caps) and learns again, so each benchmark run on a shared server starts as on a fresh one. `slo`: the
        SLO of a policy that routes by one (default: the router's target_slo); refused by any other policy."""
        policy = make_policy(text, self.backends)
        if policy.uses_slo:
            policy.slo = slo or self.target_slo
            if not policy.slo:
                raise InvalidRequestError(f"policy {text} needs an SLO: serve's --target-slo, the experiment's "
                                          "goodput table, or --slo's search (e.g. \"ttft:2000 tpot:100\")", "slo")
        elif slo:
            raise InvalidRequestError(f"policy {text} does not route by an SLO; the SLO-aware one is slo", "slo")
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
        self.lengths = copy.deepcopy(self.seen_before) if self.seen_before else Lengths()
        self.fitted = self.lengths.fits
        # what on_tokens and on_step, run for every token and every step, read of the policy
        self.estimating = policy.lengths == "estimate"
        self.tokens_hook, self.step_hook = own_hook(policy, "tokens"), own_hook(policy, "step")
        policy.start(self)
        self.reestimate()  # the bookings' expected lengths were the old policy's

    @property
    def ratios(self) -> dict[str, TokenRatio]:
        """new-token-ratio's ratio of each backend (under another policy, ratios that nothing reads)."""
        ratios = getattr(self.policy, "ratios", None)
        return ratios if ratios is not None else {b: TokenRatio() for b in self.backends}

    @property
    def sent(self) -> dict[str, SentBlocks]:
        """sglang-cache's record of the blocks sent each backend (under another policy, records that nothing
        reads)."""
        sent = getattr(self.policy, "sent", None)
        return sent if sent is not None else {b: SentBlocks() for b in self.backends}

    def alive_backends(self) -> list[str]:
        return [b for b in self.backends if self.alive[b]]

    def expect(self, backend: str, b: Booking) -> int:
        """Decode tokens a booking is expected still to make, by the lengths the policy assumes (new-token-ratio:
        before its backend's ratio, the policy's scale, which the replay applies: it scales every booking of a
        backend alike)."""
        kind = self.policy.lengths
        if kind == "cap":
            return b.pending_decode
        if kind == "estimate":
            return self.lengths.left(b.generated, b.max_tokens)
        if kind == "ratio":
            return max(min(b.max_tokens - b.generated, TokenRatio.CLIP), 0)
        end = b.max_tokens if b.length is None else min(b.length, b.max_tokens)
        return max(end - b.generated, 0)

    def scale(self, backend: str) -> float | int:
        """What a booking's `left` is multiplied by on this backend: the policy's scale (new-token-ratio's
        ratio), else 1."""
        k = self.policy.scale(backend)
        return 1 if k is None else k

    def work(self, backend: str, booked: list[Booking]) -> Work:
        """The bookings as eta's replay takes them, by the policy's lengths."""
        k = self.policy.scale(backend)
        active = [x for x in booked if x.active]
        if k is None:  # the same lists, without a multiplication each
            running = [x.left for x in active]
            queue = [(x.prompt_tokens - x.estimated_cached, x.left) for x in booked if not x.active]
        else:
            running = [x.left * k for x in active]
            queue = [(x.prompt_tokens - x.estimated_cached, x.left * k) for x in booked if not x.active]
        return running, [x.pending_prefill for x in active if not x.generated], queue

    def queued(self, backend: str, booked: list[Booking]) -> Queued:
        """The backend's bookings replayed by eta's model (`work`), kept until they change: every event that
        changes one forgets it, and a booking the router makes is queued onto it (`route`), so the decisions
        between two of the backend's events replay only the requests booked since. It is kept with what it was
        made of: the bookings (a dict put in place of them, or a booking added to it but by `route`, is
        replayed again) and the policy's scale."""
        book, k = self.bookings[backend], self.policy.scale(backend)
        kept = self.replayed.get(backend)
        if kept is not None and kept[0] is book and kept[1] == len(book) and kept[2] == k:
            return kept[3]
        q = Queued.of(self.timings[backend], self.work(backend, booked))
        self.replayed[backend] = (book, len(book), k, q)
        return q

    def reestimate(self) -> None:
        """Every booking's expected length again, from the estimate's last fit (once per fit: the bookings made
        before it, waiting ones above all, would keep the estimate, or the cap, of their time)."""
        self.fitted = self.lengths.fits
        self.replayed.clear()
        for name, booked in self.bookings.items():
            for b in booked.values():
                b.left = self.expect(name, b)

    def candidates(self, prompt_tokens: int, max_tokens: int, cached: dict[str, int],
                   length: int | None = None) -> dict[str, Candidate]:
        """Each alive backend with rates (every one, where the policy asks) priced for this request: what the
        policy reads (needs_score, needs_timing, needs_drain), and all the routing log shows where there is one."""
        out, p, log = {}, self.policy, self.log is not None
        if p.lengths == "estimate" and self.fitted != self.lengths.fits:
            self.reestimate()
        new = Booking("", prompt_tokens, 0, max_tokens, length=length)
        new.left = self.expect("", new)
        for b in self.alive_backends():
            r = self.rates.get(b)
            if not r and not p.every_backend:
                continue
            booked = list(self.bookings[b].values())
            have = cached.get(b, 0)
            rates = (float(r["prefill_rate"]), float(r["decode_rate"])) if r else (0.0, 0.0)
            if p.needs_score or log:
                c = candidate(b, booked, prompt_tokens, have, max_tokens, *rates)
            else:
                c = Candidate(b, 0, 0, *rates, have)
            timing = self.timings.get(b)
            if timing and (p.needs_timing or log):
                q = self.queued(b, booked)
                mine = (prompt_tokens - have, new.left * self.scale(b))
                if log and p.lengths != "cap":
                    work = self.work(b, booked)
                    c.expected_decode = sum(work[0]) + sum(d for _, d in work[2]) + mine[1]
                c.eta = timing.request_s + q.finish(timing, mine)
                if p.needs_drain:
                    c.drain = timing.request_s + q.drain(timing, mine)
                    c.idle_drain = q.drain(timing)
            out[b] = c
        return out

    def route(self, request_id: str, prompt_tokens: int, max_tokens: int, cached: dict[str, int],
              exclude: tuple[str, ...] = (), blocks: list[int] | None = None, length: int | None = None) -> str:
        """Choose a backend and book the request there. `cached`: each backend's cached prefix now.
        `exclude`: backends not to choose (one that just failed this request). `blocks`: the hash chain of the
        prompt's full blocks (the policies that keep their own memory of prefixes need it). `length`: the true
        output length, where a benchmark sends it (only the oracle reads it)."""
        alive = [b for b in self.alive_backends() if b not in exclude]
        if not alive:
            raise NoBackendError("no backend is alive to serve the request")
        p = self.policy
        if p.needs_blocks and blocks is None:
            raise InvalidRequestError(f"policy {p.name} needs the prompt's block hashes", "policy")
        self.recent_max_tokens = (self.recent_max_tokens + [max_tokens])[-32:]
        # prices only where the policy or the routing log reads them: eta's replay costs O(queue) per backend
        scored = p.needs_rates or self.log
        cands = self.candidates(prompt_tokens, max_tokens, cached, length) if scored else {}
        request = Request(request_id, prompt_tokens, max_tokens, cached, blocks, length)
        choice = p.choose(alive, cands, request)
        booking = self.bookings[choice][request_id] = Booking(request_id, prompt_tokens, cached.get(choice, 0),
                                                              max_tokens, length=length)
        booking.left = self.expect(choice, booking)
        self.decisions[choice] += 1
        self.book_replayed(choice, booking)
        p.routed(choice, request)
        if self.log:
            expected = ({"expected_tokens": booking.left * self.scale(choice),
                         "lengths": self.lengths.state() if p.lengths == "estimate" else p.lengths}
                        if p.lengths != "cap" else {})
            self.log.write(json.dumps({
                "request_id": request_id, "time": time.time(), "policy": p.name, "choice": choice,
                "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, **expected,
                "candidates": {b: c.as_dict() for b, c in cands.items()},
                **({"estimated_cache": sorted(self.estimated), "cached_prefix": cached} if self.estimated else {}),
                **({"external": {b: n for b, n in self.external.items() if n}} if any(self.external.values())
                   else {})}) + "\n")
        return choice

    def book_replayed(self, backend: str, booking: Booking) -> None:
        """A booking just made waits behind the backend's others: queue it onto their replay, where it is kept."""
        kept = self.replayed.get(backend)
        if kept is None:
            return
        book, n, k, q = kept
        if book is not self.bookings[backend] or n + 1 != len(book) or k != self.policy.scale(backend):
            del self.replayed[backend]
            return
        left = booking.left if k is None else booking.left * k
        q.extend(self.timings[backend], [(booking.prompt_tokens - booking.estimated_cached, left)])
        self.replayed[backend] = (book, n + 1, k, q)

    def set_external(self, backend: str, count: int) -> None:
        """A remote runs `count` requests for other clients: book each as one running request of ours, priced at
        the mean max_tokens of the last 32 routed here (their real lengths are unknown)."""
        self.external[backend] = count
        self.replayed.pop(backend, None)
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
            self.replayed.pop(backend, None)
            booking.active, booking.actual_cached = True, cached_tokens
            if cached_tokens < booking.estimated_cached:  # evicted between routing and admission
                self.stale[backend] += 1

    def on_tokens(self, backend: str, request_id: str, count: int) -> None:
        """`count` more tokens of a request: the same as `count` calls with 1 each."""
        self.on_step_tokens(backend, (request_id,), count)

    def on_step_tokens(self, backend: str, request_ids, count: int = 1) -> None:
        """`count` more tokens of each of these requests, in order: on_tokens for each, in one call (a decode
        step gives one to each request of its batch). A running request's expected length is looked up (expect)
        at every REFRESH-th token it makes and counts down at the others, so many tokens at once end where as
        many calls with one each would: the look-up at the last REFRESH-th of them, counted down from there."""
        self.replayed.pop(backend, None)
        book, estimating, hook = self.bookings[backend], self.estimating, self.tokens_hook
        caps = self.policy.lengths == "cap"
        for request_id in request_ids:
            booking = book.get(request_id)
            if booking is None:
                continue
            booking.active = True
            booking.generated = done = booking.generated + count
            if caps:  # expect's "cap" without its dispatch: every booking of a step passes here
                booking.left = booking.pending_decode
            elif not estimating:  # the other lengths are looked up at every token, from it alone
                booking.left = self.expect(backend, booking)
            else:
                since = done % REFRESH  # tokens since the last look-up's
                if since < count:  # it was among these: expect's "estimate" there
                    left = self.lengths.left(done - since, booking.max_tokens)
                else:
                    left, since = booking.left, count
                if since:  # counted down `since` tokens within the cap: min(max(left - since, 1), max(room, 0))
                    left, room = left - since, booking.max_tokens - done
                    if left < 1:
                        left = 1
                    left = left if left <= room else max(room, 0)
                booking.left = left
            if hook is not None:
                hook(booking, count)

    def on_step(self, backend: str, steps: int = 1) -> None:
        """The backend ran a decode step, or `steps` of them (new-token-ratio's ratio decays by steps)."""
        if self.step_hook is not None:
            for _ in range(steps):
                self.step_hook(backend)

    def on_preempted(self, backend: str) -> None:
        """The backend preempted a request (SGLang's retraction: new-token-ratio resets its ratio)."""
        self.policy.preempted(backend)

    def on_finished(self, backend: str, request_id: str, reason: str | None = None) -> None:
        """A request left the backend. `reason`: "stop" (it ended by itself: its length), "length" (at its cap)
        or "abort" (its client left): each tells the length estimate what it made; None (it failed) does not."""
        booking = self.bookings[backend].pop(request_id, None)
        if booking is not None:
            self.replayed.pop(backend, None)
            if reason is not None:
                self.lengths.finished(booking.generated, reason == "stop")
            self.policy.finished(backend, booking, reason)

    def on_dead(self, backend: str) -> list[str]:
        """Stop choosing a backend; returns the ids of the requests it held."""
        self.alive[backend] = False
        self.replayed.pop(backend, None)
        held = list(self.bookings[backend])
        self.bookings[backend].clear()
        self.policy.dead(backend)
        return held

    def revive(self, backend: str) -> None:
        """A restarted backend takes requests again."""
        self.alive[backend] = True

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.log = None
