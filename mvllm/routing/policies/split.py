"""split:K: a static split, the first K requests to the CPU (the reference experiment's oracle sweeps)."""

from __future__ import annotations

from mvllm.routing.policies.base import Policy, need


class Split(Policy):
    """The first K requests of a run go to the `offload` backend, the rest to the `home` backend (either one,
    while it is down, to the first backend alive)."""

    def __init__(self, k: int, offload: str, home: str):
        self.name, self.k, self.offload, self.home, self.seen = f"split:{k}", k, offload, home, 0

    def choose(self, alive, candidates, request=None):
        self.seen += 1
        target = self.offload if self.seen <= self.k else self.home
        return target if target in alive else alive[0]


def split(text: str, backends: list[str], k: int) -> Policy:
    """split:K is defined as K requests to the CPU: it offloads to the backend named "cpu" and keeps the rest
    on the one named "gpu", as the static splits of the reference experiment did."""
    need(text, backends, "cpu", "gpu")
    return Split(k, offload="cpu", home="gpu")
