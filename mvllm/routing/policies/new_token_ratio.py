"""new-token-ratio: eta with SGLang's scheduler rule for output lengths (routing/lengths.py's TokenRatio)."""

from __future__ import annotations

from mvllm.routing.lengths import TokenRatio
from mvllm.routing.policies.eta import Eta


class NewTokenRatio(Eta):
    """eta with each request expected to make min(cap - generated, 4096) x its backend's ratio more tokens; the
    ratio of each backend decays by its decode steps and is reset by its preemptions."""

    name, lengths = "new-token-ratio", "ratio"

    def start(self, router):
        super().start(router)
        self.ratios = {b: TokenRatio() for b in router.backends}

    def scale(self, backend):
        return self.ratios[backend].ratio

    def step(self, backend):
        self.ratios[backend].step()

    def preempted(self, backend):
        booked = [b for b in self.router.bookings[backend].values() if b.active]
        self.ratios[backend].retracted(sum(b.generated for b in booked), sum(b.max_tokens for b in booked),
                                       len(booked))
