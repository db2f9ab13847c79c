"""makespan: eta's model, choosing by the end of all booked work."""

from __future__ import annotations

from mvllm.routing.policies.eta import Eta


class Makespan(Eta):
    """The backend that keeps the predicted finish of all booked work earliest (eta's model and lengths); ties
    go to the request's own earliest finish. eta looks at one request; this looks at the batch, whose
    completion time is the metric the reference experiment reports."""

    name, needs_drain = "makespan", True

    def choose(self, alive, candidates, request=None):
        def batch_end(b: str) -> float:
            return max(candidates[x].drain if x == b else candidates[x].idle_drain for x in alive)

        return min(alive, key=lambda b: (round(batch_end(b), 6), candidates[b].eta))
