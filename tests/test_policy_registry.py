"""A policy is its own class and one entry in the registry: a toy one, registered here and nowhere else, is a
name the experiment check takes, routes through the Router and the simulator, and hears every hook."""

from __future__ import annotations

import json
from pathlib import Path

from mvllm.bench import experiment as ex
from mvllm.routing.policies import REGISTRY, Policy, is_known
from mvllm.routing.router import Router
from mvllm.simulate import sim

ROOT = Path(__file__).resolve().parent.parent


class LeastBooked(Policy):
    """The backend with the fewest requests booked (ties: the first), keeping a list of what its hooks heard."""

    name = "least-booked"

    def start(self, router):
        super().start(router)
        self.heard = []

    def choose(self, alive, candidates, request=None):
        return min(alive, key=lambda b: len(self.router.bookings[b]))

    def routed(self, backend, request):
        self.heard.append(("routed", backend, request.request_id))

    def tokens(self, booking, count):
        self.heard.append(("tokens", booking.request_id, booking.generated))

    def step(self, backend):
        self.heard.append(("step", backend))

    def preempted(self, backend):
        self.heard.append(("preempted", backend))

    def finished(self, backend, booking, reason):
        self.heard.append(("finished", booking.request_id, reason))

    def dead(self, backend):
        self.heard.append(("dead", backend))


def register(monkeypatch) -> None:
    monkeypatch.setitem(REGISTRY, "least-booked", lambda text, backends: LeastBooked())


def test_a_policy_registered_alone_routes_and_hears_its_hooks(monkeypatch):
    register(monkeypatch)
    assert is_known("least-booked") and ex.check_policy("least-booked") == "least-booked"
    router = Router(["gpu", "cpu"], "least-booked")
    assert [router.route(f"r{i}", 10, 10, {}) for i in range(3)] == ["gpu", "cpu", "gpu"]
    router.on_scheduled("gpu", "r0", 0)
    router.on_tokens("gpu", "r0", 2)
    router.on_step("gpu")
    router.on_preempted("gpu")
    router.on_finished("gpu", "r0", "stop")
    assert router.route("r3", 10, 10, {}) == "gpu"  # one booked on each: the first
    assert router.on_dead("cpu") == ["r1"]
    assert router.policy.heard == [("routed", "gpu", "r0"), ("routed", "cpu", "r1"), ("routed", "gpu", "r2"),
                                   ("tokens", "r0", 2), ("step", "gpu"), ("preempted", "gpu"),
                                   ("finished", "r0", "stop"), ("routed", "gpu", "r3"), ("dead", "cpu")]
    router.set_policy("least-booked")  # a fresh policy: it has heard nothing
    assert router.policy.heard == []


def test_a_policy_registered_alone_is_simulated(monkeypatch):
    register(monkeypatch)
    exp = ex.load(ROOT / "experiments" / "paper-8.toml")
    profile = json.loads((ROOT / "results" / "paper-8" / "profile.json").read_text())
    [row] = sim.simulate(exp, profile, ["least-booked"], None)
    assert row["policy"] == "least-booked" and row["completed"] == 8
    assert sorted(row["backend_requests"]) == ["cpu", "gpu"] and min(row["backend_requests"].values()) > 0
