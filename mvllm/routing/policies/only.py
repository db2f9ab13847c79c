"""gpu-only, cpu-only: every request to one named backend."""

from __future__ import annotations

from mvllm.routing.policies.base import Policy, need


class Only(Policy):
    """Every request to `target` (while it is down, to the first backend alive)."""

    def __init__(self, target: str):
        self.name, self.target = f"{target}-only", target

    def choose(self, alive, candidates, request=None):
        return self.target if self.target in alive else alive[0]


def only(target: str):
    """The registry's factory of `target`-only: it checks that the backend exists."""

    def build(text: str, backends: list[str]) -> Policy:
        need(text, backends, target)
        return Only(target)

    return build
