"""The tables bench, simulate, profile and report print read at 80 columns: no cell cut with '…', every
policy and backend name whole on one line, wide numbers and long names included."""

from __future__ import annotations

import random

from rich.console import Console

from mvllm.bench.display import table as bench_table
from mvllm.bench.results import aggregate

POLICIES = ["gpu-only", "new-token-ratio", "sglang-cache", "split:12", "eta-caps", "round-robin"]


def render(renderable, width: int = 80) -> str:
    out = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    out.print(renderable)
    return out.export_text()


def readable(text: str, names: list[str], width: int = 80) -> None:
    assert "…" not in text, text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width, text
    lines = text.splitlines()
    for name in names:
        assert any(name in line.split() for line in lines), f"{name!r} is not whole on one line:\n{text}"


def summaries(knob: str | None = None, slo: bool = False) -> list[dict]:
    """Runs of every policy (3 each) with wide numbers: 4-digit batch times, 5-digit tok/s and TTFTs."""
    rng = random.Random(0)
    out = []
    for value in ([None] if knob is None else [20, 1024]):
        for policy in POLICIES:
            for run in (1, 2, 3):
                s = {"policy": policy, "run": run, "knob": knob, "value": value,
                     "makespan": rng.uniform(900, 1900), "output_throughput": rng.uniform(9000, 19000),
                     "median_ttft_ms": rng.uniform(1000, 99000), "p95_ttft_ms": rng.uniform(10000, 99000),
                     "median_e2el_ms": rng.uniform(1000, 99000), "p95_e2el_ms": rng.uniform(10000, 99000),
                     "hit_rate": rng.random(), "backend_hit_rate": {"gpu": rng.random(), "cpu": rng.random()},
                     "backend_requests": {"cpu": rng.randrange(1000), "gpu": rng.randrange(10000)}}
                if slo:
                    s["request_goodput"] = rng.uniform(1, 999)
                out.append(s)
    return out


def test_bench_table_reads_at_80_columns():
    for knob, slo in ((None, False), ("workload.suffix_tokens", True)):
        rows = aggregate(summaries(knob, slo))
        text = render(bench_table(rows, "an-experiment-name: synthetic:qwen2.5-0.5b, means over runs"))
        readable(text, POLICIES)
        assert "TTFT" in text and "time to first token" in text and "cpu:" in text
        assert ("good" in text) == slo and ("suffix tokens" in text) == (knob is not None)


def test_simulate_table_reads_at_80_columns():
    from mvllm.bench.experiment import load
    from mvllm.simulate.sim import table

    exp = load("experiments/paper-48.toml")
    rows = [{"policy": p, "knob": "workload.suffix_tokens", "value": v, "makespan": 1234.56, "p95_ttft_ms": 98765.0,
             "backend_requests": {"cpu": 999, "gpu": 9999}, "kv_blocks": {"gpu": None, "cpu": 100},
             "band": {"spread": 0.08, "p95_ttft_ms": [90123.0, 99876.0]}} for v in (20, 1024) for p in POLICIES]
    real = {("gpu-only", 20): {"makespan": {"mean": 1111.11}, "p95_ttft_ms": {"mean": 91234.0}}}
    text = render(table(exp, rows, real))
    readable(text, POLICIES)
    assert "1235" in text and "1111" in text and "+11.1%" in text and "90123 -" in text


def test_profile_table_reads_at_80_columns():
    from mvllm.profile.run import table

    def backend(device, dtype, quant, threads):
        return {"device": device, "dtype": dtype, "quant": quant, "threads": threads, "ready_s": 123.4,
                "prefill": [{"kind": "cold", "tokens": n, "tok_s": 123456.0} for n in (64, 516, 4096)]
                + [{"kind": "warm", "tokens": 20, "ms": 1234.5}],
                "decode": [{"batch": b, "step_ms": 10.0 + b} for b in range(1, 65, 4)],
                "prefill_rate": 123456.0, "decode_rate": 12345.6, "serving": {"request_ms": 12.3, "step_ms": 1.23},
                "accuracy": {"note": "synthetic"}, "baseline": {"ratios": {"prefill": 1.23, "decode": 2.34}}}

    profile = {"model": "synthetic:qwen2.5-0.5b",
               "backends": {"gpu": backend("cuda", "bfloat16", "none", 1),
                            "cpu-int8": backend("cpu", "float32", "int8w-invariant", 64)}}
    text = render(table(profile))
    readable(text, ["gpu", "cpu-int8"])
    assert "123456 (4096)" in " ".join(text.split()) or "123456" in text


def test_report_summary_tables_read_at_80_columns(tmp_path):
    """The summary's tables over policies (means, change, where the requests went), rendered as markdown."""
    from rich.markdown import Markdown
    from test_report import experiment

    from mvllm.report.load import load
    from mvllm.report.summary import markdown

    for knob, values in ((None, (None,)), ("workload.suffix_tokens", (20, 1024))):
        out = experiment(tmp_path / str(knob), knob, values, policies=("gpu-only", "mixed", "new-token-ratio",
                                                                         "sglang-cache", "split:12"))
        md = markdown(load(out, {"ttft_ms": 300.0}), [], [])
        over_policies = md[md.index("## Means over runs"):md.index("## Every run")]
        assert "batch: batch completion time, s" in over_policies and "### Where the requests went" in over_policies
        text = render(Markdown(over_policies))
        readable(text, ["gpu-only", "mixed", "new-token-ratio", "sglang-cache", "split:12"])
        assert ("suffix tokens" in text) == (knob is not None)
