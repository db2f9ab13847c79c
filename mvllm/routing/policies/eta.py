"""eta, and eta with other output lengths (eta-caps, oracle): the backend where the request is predicted to
finish first, by the replay of each backend's queue (routing/eta.py)."""

from __future__ import annotations

from mvllm.routing.policies.base import Policy

ETA_MARGIN = 0.05  # the simulator's makespan error bar against the measured runs (docs/routing.md)


class Eta(Policy):
    """The backend where the request is predicted to finish first, each running request's remaining tokens
    estimated from the lengths of those that finished (the router's length estimate, routing/lengths.py), but a
    request stays on the home backend, the one of the highest profiled throughput (the GPU, where there is one),
    unless another is predicted to finish it more than ETA_MARGIN sooner: a gain smaller than the model's error
    is not worth moving a request (a fast CPU at low load would take requests for nothing but a later first
    token). Where the home backend has peers (backends within ETA_MARGIN of its throughput: a second GPU) that
    finish the request as soon, within the margin, the one that caches the longest prefix of it takes it (ties:
    home), so each prompt family stays where its blocks are."""

    name, needs_rates, needs_timing, lengths = "eta", True, True, "estimate"

    def choose(self, alive, candidates, request=None):
        best = min(alive, key=lambda b: candidates[b].eta)
        home = max(alive, key=lambda b: candidates[b].decode_rate)
        soon = candidates[best].eta * (1 + ETA_MARGIN)
        if candidates[home].eta > soon:
            return best
        floor = candidates[home].decode_rate * (1 - ETA_MARGIN)
        peers = [b for b in alive if candidates[b].decode_rate >= floor and candidates[b].eta <= soon]
        return max(peers, key=lambda b: (candidates[b].cached_prefix, b == home))


class EtaCaps(Eta):
    """eta with every request counted at its cap."""

    name, lengths = "eta-caps", "cap"


class Oracle(Eta):
    """eta with the true lengths, where the benchmark sends them (else the cap)."""

    name, lengths = "oracle", "true"
