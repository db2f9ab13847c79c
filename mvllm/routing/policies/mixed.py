"""mixed: the reference router's cost score (routing/cost.py)."""

from __future__ import annotations

from mvllm.routing.policies.base import Policy


class Mixed(Policy):
    """The backend of the lowest cost score."""

    name, needs_rates, needs_score = "mixed", True, True

    def choose(self, alive, candidates, request=None):
        return min(alive, key=lambda b: candidates[b].score)
