"""Routing policies: each picks one backend name for a whole request.

One file per policy (mixed, eta with eta-caps and oracle, new_token_ratio, makespan, slo, sglang_cache, kv_cost,
only, round_robin, split, share), each a Policy (base.py: `choose`, the hooks, what the router must price for it) that
keeps its own state; registry.py holds the names `--policy` takes. sglang-cache and kv-cost are the field's
rules, as peers.
"""

from mvllm.routing.policies.base import Policy, Request, need
from mvllm.routing.policies.eta import ETA_MARGIN, Eta, EtaCaps, Oracle
from mvllm.routing.policies.kv_cost import KvCost
from mvllm.routing.policies.makespan import Makespan
from mvllm.routing.policies.mixed import Mixed
from mvllm.routing.policies.new_token_ratio import NewTokenRatio
from mvllm.routing.policies.only import Only
from mvllm.routing.policies.registry import PARAMETRISED, POLICIES, REGISTRY, is_known, make_policy, split_k
from mvllm.routing.policies.round_robin import RoundRobin
from mvllm.routing.policies.sglang_cache import SglangCache
from mvllm.routing.policies.split import Split

__all__ = ["ETA_MARGIN", "PARAMETRISED", "POLICIES", "REGISTRY", "Eta", "EtaCaps", "KvCost", "Makespan", "Mixed",
           "NewTokenRatio", "Oracle", "Only", "Policy", "Request", "RoundRobin", "SglangCache", "Split", "is_known",
           "make_policy", "need", "split_k"]
