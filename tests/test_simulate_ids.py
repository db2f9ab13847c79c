"""The simulator keys a Mooncake trace's prefix cache on the trace's hash ids (bench/idprompt.py), not on hashes of
materialised tokens: the same blocks, the same hits and evictions, the same predictions, in a fraction of the time
and memory."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment, Workload
from mvllm.bench.idprompt import IdPrompt
from mvllm.simulate import sim
from mvllm.simulate.kv import chain

ROOT = Path(__file__).resolve().parent.parent
SLICE = ROOT / "experiments" / "traces" / "conversation-10min.jsonl.gz"
PROFILE = json.loads((ROOT / "results/paper-48/profile.json").read_text())
MODEL = "synthetic:qwen2.5-0.5b"


def both(**kw) -> tuple[Experiment, wl.Built, wl.Built]:
    w = Workload(kind="trace", path=str(SLICE), **kw)
    exp = Experiment(name="ids", model=MODEL, backends="gpu=cuda,cpu=cpu/threads=8", max_active=4, workload=w)
    vocab = wl.vocab_of(MODEL, w)
    return exp, wl.build_all(w, vocab, MODEL), wl.build_all(w, vocab, MODEL, tokens=False)


def test_hash_id_keys_name_the_same_blocks_as_the_token_chain():
    """Across every prompt of the slice, one token-chain hash is one key and one key one hash: two blocks share
    a key exactly where their tokens up to the block's end are the same. The selection (the reusable share
    included) is the same."""
    for scale in (16, 4):
        _, tokens, ids = both(scale=scale, max_requests=300)
        to_key: dict[int, int] = {}
        to_hash: dict[int, int] = {}
        for a, b in zip(tokens.requests, ids.requests, strict=True):
            assert isinstance(b.prompt, IdPrompt) and isinstance(a.prompt, list) and len(a.prompt) == len(b.prompt)
            hashes, keys = chain(a.prompt), b.prompt.keys()
            assert len(hashes) == len(keys) == len(a.prompt) // 16
            for h, k in zip(hashes, keys, strict=True):
                assert to_key.setdefault(h, k) == k and to_hash.setdefault(k, h) == h
        assert len(to_key) < sum(len(r.prompt) // 16 for r in ids.requests)  # prompts do share blocks
        assert tokens.selection == ids.selection


def test_hash_id_keyed_simulation_is_the_token_keyed_one():
    """Pools small enough to evict and preempt: every policy's summary is the same to the last bit, keyed on
    hash ids or on the tokens (and an unbounded pool hits more: the evictions counted)."""
    exp, tokens, ids = both(scale=16, speedup=4, max_requests=400)
    small = copy.deepcopy(PROFILE)
    small["backends"]["gpu"]["kv_blocks"], small["backends"]["cpu"]["kv_blocks"] = 700, 300
    policies = ["eta", "sglang-cache", "round-robin"]
    by_tokens = sim.simulate(exp, small, policies, None, built=tokens)
    by_ids = sim.simulate(exp, small, policies, None, built=ids)
    assert by_ids == by_tokens
    assert sum(sum(r["preemptions"].values()) for r in by_ids) > 0
    [unbounded] = sim.simulate(exp, PROFILE, ["round-robin"], None, built=ids)
    assert unbounded["total_cached_tokens"] > by_ids[2]["total_cached_tokens"] > 0


def test_a_block_of_no_whole_number_of_engine_blocks_keeps_its_tokens():
    """Scale 3 cuts the 512-token blocks to 171 tokens: an engine block may straddle two of them, so the
    prompts are made as tokens (ids would not tell where the tokens happen to agree)."""
    _, tokens, ids = both(scale=3, max_requests=20)
    assert all(isinstance(r.prompt, list) for r in ids.requests)
    assert [r.prompt for r in ids.requests] == [r.prompt for r in tokens.requests]
