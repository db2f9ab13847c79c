"""Routing policies: each picks one backend name for a whole request.

Each policy class says what the router must compute for it (`needs_rates`, `needs_timing`, `needs_drain`,
`needs_blocks`) and which output lengths its timing assumes (`lengths`: "cap", the max_tokens a client sent;
"estimate", learned from finished requests, routing/lengths.py; "ratio", SGLang's new_token_ratio; "true", the
benchmark's own lengths, for the oracle). REGISTRY and PARAMETRISED are the one list of the names `--policy`
takes, and POLICIES is derived from them. sglang-cache and kv-cost are the field's rules, as peers.
"""

from __future__ import annotations

from collections.abc import Callable

from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.errors import InvalidRequestError
from mvllm.routing.cost import Candidate

ETA_MARGIN = 0.05  # the simulator's makespan error bar against the measured runs (docs/routing.md)


class Policy:
    name = ""
    needs_rates = False  # each backend's cost score: its profiled prefill_rate and decode_rate
    needs_timing = False  # eta's finish time of the request: the profile's per-batch decode step times
    needs_drain = False  # the finish of each backend's whole queue, with and without the request (eta's model)
    needs_score = False  # the reference cost score: each backend's pending prefill and decode under the caps
    needs_load = False  # each backend's booked requests and their KV blocks, without rates (the peers)
    needs_blocks = False  # the prompt's block hashes, and what the router sent each backend (sglang-cache)
    lengths = "cap"
    # (the router prices timing and drain on each backend's candidate, which its rates make: set needs_rates too)

    def choose(self, alive: list[str], candidates: dict[str, Candidate]) -> str:
        raise NotImplementedError


class Mixed(Policy):
    """The backend of the lowest cost score: the reference router's (routing/cost.py)."""

    name, needs_rates, needs_score = "mixed", True, True

    def choose(self, alive, candidates):
        return min(alive, key=lambda b: candidates[b].score)


class Eta(Policy):
    """The backend where the request is predicted to finish first (see routing/eta.py), each running request's
    remaining tokens estimated from the lengths of those that finished (routing/lengths.py), but a request stays on
    the home backend, the one of the highest profiled throughput (the GPU, where there is one), unless another
    is predicted to finish it more than ETA_MARGIN sooner: a gain smaller than the model's error is not worth
    moving a request (a fast CPU at low load would take requests for nothing but a later first token). Where
    the home backend has peers (backends within ETA_MARGIN of its throughput: a second GPU) that finish the
    request as soon, within the margin, the one that caches the longest prefix of it takes it (ties: home),
    so each prompt family stays where its blocks are."""

    name, needs_rates, needs_timing, lengths = "eta", True, True, "estimate"

    def __init__(self, name: str = "eta", lengths: str = "estimate"):
        self.name, self.lengths = name, lengths

    def choose(self, alive, candidates):
        best = min(alive, key=lambda b: candidates[b].eta)
        home = max(alive, key=lambda b: candidates[b].decode_rate)
        soon = candidates[best].eta * (1 + ETA_MARGIN)
        if candidates[home].eta > soon:
            return best
        floor = candidates[home].decode_rate * (1 - ETA_MARGIN)
        peers = [b for b in alive if candidates[b].decode_rate >= floor and candidates[b].eta <= soon]
        return max(peers, key=lambda b: (candidates[b].cached_prefix, b == home))


class SglangCache(Policy):
    """SGLang router's cache_aware rule, with its defaults, over token blocks: while the load (requests booked)
    is imbalanced, beyond BALANCE_ABS requests and BALANCE_REL times, the least loaded backend; else the
    backend the router sent the longest prefix of this prompt before, if it covers more than CACHE_THRESHOLD
    of the prompt; else the one it remembers sending the fewest blocks. It knows nothing of device speeds."""

    name, needs_load, needs_blocks = "sglang-cache", True, True
    BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD = 64, 1.5, 0.3

    def choose(self, alive, candidates):
        loads = [candidates[b].load for b in alive]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.BALANCE_ABS and hi > lo * self.BALANCE_REL:
            return min(alive, key=lambda b: candidates[b].load)
        best = max(alive, key=lambda b: candidates[b].sent_prefix)
        n = candidates[best].prompt_tokens
        if n and candidates[best].sent_prefix * BLOCK_SIZE / n > self.CACHE_THRESHOLD:
            return best
        return min(alive, key=lambda b: candidates[b].sent_blocks)


class KvCost(Policy):
    """Dynamo's KV router with its defaults (overlap weight 1, temperature 0): the backend of the lowest
    OVERLAP_WEIGHT x (the prompt's blocks not cached there) + (the blocks its requests hold, this one's
    included). It reads each backend's cache exactly (Dynamo's KV events) and knows nothing of device speeds."""

    name, needs_load, OVERLAP_WEIGHT = "kv-cost", True, 1.0

    def choose(self, alive, candidates):
        def cost(b: str) -> float:
            c = candidates[b]
            blocks = -(-c.prompt_tokens // BLOCK_SIZE)
            return self.OVERLAP_WEIGHT * (blocks - c.cached_prefix // BLOCK_SIZE) + c.active_blocks + blocks

        return min(alive, key=cost)


class Makespan(Policy):
    """The backend that keeps the predicted finish of all booked work earliest (eta's model); ties go to the
    request's own earliest finish. eta looks at one request; this looks at the batch, whose completion time
    is the metric the reference experiment reports."""

    name, needs_rates, needs_timing, needs_drain, lengths = "makespan", True, True, True, "estimate"

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
    """The first K requests of a run go to the `offload` backend, the rest to the `home` backend (either one,
    while it is down, to the first backend alive)."""

    def __init__(self, k: int, offload: str, home: str):
        self.name, self.k, self.offload, self.home, self.seen = f"split:{k}", k, offload, home, 0

    def choose(self, alive, candidates):
        self.seen += 1
        target = self.offload if self.seen <= self.k else self.home
        return target if target in alive else alive[0]


def need(text: str, backends: list[str], *names: str) -> None:
    """Policy `text` routes to these backend names: each must be one of `backends`."""
    for n in names:
        if n not in backends:
            raise InvalidRequestError(f"policy {text} needs a backend named {n!r}; backends are "
                                      f"{', '.join(backends)}", "policy")


def only(target: str) -> Callable[[str, list[str]], Policy]:
    def build(text: str, backends: list[str]) -> Policy:
        need(text, backends, target)
        return Only(target)

    return build


def split(text: str, backends: list[str], k: int) -> Policy:
    """split:K is defined as K requests to the CPU: it offloads to the backend named "cpu" and keeps the rest
    on the one named "gpu", as the static splits of the reference experiment did."""
    need(text, backends, "cpu", "gpu")
    return Split(k, offload="cpu", home="gpu")


# name -> factory(name, backend names); the names `--policy`, experiment files and the server's /v1/policy take
REGISTRY: dict[str, Callable[[str, list[str]], Policy]] = {
    "mixed": lambda text, backends: Mixed(),
    "eta": lambda text, backends: Eta(),
    "eta-caps": lambda text, backends: Eta("eta-caps", "cap"),
    "new-token-ratio": lambda text, backends: Eta("new-token-ratio", "ratio"),
    "oracle": lambda text, backends: Eta("oracle", "true"),
    "makespan": lambda text, backends: Makespan(),
    "gpu-only": only("gpu"),
    "cpu-only": only("cpu"),
    "round-robin": lambda text, backends: RoundRobin(list(backends)),
    "sglang-cache": lambda text, backends: SglangCache(),
    "kv-cost": lambda text, backends: KvCost(),
}
# HEAD -> factory(name, backend names, K) for the names HEAD:K, K a whole number >= 0
PARAMETRISED: dict[str, Callable[[str, list[str], int], Policy]] = {"split": split}
POLICIES = (*REGISTRY, *(f"{head}:K" for head in PARAMETRISED))


def is_known(name: str) -> bool:
    """Whether `name` is a policy make_policy builds (given the backends it needs): a registered name, or a
    parametrised one with a whole number K."""
    head, sep, k = name.partition(":")
    return name in REGISTRY if not sep else head in PARAMETRISED and k.isdecimal()


def split_k(name: str) -> int | None:
    """K of a well-formed "split:K" policy name; None for any other name."""
    head, _, k = name.partition(":")
    return int(k) if head == "split" and k.isdecimal() else None


def make_policy(text: str, backends: list[str]) -> Policy:
    """Build a policy from its name; checks that the backends it names exist."""
    if text in REGISTRY:
        return REGISTRY[text](text, backends)
    head, sep, arg = text.partition(":")
    if sep and head in PARAMETRISED:
        try:
            k = int(arg)
        except ValueError:
            k = -1
        if k < 0:
            raise InvalidRequestError(f"policy {text!r}: K must be a whole number >= 0, e.g. {head}:6", "policy")
        return PARAMETRISED[head](text, backends, k)
    raise InvalidRequestError(f"unknown policy {text!r}; known: {', '.join(POLICIES)}", "policy")
