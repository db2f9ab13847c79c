"""kv-cost: Dynamo's KV router with its defaults (overlap weight 1, temperature 0)."""

from __future__ import annotations

from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.routing.policies.base import Policy


class KvCost(Policy):
    """The backend of the lowest OVERLAP_WEIGHT x (the prompt's blocks not cached there) + (the blocks its
    booked requests hold, this one's included). It reads each backend's cache exactly (Dynamo's KV events) and
    knows nothing of device speeds."""

    name, every_backend, OVERLAP_WEIGHT = "kv-cost", True, 1.0

    def choose(self, alive, candidates, request=None):
        blocks = -(-request.prompt_tokens // BLOCK_SIZE)

        def cost(b: str) -> float:
            held = sum(-(-(x.prompt_tokens + x.generated) // BLOCK_SIZE) for x in self.router.bookings[b].values())
            return self.OVERLAP_WEIGHT * (blocks - request.cached.get(b, 0) // BLOCK_SIZE) + held + blocks

        return min(alive, key=cost)
