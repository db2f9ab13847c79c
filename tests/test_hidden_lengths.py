"""Lengths the router cannot see: benchmark_length ends a request where the workload says, the routing path never
reads it, a client that stops reading at the length frees the slot, and follow-up turns reuse their parent's KV."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest
from conftest import http_client, wait_for
from test_server import BACKENDS, MODEL, complete, mixed, wait_pools_full  # noqa: F401 (mixed: a fixture)

from mvllm.bench import experiment as ex
from mvllm.bench.client import replay
from mvllm.bench.experiment import Workload
from mvllm.bench.results import request_rows
from mvllm.bench.runner import bench
from mvllm.bench.workload import Request, build_all

ROOT = Path(__file__).resolve().parents[1]
TRUE_LENGTH_NAMES = {"stop_at", "benchmark_length", "target_tokens"}


@pytest.fixture
def server(mixed):  # noqa: F811
    """test_server's module server: two CPU backends, policy mixed with a profile, a routing log."""
    return mixed


def decisions(path: Path) -> list[dict]:
    return [d for d in map(json.loads, path.read_text().splitlines()) if "candidates" in d]


def test_benchmark_length_ends_the_request_with_stop_and_leaves_routing_as_it_was(server):
    before = len(decisions(server.routing_log))
    told = complete(server, max_tokens=40, ignore_eos=True)
    hidden = complete(server, max_tokens=40, ignore_eos=True, benchmark_length=7)
    told_c, hidden_c = told.json()["choices"][0], hidden.json()["choices"][0]
    assert (told_c["finish_reason"], len(told_c["token_ids"])) == ("length", 40)
    assert (hidden_c["finish_reason"], len(hidden_c["token_ids"])) == ("stop", 7)
    assert hidden_c["token_ids"] == told_c["token_ids"][:7]  # greedy: the same tokens, ended early
    assert hidden.json()["usage"]["completion_tokens"] == 7
    a, b = decisions(server.routing_log)[before:]
    for d in (a, b):
        d.pop("time"), d.pop("request_id")
    assert a == b and a["max_tokens"] == 40  # the router saw the cap, the same with or without the field
    bad = complete(server, max_tokens=40, benchmark_length=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "benchmark_length"


def test_the_routing_path_reads_a_true_length_only_for_the_oracle():
    """The true length enters the router as `length` (a booking's), and only Router.expect reads it, in the
    branch of the oracle's lengths ("true"); the server passes the benchmark's field there and nowhere else."""
    for path in (ROOT / "mvllm" / "routing").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not names & TRUE_LENGTH_NAMES, path
        readers = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                   for n in ast.walk(f) if isinstance(n, ast.Attribute) and n.attr == "length"
                   and isinstance(n.ctx, ast.Load)}
        assert readers <= ({"expect"} if path.name == "router.py" else set()), (path, readers)
    expect = next(f for f in ast.walk(ast.parse((ROOT / "mvllm" / "routing" / "router.py").read_text()))
                  if isinstance(f, ast.FunctionDef) and f.name == "expect")
    text = ast.unparse(expect)
    assert text.index("b.length") > text.rindex("if kind == 'ratio'")  # past every other kind's return
    cluster = ast.parse((ROOT / "mvllm" / "server" / "cluster.py").read_text())
    uses = [n for n in ast.walk(cluster) if isinstance(n, ast.Attribute) and n.attr == "stop_at"]
    route_calls = [n for n in ast.walk(cluster) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "route"
                   and "self.router" in ast.unparse(n.func)]
    assert len(uses) == 1 and len(route_calls) == 1 and ast.unparse(route_calls[0].args[-1]) == "params.stop_at"


def test_a_client_that_stops_reading_at_the_length_frees_the_slot(server):
    reqs = [Request(i, [3 + i, 4, 5, 6, 7], 4 + i, 0.02 * i, max_tokens=1500) for i in range(6)]
    records, _, _ = asyncio.run(replay(server.url, MODEL, reqs, 120.0, stop="disconnect"))
    assert all(r.ok and r.finish_reason == "disconnect" for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [4 + i for i in range(6)]
    assert all(free == total for free, total in wait_pools_full(server).values())

    def notes() -> dict:
        lines = map(json.loads, server.routing_log.read_text().splitlines())
        return {d["aborted"]: d for d in lines if "aborted" in d}

    wait_for(lambda: len(notes()) >= 6, message="an abort note per disconnected request")
    notes = notes()
    # every aborted request had made far fewer tokens than its 1,500-token cap: the slot came back early
    assert all(n["generated"] < 1500 for n in notes.values())


def test_follow_up_turns_wait_for_the_reply_and_reuse_its_blocks(server):
    w = Workload(kind="shared-prefix", groups=1, prompts_per_group=2, prefix_tokens=48, suffix_tokens=8,
                 output_tokens=20, turns=2, think_time=0.3, arrival="fixed", interval=1.0, max_tokens=64)
    reqs = build_all(w, 512).requests
    records, _, _ = asyncio.run(replay(server.url, MODEL, reqs, 120.0, vocab=512))
    by_id = {r.id: r for r in records}
    follow = [r for r in records if r.parent is not None]
    assert len(follow) == 2 and all(r.ok for r in records)
    for r in follow:
        parent = by_id[r.parent]
        assert r.sent >= parent.finish + 0.3 - 1e-6
        assert r.prompt_tokens == parent.prompt_tokens + parent.output_tokens + 8
        if r.backend == parent.backend:
            assert r.cached_tokens >= (parent.prompt_tokens + parent.output_tokens - 1) // 16 * 16
    assert all(r.finish_reason == "stop" and r.output_tokens == r.target_tokens for r in records)


def test_bench_replays_hidden_lengths_end_to_end(tmp_path):
    e = ex.from_dict({"name": "hidden", "model": MODEL, "backends": BACKENDS, "policies": ["round-robin"], "runs": 1,
                      "workload": {"kind": "random", "requests": 8, "suffix_tokens": 24, "output_tokens": 12,
                                   "range_ratio": 0.5, "arrival": "fixed", "interval": 0.05, "max_tokens": 200,
                                   "vocab": 512}})
    bench(e, tmp_path, quiet=True)
    run = tmp_path / "round-robin-run1"
    rows = request_rows(run)
    assert len(rows) == 8 and all(r["finish_reason"] == "stop" and r["max_tokens"] == "200" for r in rows)
    assert all(r["output_tokens"] == r["target_tokens"] for r in rows)
    assert len({r["target_tokens"] for r in rows}) > 1
    assert all(d["max_tokens"] == 200 for d in decisions(run / "routing.jsonl"))
    sel = json.loads((tmp_path / "workload.json").read_text())
    assert sel["kind"] == "random" and sel["requests"] == 8 and sel["lengths"] == "hidden"


def test_bad_benchmark_length_types_get_a_400(server):
    for value in (-3, "seven", 1.5):
        r = complete(server, max_tokens=8, benchmark_length=value)
        assert r.status_code == 400, r.text
    assert http_client.get(f"{server.url}/health").status_code == 200
