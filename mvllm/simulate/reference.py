"""The reference machine (the seed experiment's brief: an Apple M2's CPU and Metal GPU) as a profile made from its
published aggregate rates, for the simulator: experiments/m2_reference.py and the tests model that machine.

A decode rate measured with 4 running requests fixes the step at batch 4: step(4) = 4 / rate. Below 4 the step
follows step(b) = step(4) * (f + (1 - f) * b / 4), f the share of a batch-4 step that does not depend on the
batch (experiments/m2_reference.py says why and which f it brackets)."""

from __future__ import annotations

BRIEF = {"gpu": {"prefill": 2551.0, "decode": 293.0}, "cpu": {"prefill": 73.0, "decode": 45.0}}


def profile(share: float) -> dict:
    backends = {}
    for name, r in BRIEF.items():
        step4 = 4 / r["decode"]
        decode = [{"batch": b, "step_ms": 1000 * step4 * (share + (1 - share) * b / 4), "tok_s": 0.0}
                  for b in range(1, 5)]
        for d in decode:
            d["tok_s"] = d["batch"] / d["step_ms"] * 1000
        backends[name] = {"prefill_rate": r["prefill"], "decode_rate": r["decode"], "decode": decode,
                          "prefill": [{"kind": "cold", "tokens": 516, "ms": 516 / r["prefill"] * 1000,
                                       "tok_s": r["prefill"]}]}
    return {"note": f"from BRIEF.md's aggregate rates, step(b) = step(4) * ({share} + {1 - share:.2f} * b / 4)",
            "backends": backends}
