"""The run summary: vLLM's key names and definitions, percentiles against a hand-computed example."""

from __future__ import annotations

import math
import random

import pytest

from mvllm.bench.metrics import RequestRecord, percentile, stats, summarize, tails


def test_percentiles_match_a_hand_computed_example():
    s = stats("ttft", [0.1, 0.2, 0.3, 0.4, 1.0])  # seconds in, ms out
    assert s["mean_ttft_ms"] == pytest.approx(400.0)
    assert s["median_ttft_ms"] == pytest.approx(300.0)
    # rank 0.95 * 4 = 3.8: 400 + 0.8 * (1000 - 400); rank 0.99 * 4 = 3.96: 400 + 0.96 * 600
    assert s["p95_ttft_ms"] == pytest.approx(880.0)
    assert s["p99_ttft_ms"] == pytest.approx(976.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt((300**2 + 200**2 + 100**2 + 0 + 600**2) / 5))


def test_percentile_edges():
    assert percentile([7.0], 95) == 7.0
    assert percentile([3.0, 1.0], 50) == 2.0  # unsorted input, interpolated
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)
    assert stats("itl", [])["p99_itl_ms"] is None


def rec(i, arrival, first, finish, out, backend="gpu", cached=496, chunks=None, error=""):
    return RequestRecord(i, arrival, prompt_tokens=516, sent=arrival, first_token=first, finish=finish,
                         backend=backend, cached_tokens=cached, output_tokens=out, chunks=chunks or [], error=error)


def test_summary_follows_vllm_definitions():
    records = [
        rec(0, 0.00, 0.10, 1.10, 11, chunks=[0.10, 0.60, 1.10]),
        rec(1, 0.05, 0.20, 1.20, 11, backend="cpu", cached=480, chunks=[0.20, 1.20]),
        rec(2, 0.10, 0.40, 1.50, 11),
        rec(3, 0.15, None, 0.30, 0, error="HTTP 400: bad"),
    ]
    s = summarize(records, duration=1.6)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 3 * 516 and s["total_output_tokens"] == 33
    assert s["duration"] == 1.6
    assert s["makespan"] == pytest.approx(1.5)
    assert s["request_throughput"] == pytest.approx(3 / 1.6)
    assert s["output_throughput"] == pytest.approx(33 / 1.6)
    assert s["total_token_throughput"] == pytest.approx((3 * 516 + 33) / 1.6)
    # ttft from the scheduled send: 100, 150, 300 ms
    assert s["mean_ttft_ms"] == pytest.approx(550 / 3)
    assert s["median_ttft_ms"] == pytest.approx(150.0)
    # e2el 1100, 1150, 1400 ms; tpot = (e2el - ttft) / (out - 1) = 100, 100, 110 ms
    assert s["median_e2el_ms"] == pytest.approx(1150.0)
    assert s["mean_tpot_ms"] == pytest.approx(310 / 3)
    # itl pooled over requests: 500, 500, 1000 ms
    assert s["median_itl_ms"] == pytest.approx(500.0)
    assert s["mean_itl_ms"] == pytest.approx(2000 / 3)
    assert s["backend_requests"] == {"cpu": 1, "gpu": 2}
    assert s["backend_cached_tokens"] == {"cpu": 480, "gpu": 992}
    assert s["total_cached_tokens"] == 1472
    assert s["max_send_delay_ms"] == 0.0
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p95", "p99"):
            assert f"{k}_{m}_ms" in s


def test_summary_of_only_failures_has_no_latencies():
    s = summarize([rec(0, 0.0, None, 0.2, 0, error="boom")])
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["median_ttft_ms"] is None and s["total_output_tokens"] == 0
    assert s["duration"] == pytest.approx(0.2)


def test_pooled_itl_and_tails_are_the_plain_definitions_to_the_last_bit():
    """The gaps go through numpy (a simulated trace has millions): the same floats as r.itl pooled in request
    order, summed in that order; the band's keys (tails) are summarize's."""
    rng = random.Random(5)
    records = []
    for i in range(400):
        t, chunks = rng.random() * 50, []
        for _ in range(rng.choice([0, 1, 2, 7, 60])):
            t += rng.expovariate(200) * rng.choice([1, 1e-3, 40])
            chunks.append(t)
        done = bool(chunks) or rng.random() < 0.5
        records.append(rec(i, chunks[0] - 0.2 if chunks else 1.0, chunks[0] if chunks else (1.3 if done else None),
                           t + 0.01 if done else None, len(chunks), backend=rng.choice(["gpu", "cpu", "mps"]),
                           chunks=chunks, error="" if done else "refused"))
    s = summarize(records)
    ok = [r for r in records if r.ok]
    gaps = [1000.0 * g for r in ok for g in r.itl]
    assert s["mean_itl_ms"] == sum(gaps) / len(gaps)
    assert s["std_itl_ms"] == math.sqrt(sum((g - s["mean_itl_ms"]) ** 2 for g in gaps) / len(gaps))
    assert (s["median_itl_ms"], s["p99_itl_ms"]) == (percentile(gaps, 50), percentile(gaps, 99))
    for b in ("gpu", "cpu", "mps"):
        mine = [1000.0 * g for r in ok if r.backend == b for g in r.itl]
        assert s["backend_max_itl_ms"][b] == max(mine)
        assert s["backend_p99_itl_ms"][b] == percentile(mine, 99)
        assert type(s["backend_p99_itl_ms"][b]) is float
    assert s["max_itl_ms"] == max(gaps)
    assert tails(records) == {k: s[k] for k in ("makespan", "p95_ttft_ms", "p95_e2el_ms")}
