"""Workload kinds: trace (Mooncake), random, shared-prefix with turns, custom; lengths told or hidden; bad input."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mvllm.bench import experiment as ex
from mvllm.bench.experiment import ExperimentError, Workload
from mvllm.bench.workload import build_all, full_prompt, token_range
from mvllm.cli import app

ROOT = Path(__file__).resolve().parents[1]
SLICE = ROOT / "experiments" / "traces" / "conversation-10min.jsonl.gz"
VOCAB = 1000


def trace(tmp_path: Path, rows: list[dict], name: str = "t.jsonl", gz: bool = False) -> Path:
    path = tmp_path / (name + (".gz" if gz else ""))
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


ROWS = [  # 4-token blocks below (block_tokens = 4): request 1 shares request 0's first two blocks
    {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 12, "output_length": 7, "hash_ids": [1, 2, 4]},
    {"timestamp": 1500, "input_length": 3, "output_length": 2, "hash_ids": [5]},
    {"timestamp": 4000, "input_length": 8, "output_length": 9, "hash_ids": [1, 6]},
]


def test_trace_blocks_are_fixed_per_hash_id_and_the_last_one_is_cut(tmp_path):
    w = Workload(kind="trace", path=str(trace(tmp_path, ROWS)), block_tokens=4)
    reqs = build_all(w, VOCAB).requests
    assert [len(r.prompt) for r in reqs] == [10, 12, 3, 8]
    assert [r.output_tokens for r in reqs] == [5, 7, 2, 9]
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.5, 4.0]
    a, b, c, d = (r.prompt for r in reqs)
    assert a[:8] == b[:8] and a[8:10] != b[8:10]  # ids 1, 2 shared, then 3 against 4
    assert d[:4] == a[:4] and d[4:8] != a[4:8]
    lo, hi = token_range(VOCAB)
    assert all(lo <= t < hi for r in reqs for t in r.prompt)
    again = build_all(Workload(kind="trace", path=str(trace(tmp_path, ROWS[1:], "u.jsonl", gz=True)),
                               block_tokens=4), VOCAB).requests
    assert again[0].prompt == b  # an id's tokens do not depend on which other lines were read
    assert all(r.cap is None and not r.told for r in reqs)  # hidden by default, no cap


def test_trace_scale_speedup_window_and_max_requests(tmp_path):
    path = str(trace(tmp_path, ROWS))
    w = Workload(kind="trace", path=path, block_tokens=4, scale=2, speedup=2, start=0.5, duration=3.0)
    reqs = build_all(w, VOCAB).requests
    assert [len(r.prompt) for r in reqs] == [6, 2]  # ceil(12 / 2), ceil(3 / 2): 2-token blocks
    assert [r.output_tokens for r in reqs] == [4, 1]  # round(7 / 2), at least 1
    assert [r.arrival for r in reqs] == [0.0, 0.5]  # (t - start) / speedup
    assert len(build_all(Workload(kind="trace", path=path, block_tokens=4, max_requests=2), VOCAB).requests) == 2
    fixed = build_all(Workload(kind="trace", path=path, block_tokens=4, arrival="fixed", interval=0.1), VOCAB)
    assert [round(r.arrival, 6) for r in fixed.requests] == [0.0, 0.1, 0.2, 0.3]


def test_over_the_context_is_dropped_or_clipped_and_counted(tmp_path):
    path = str(trace(tmp_path, ROWS))
    dropped = build_all(Workload(kind="trace", path=path, block_tokens=4, max_prompt_tokens=9), VOCAB)
    assert [len(r.prompt) for r in dropped.requests] == [3, 8]
    assert dropped.selection["dropped"] == {"over_context": 2, "clipped": 0}
    clipped = build_all(Workload(kind="trace", path=path, block_tokens=4, max_prompt_tokens=9, over="clip"), VOCAB)
    assert [len(r.prompt) for r in clipped.requests] == [9, 9, 3, 8]
    assert clipped.selection["dropped"] == {"over_context": 0, "clipped": 2}
    # the model's context (2048 for tiny-qwen2) must hold the prompt and the cap the client sends
    big = [{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": list(range(500))}] + ROWS
    capped = Workload(kind="trace", path=str(trace(tmp_path, big, "big.jsonl")), block_tokens=4, max_tokens=100)
    got = build_all(capped, VOCAB, "synthetic:tiny-qwen2")
    assert len(got.requests) == 4 and got.selection["dropped"]["over_context"] == 1


def test_selection_reports_quantiles_span_and_reusable_share(tmp_path):
    w = Workload(kind="trace", path=str(trace(tmp_path, ROWS)), block_tokens=4)
    sel = build_all(w, VOCAB).selection
    assert sel["requests"] == 4 and sel["span_s"] == 4.0 and sel["rate_per_s"] == pytest.approx(0.75)
    assert sel["prompt_tokens"]["max"] == 12 and sel["output_tokens"]["p50"] == 6
    assert sel["reusable_prompt_share"] == 0.0  # no full 16-token block in any prompt
    w = Workload(kind="trace", path=str(trace(tmp_path, [dict(r, input_length=32, hash_ids=[1, 2])
                                                         for r in ROWS[:2]], "s.jsonl")), block_tokens=16)
    assert build_all(w, VOCAB).selection["reusable_prompt_share"] == pytest.approx(0.5)


def test_the_shipped_slice_is_the_trace_as_documented():
    w = Workload(kind="trace", path=str(SLICE))
    built = build_all(w, 151936)
    assert len(built.requests) == 1750 and built.requests[-1].arrival < 600
    lines = [json.loads(x) for x in gzip.open(SLICE, "rt")]
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 512) for r in lines)


def test_random_lengths_stay_in_the_range():
    w = Workload(kind="random", requests=300, prefix_tokens=8, suffix_tokens=100, output_tokens=40, range_ratio=0.5)
    reqs = build_all(w, VOCAB).requests
    assert all(8 + 50 <= len(r.prompt) <= 8 + 150 and 20 <= r.output_tokens <= 60 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 50 and all(r.prompt[:8] == reqs[0].prompt[:8] for r in reqs)
    told = build_all(Workload(kind="random", requests=5, lengths="told"), VOCAB).requests
    assert all(r.told and r.cap == r.output_tokens for r in told)


def test_shared_prefix_groups_and_turns():
    w = Workload(kind="shared-prefix", groups=3, prompts_per_group=4, prefix_tokens=32, suffix_tokens=8,
                 output_tokens=6, turns=3, think_time=0.5, max_tokens=64)
    reqs = build_all(w, VOCAB).requests
    firsts = [r for r in reqs if r.parent is None]
    assert len(firsts) == 12 and len(reqs) == 36
    assert len({tuple(r.prompt[:32]) for r in firsts}) == 3  # one system prompt per group
    ids = {r.id: r for r in reqs}
    for r in reqs:
        if r.parent is not None:
            assert r.parent < r.id and r.arrival == 0.5 and len(r.prompt) == 8
    turn2 = next(r for r in reqs if r.parent is not None)
    parent = ids[turn2.parent]
    whole = full_prompt(turn2, parent.prompt, [7] * parent.output_tokens)
    assert whole[:len(parent.prompt)] == parent.prompt and len(whole) == len(parent.prompt) + 6 + 8
    assert all(r.cap == 64 for r in reqs)


def test_custom_prompt_tokens_timestamps_and_hidden_cap(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt_tokens": [5, 6, 7], "output_tokens": 4, "timestamp": 2000}\n\n'
                    '{"prompt_tokens": [8, 9], "output_tokens": 300, "timestamp": 1000}\n')
    w = Workload(kind="custom", path=str(path), arrival="trace", max_tokens=100)
    built = build_all(w, VOCAB)
    assert [(r.prompt, r.arrival) for r in built.requests] == [([8, 9], 0.0), ([5, 6, 7], 1.0)]
    assert [r.output_tokens for r in built.requests] == [100, 4]  # a length past the cap ends at the cap
    assert built.selection["outputs_cut_to_cap"] == 1


def test_prefix_kind_is_unchanged_and_can_draw_hidden_lengths_from_a_trace(tmp_path):
    plain = build_all(Workload(requests=4), VOCAB).requests
    assert all(r.told and r.output_tokens == 128 and len(r.prompt) == 516 for r in plain)
    w = Workload(requests=200, lengths="hidden", max_tokens=2048, output_from=str(SLICE), scale=2.68)
    reqs = build_all(w, VOCAB).requests
    assert [r.prompt for r in reqs[:4]] == [r.prompt for r in plain]  # prompts do not move
    mean = sum(r.output_tokens for r in reqs) / len(reqs)
    assert 100 < mean < 160 and len({r.output_tokens for r in reqs}) > 50 and all(r.cap == 2048 for r in reqs)


def test_the_shipped_experiments_of_every_kind_load_and_build():
    kinds = set()
    for name in ("trace-conversation", "random", "shared-prefix", "paper-48-hidden"):
        e = ex.load(ROOT / "experiments" / f"{name}.toml")
        kinds.add(e.workload.kind)
        built = build_all(e.workload, 151936, e.model)
        assert built.requests and all(not r.told for r in built.requests)
    e = ex.load(ROOT / "experiments" / "custom.toml")
    assert e.workload.kind == "custom" and Path(e.workload.path).is_file()
    assert kinds == {"trace", "random", "shared-prefix", "prefix"}


def experiment(tmp_path: Path, workload: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(f'name = "x"\nmodel = "synthetic:tiny-qwen2"\nbackends = "gpu=cpu,cpu=cpu"\n'
                 f'policies = ["gpu-only"]\n[workload]\n{workload}\n')
    return p


@pytest.mark.parametrize("workload,message", [
    ('kind = "trace"\npath = "nowhere.jsonl"', "no file"),
    ('kind = "trace"\npath = "BAD"\nblock_tokens = 4', "bad.jsonl:2: not a JSON object"),
    ('kind = "trace"\npath = "INCONSISTENT"', "inconsistent.jsonl:1: 2 hash_ids for input_length 10"),
    ('kind = "trace"\npath = "GOOD"\nblock_tokens = 4\nstart = 100', "holds no request"),
    ('kind = "trace"\npath = "GOOD"\ngroups = 3', "'workload.groups' does not apply to kind 'trace'"),
    ('kind = "poisson-trace"', "'workload.kind' must be one of prefix, trace"),
    ('kind = "random"\nlengths = "secret"', "'workload.lengths' must be one of told, hidden"),
    ('kind = "random"\narrival = "trace"', "needs kind trace or custom"),
    ('kind = "trace"', "'workload.path' is needed"),
])
def test_bad_workloads_get_one_line_and_a_nonzero_exit(tmp_path, workload, message):
    good = trace(tmp_path, ROWS, "good.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    trace(tmp_path, [dict(ROWS[0], hash_ids=[1, 2])], "inconsistent.jsonl")
    workload = (workload.replace("BAD", str(tmp_path / "bad.jsonl")).replace("GOOD", str(good))
                .replace("INCONSISTENT", str(tmp_path / "inconsistent.jsonl")))
    path = experiment(tmp_path, workload)
    profile = tmp_path / "profile.json"
    entry = {"prefill_rate": 1000.0, "decode_rate": 100.0, "decode": [{"batch": 1, "step_ms": 10.0}]}
    profile.write_text(json.dumps({"backends": {"gpu": entry, "cpu": entry}}))
    for command in (["bench", str(path), "--out", str(tmp_path / "out")],
                    ["simulate", str(path), "--profile", str(profile)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code != 0, result.output
        assert message in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output
    assert not list((tmp_path / "out").glob("*/summary.json"))


def test_inconsistent_hash_ids_name_the_rule(tmp_path):
    w = Workload(kind="trace", path=str(trace(tmp_path, [dict(ROWS[0], hash_ids=[1])])), block_tokens=4)
    with pytest.raises(ExperimentError, match=r":1: 1 hash_ids for input_length 10; the rule is len\(hash_ids\) "
                                              r"== ceil\(input_length / block_tokens\) = 3"):
        build_all(w, VOCAB)
