"""round-robin: each backend in turn."""

from __future__ import annotations

from mvllm.routing.policies.base import Policy


class RoundRobin(Policy):
    """The backends in their order, skipping those down."""

    name = "round-robin"

    def __init__(self, backends: list[str]):
        self.backends, self.next = backends, 0

    def choose(self, alive, candidates, request=None):
        for _ in range(len(self.backends)):
            name = self.backends[self.next % len(self.backends)]
            self.next += 1
            if name in alive:
                return name
        return alive[0]
