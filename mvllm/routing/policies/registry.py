"""The one list of the policy names `--policy`, experiment files and the server's /v1/policy take.

REGISTRY maps a name to its factory, factory(name, backend names) -> a fresh Policy; PARAMETRISED maps a
head to factory(name, backend names, K) for the names HEAD:K, K a whole number >= 0; FRACTIONS maps a head to
factory(name, backend names) for the names HEAD:P, P a fraction the factory checks. A new policy is its own
file in this package and one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from mvllm.errors import InvalidRequestError
from mvllm.routing.policies.base import Policy
from mvllm.routing.policies.eta import Eta, EtaCaps, Oracle
from mvllm.routing.policies.kv_cost import KvCost
from mvllm.routing.policies.makespan import Makespan
from mvllm.routing.policies.mixed import Mixed
from mvllm.routing.policies.new_token_ratio import NewTokenRatio
from mvllm.routing.policies.only import only
from mvllm.routing.policies.round_robin import RoundRobin
from mvllm.routing.policies.sglang_cache import SglangCache
from mvllm.routing.policies.share import share
from mvllm.routing.policies.slo import Slo
from mvllm.routing.policies.split import split

REGISTRY: dict[str, Callable[[str, list[str]], Policy]] = {
    "mixed": lambda text, backends: Mixed(),
    "eta": lambda text, backends: Eta(),
    "eta-caps": lambda text, backends: EtaCaps(),
    "new-token-ratio": lambda text, backends: NewTokenRatio(),
    "oracle": lambda text, backends: Oracle(),
    "makespan": lambda text, backends: Makespan(),
    "gpu-only": only("gpu"),
    "cpu-only": only("cpu"),
    "round-robin": lambda text, backends: RoundRobin(list(backends)),
    "sglang-cache": lambda text, backends: SglangCache(),
    "kv-cost": lambda text, backends: KvCost(),
    "slo": lambda text, backends: Slo(),
}
PARAMETRISED: dict[str, Callable[[str, list[str], int], Policy]] = {"split": split}
FRACTIONS: dict[str, Callable[[str, list[str]], Policy]] = {"share": share}
POLICIES = (*REGISTRY, *(f"{head}:K" for head in PARAMETRISED), *(f"{head}:P" for head in FRACTIONS))


def is_known(name: str) -> bool:
    """Whether `name` is a policy make_policy builds (given the backends it needs): a registered name, or a
    parametrised one with a whole number K."""
    head, sep, k = name.partition(":")
    if sep and head in FRACTIONS:
        return _fraction(k)
    return name in REGISTRY if not sep else head in PARAMETRISED and k.isdecimal()


def _fraction(text: str) -> bool:
    try:
        return 0 <= float(text) <= 1
    except ValueError:
        return False


def uses_slo(name: str) -> bool:
    """Whether the policy `name` routes by an SLO (the caller hands it one: the experiment's goodput table)."""
    return name in REGISTRY and getattr(REGISTRY[name](name, ["gpu", "cpu"]), "uses_slo", False)


def split_k(name: str) -> int | None:
    """K of a well-formed "split:K" policy name; None for any other name."""
    head, _, k = name.partition(":")
    return int(k) if head == "split" and k.isdecimal() else None


def make_policy(text: str, backends: list[str]) -> Policy:
    """Build a policy from its name; checks that the backends it names exist."""
    if text in REGISTRY:
        return REGISTRY[text](text, backends)
    head, sep, arg = text.partition(":")
    if sep and head in FRACTIONS:
        return FRACTIONS[head](text, backends)
    if sep and head in PARAMETRISED:
        try:
            k = int(arg)
        except ValueError:
            k = -1
        if k < 0:
            raise InvalidRequestError(f"policy {text!r}: K must be a whole number >= 0, e.g. {head}:6", "policy")
        return PARAMETRISED[head](text, backends, k)
    raise InvalidRequestError(f"unknown policy {text!r}; known: {', '.join(POLICIES)}", "policy")
