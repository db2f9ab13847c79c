"""The traffic metrics of a run summary: prefix hit rate per backend, goodput under SLOs (vLLM's rule),
latency per prompt-length bucket, and the SLOs' parsing from the command line and the experiment file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mvllm.bench.display import run_line, table
from mvllm.bench.experiment import from_dict
from mvllm.bench.metrics import BUCKET_EDGES, RequestRecord, percentile, summarize
from mvllm.bench.results import aggregate, records_from_rows, request_rows, write_requests
from mvllm.errors import MvllmError
from mvllm.slo import SloError, parse_slo

ROOT = Path(__file__).resolve().parents[1]


def rec(i, ttft, e2el, out=10, backend="gpu", prompt=100, cached=50, error=""):
    arrival = float(i)
    finish = None if error else arrival + e2el
    return RequestRecord(i, arrival, prompt, arrival, arrival + ttft, finish, backend, cached, out, [], error)


def test_hit_rate_per_backend_is_cached_over_prompt_tokens_of_completed_requests():
    records = [rec(0, 0.1, 1, backend="gpu", prompt=100, cached=80),
               rec(1, 0.1, 1, backend="gpu", prompt=300, cached=0),
               rec(2, 0.1, 1, backend="cpu", prompt=200, cached=160),
               rec(3, 0.1, 1, backend="cpu", prompt=1000, cached=None),  # reported no cached count: left out
               rec(4, 0.1, 1, backend="ext", prompt=50, cached=None),
               rec(5, 0.1, 1, backend="gpu", prompt=900, cached=900, error="HTTP 500")]  # failed: left out
    s = summarize(records)
    assert s["backend_hit_rate"] == {"cpu": pytest.approx(0.8), "ext": None, "gpu": pytest.approx(0.2)}
    assert s["hit_rate"] == pytest.approx(240 / 600)
    assert "request_goodput" not in s and "slo" not in s  # only where SLOs are given
    assert summarize([rec(0, 0.1, 1, cached=None)])["hit_rate"] is None


def test_goodput_counts_exactly_the_requests_within_every_slo():
    records = [
        rec(0, 0.40, 2.0, out=11),  # ttft 400, tpot 160, e2el 2000: good
        rec(1, 0.60, 2.0, out=11),  # ttft over
        rec(2, 0.40, 6.0, out=11),  # e2el over (and tpot 560)
        rec(3, 0.50, 0.50, out=1),  # one token: tpot counts as 0 (vLLM), ttft exactly at its bound: good
        rec(4, 0.10, 5.0, out=11),  # tpot 490 over, e2el 5000 exactly at its bound
        rec(5, 0.10, 1.0, out=11, error="HTTP 400"),  # failed: never good
    ]
    slo = {"ttft_ms": 500.0, "tpot_ms": 200.0, "e2el_ms": 5000.0}
    s = summarize(records, duration=4.0, slo=slo)
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(0.5)
    assert s["slo"] == slo
    assert summarize(records, 4.0, {"e2el_ms": 5000.0})["good_requests"] == 4
    assert summarize(records, 4.0, {"tpot_ms": 200.0})["good_requests"] == 3  # 0, 1 and the one-token 3
    assert summarize(records, 0.0, slo)["request_goodput"] is None  # no duration: no rate


def test_bucket_quantiles():
    ttfts = [0.010, 0.020, 0.030, 0.040, 0.100]
    records = [rec(i, t, 1.0 + i, prompt=300 + i) for i, t in enumerate(ttfts)]
    records += [rec(10, 5.0, 9.0, prompt=20), rec(11, 0.5, 3.0, prompt=70_000)]
    s = summarize(records)
    assert [b["prompt_tokens"] for b in s["buckets"]] == ["0-63", "256-1023", "65536+"]
    b = s["buckets"][1]
    assert (b["lo"], b["hi"], b["count"]) == (256, 1024, 5)
    assert b["median_ttft_ms"] == pytest.approx(30.0)
    assert b["p95_ttft_ms"] == pytest.approx(percentile([10, 20, 30, 40, 100], 95))  # 88 ms
    assert b["p95_ttft_ms"] == pytest.approx(88.0)
    assert b["median_e2el_ms"] == pytest.approx(3000.0) and b["p95_e2el_ms"] == pytest.approx(4800.0)
    assert s["buckets"][2]["hi"] is None and BUCKET_EDGES[0] == 64


def test_aggregate_averages_hit_rate_and_goodput_per_backend():
    runs = []
    for run, cached in ((1, 20), (2, 60)):
        s = summarize([rec(0, 0.1, 1.0, cached=cached), rec(1, 0.1, 1.0, backend="cpu", cached=0)], 2.0,
                      {"ttft_ms": 500})
        runs.append(s | {"policy": "mixed", "run": run})
    row = aggregate(runs)[0]
    assert row["metrics"]["backend_hit_rate.gpu"]["mean"] == pytest.approx(0.4)
    assert row["metrics"]["backend_hit_rate.cpu"]["mean"] == 0.0
    assert row["metrics"]["hit_rate"]["mean"] == pytest.approx(0.2)
    assert row["metrics"]["request_goodput"]["mean"] == pytest.approx(1.0)
    out = Console(width=80, record=True)
    out.print(table([row], "t"))
    text = out.export_text()
    assert "prefix cache hit rate" in text and "within every SLO" in text  # the legend
    assert "20.0" in text and "gpu:40.0" in text and "cpu:0.0" in text and "1.00" in text
    line = run_line("mixed-run1", runs[0] | {"makespan": 1.0})
    assert "prefix hit rate 10.0% (cpu 0.0%, gpu 20.0%)" in line
    assert "goodput 1.00 req/s (2 of 2 within ttft 500 ms)" in line


def test_requests_csv_round_trips_to_records(tmp_path):
    r = RequestRecord(3, 0.5, 700, 0.51, 0.8, 1.6, "cpu", 512, 3, [0.8, 1.2, 1.6], "", max_tokens=64,
                      target_tokens=90, finish_reason="length", parent=1)
    bad = RequestRecord(4, 0.6, 10, None, None, 0.7, "", None, 0, [], "HTTP 500: x")
    write_requests(tmp_path / "requests.csv", [r, bad])
    back = records_from_rows(request_rows(tmp_path))
    assert back[1] == bad
    got = back[0]
    assert (got.max_tokens, got.target_tokens, got.finish_reason, got.parent) == (64, 90, "length", 1)
    assert got.cached_tokens == 512 and got.backend == "cpu" and got.sent == 0.51
    assert got.chunks == pytest.approx(r.chunks) and got.ttft == pytest.approx(r.ttft)


def test_slo_parsing():
    assert parse_slo(["ttft:500", "e2el:5000 tpot:50"]) == {"ttft_ms": 500.0, "e2el_ms": 5000.0, "tpot_ms": 50.0}
    assert parse_slo(["ttft_ms:1.5,e2el:20"]) == {"ttft_ms": 1.5, "e2el_ms": 20.0}
    for bad, said in (("ttft", "expected KEY:MS"), ("itl:5", "unknown metric 'itl'"), ("ttft:0", "positive"),
                      ("ttft:-5", "positive"), ("ttft:abc", "positive"), ("ttft:nan", "positive")):
        with pytest.raises(SloError, match=said):
            parse_slo([bad])


def test_experiment_goodput_is_checked():
    exp = from_dict({"name": "x", "model": "m", "goodput": {"ttft_ms": 500, "e2el_ms": 5000}})
    assert exp.goodput == {"ttft_ms": 500.0, "e2el_ms": 5000.0}
    assert from_dict({"name": "x", "model": "m"}).goodput is None
    for given, said in (({"ttft": 5}, "unknown key 'goodput.ttft'; known: goodput.ttft_ms, goodput.tpot_ms"),
                        ({"tpot_ms": 0}, "key 'goodput.tpot_ms' must be a positive number of milliseconds, got 0"),
                        ({"e2el_ms": "5"}, "key 'goodput.e2el_ms' must be a positive"),
                        ({"e2el_ms": True}, "key 'goodput.e2el_ms' must be a positive"),
                        (500, "key 'goodput' must be a table")):
        with pytest.raises(MvllmError, match="^experiment: " + said.replace("(", r"\(")):
            from_dict({"name": "x", "model": "m", "goodput": given})


def test_a_malformed_bench_goodput_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", "--goodput", "ttft:500", "--goodput",
                           "latency:3"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "unknown metric 'latency'" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_a_chunk_of_several_tokens_counts_them_all_and_its_gap_once():
    from mvllm.bench.client import _take

    rec, reply = RequestRecord(0, 0.0), []
    for stamp, ids in ((0.1, [5]), (0.4, [6, 7, 8]), (0.5, [9])):  # a lagging server merged three tokens
        assert _take(rec, {"choices": [{"text": "x", "token_ids": ids, "finish_reason": None}]}, stamp, reply) == len(ids)
    _take(rec, {"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]}, 0.5, reply)
    rec.finish, rec.output_tokens = rec.chunks[-1], sum(rec.chunk_tokens)  # as send() does without usage
    s = summarize([rec], duration=1.0)
    assert reply == [5, 6, 7, 8, 9] and rec.output_tokens == 5 and rec.chunk_tokens == [1, 3, 1]
    assert s["mean_tokens_per_chunk"] == pytest.approx(5 / 3)
    assert s["mean_tpot_ms"] == pytest.approx((0.5 - 0.1) / 4 * 1000)  # per token
    assert s["mean_itl_ms"] == pytest.approx((0.3 + 0.1) / 2 * 1000)  # a gap a chunk
