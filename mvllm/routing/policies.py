"""Routing policies: each picks one backend name for a whole request."""

from __future__ import annotations

from mvllm.errors import InvalidRequestError
from mvllm.routing.cost import Candidate

ETA_MARGIN = 0.05  # the simulator's makespan error bar against the measured runs (issue 13)
POLICIES = ("mixed", "eta", "makespan", "gpu-only", "cpu-only", "round-robin", "split:K")


class Policy:
    name = ""
    needs_scores = False

    def choose(self, alive: list[str], candidates: dict[str, Candidate]) -> str:
        raise NotImplementedError


class Mixed(Policy):
    name, needs_scores = "mixed", True

    def choose(self, alive, candidates):
        return min(alive, key=lambda b: candidates[b].score)


class Eta(Policy):
    """The backend where the request is predicted to finish first (see routing/eta.py), but a request stays on
    the home backend, the one of the highest profiled throughput (the GPU, where there is one), unless another
    is predicted to finish it more than ETA_MARGIN sooner: a gain smaller than the model's error is not worth
    moving a request (a fast CPU at low load would take requests for nothing but a later first token)."""

    name, needs_scores = "eta", True

    def choose(self, alive, candidates):
        best = min(alive, key=lambda b: candidates[b].eta)
        home = max(alive, key=lambda b: candidates[b].decode_rate)
        return home if candidates[home].eta <= candidates[best].eta * (1 + ETA_MARGIN) else best


class Makespan(Policy):
    """The backend that keeps the predicted finish of all booked work earliest (eta's model); ties go to the
    request's own earliest finish. eta looks at one request; this looks at the batch, as the brief's metric."""

    name, needs_scores = "makespan", True

    def choose(self, alive, candidates):
        def batch_end(b: str) -> float:
            return max(candidates[x].drain if x == b else candidates[x].idle_drain for x in alive)

        return min(alive, key=lambda b: (round(batch_end(b), 6), candidates[b].eta))


class Only(Policy):
    def __init__(self, target: str):
        self.name, self.target = f"{target}-only", target

    def choose(self, alive, candidates):
        return self.target if self.target in alive else alive[0]


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, backends: list[str]):
        self.backends, self.next = backends, 0

    def choose(self, alive, candidates):
        for _ in range(len(self.backends)):
            name = self.backends[self.next % len(self.backends)]
            self.next += 1
            if name in alive:
                return name
        return alive[0]


class Split(Policy):
    """The first K requests of a run go to the cpu backend, the rest to the gpu backend."""

    def __init__(self, k: int):
        self.name, self.k, self.seen = f"split:{k}", k, 0

    def choose(self, alive, candidates):
        self.seen += 1
        target = "cpu" if self.seen <= self.k else "gpu"
        return target if target in alive else alive[0]


def split_k(name: str) -> int | None:
    """K of a well-formed "split:K" policy name; None for any other name."""
    head, _, k = name.partition(":")
    return int(k) if head == "split" and k.isdigit() else None


def make_policy(text: str, backends: list[str]) -> Policy:
    """Build a policy from its name; checks that the backends it names exist."""

    def need(*names):
        for n in names:
            if n not in backends:
                raise InvalidRequestError(f"policy {text} needs a backend named {n!r}; backends are "
                                          f"{', '.join(backends)}", "policy")

    if text == "mixed":
        return Mixed()
    if text == "eta":
        return Eta()
    if text == "makespan":
        return Makespan()
    if text in ("gpu-only", "cpu-only"):
        need(text.split("-")[0])
        return Only(text.split("-")[0])
    if text == "round-robin":
        return RoundRobin(list(backends))
    if text.startswith("split:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            k = -1
        if k < 0:
            raise InvalidRequestError(f"policy {text!r}: K must be a whole number >= 0, e.g. split:6", "policy")
        need("cpu", "gpu")
        return Split(k)
    raise InvalidRequestError(f"unknown policy {text!r}; known: {', '.join(POLICIES)}", "policy")
