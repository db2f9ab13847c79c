"""sglang-cache: SGLang router's cache_aware rule, with its defaults, over token blocks."""

from __future__ import annotations

from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.routing.blocks import SentBlocks
from mvllm.routing.policies.base import Policy


class SglangCache(Policy):
    """While the load (requests booked) is imbalanced, beyond BALANCE_ABS requests and BALANCE_REL times, the
    least loaded backend; else the backend this policy sent the longest prefix of this prompt before, if it
    covers more than CACHE_THRESHOLD of the prompt; else the one it remembers sending the fewest blocks. It
    keeps its own record of the blocks it sent each backend (`sent`, cleared when the backend dies) and knows
    nothing of device speeds."""

    name, needs_blocks, every_backend = "sglang-cache", True, True
    BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD = 64, 1.5, 0.3

    def start(self, router):
        super().start(router)
        self.sent = {b: SentBlocks() for b in router.backends}

    def choose(self, alive, candidates, request=None):
        bookings = self.router.bookings
        loads = [len(bookings[b]) for b in alive]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.BALANCE_ABS and hi > lo * self.BALANCE_REL:
            return min(alive, key=lambda b: len(bookings[b]))
        prefix = {b: self.sent[b].match(request.blocks) for b in alive}
        best = max(alive, key=prefix.__getitem__)
        n = request.prompt_tokens
        if n and prefix[best] * BLOCK_SIZE / n > self.CACHE_THRESHOLD:
            return best
        return min(alive, key=lambda b: len(self.sent[b]))

    def routed(self, backend, request):
        self.sent[backend].insert(request.blocks)

    def dead(self, backend):
        self.sent[backend].clear()  # a restarted worker starts with an empty cache
