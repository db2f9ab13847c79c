"""share:P: a static share, the fraction P of the requests to the CPU, spread evenly over the run."""

from __future__ import annotations

import math

from mvllm.errors import InvalidRequestError
from mvllm.routing.policies.base import Policy, need


class Share(Policy):
    """Request n (from 1) goes to the `offload` backend where floor(n P) passes a whole number (Bresenham's
    line: after n requests, floor(n P) of them went there), the rest to the `home` backend (either one, while it
    is down, to the first backend alive). split:K sends the first K; this spreads them."""

    def __init__(self, text: str, p: float, offload: str, home: str):
        self.name, self.p, self.offload, self.home, self.seen = text, p, offload, home, 0

    def choose(self, alive, candidates, request=None):
        self.seen += 1
        n, p = self.seen, self.p
        target = self.offload if math.floor(n * p + 1e-9) > math.floor((n - 1) * p + 1e-9) else self.home
        return target if target in alive else alive[0]


def share(text: str, backends: list[str]) -> Policy:
    """share:P, 0 <= P <= 1, to the backend named "cpu", the rest to the one named "gpu" (as split:K)."""
    arg = text.partition(":")[2]
    try:
        p = float(arg)
    except ValueError:
        p = math.nan
    if not 0 <= p <= 1:
        raise InvalidRequestError(f"policy {text!r}: P must be a fraction from 0 to 1, e.g. share:0.1", "policy")
    need(text, backends, "cpu", "gpu")
    return Share(f"share:{p:g}", p, offload="cpu", home="gpu")
