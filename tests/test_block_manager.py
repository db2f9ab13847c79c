"""Block manager invariants under a seeded random workload, and the side-effect-free prefix look-up."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mvllm.engine.block_manager import BLOCK_SIZE, ROOT, BlockManager, block_hashes, chain_hash
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams
from mvllm.engine.sequence import Sequence

BS = 4


def snapshot(bm: BlockManager):
    return (list(bm.clean), list(bm.cached_free), dict(bm.hash_to_block), bm.queries, bm.hits,
            [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks])


def chain(token_ids: list[int], bs: int) -> list[int]:
    hashes, parent = [], ROOT
    for i in range(len(token_ids) // bs):
        parent = chain_hash(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
        hashes.append(parent)
    return hashes


def check(bm: BlockManager, running: list[Sequence]) -> None:
    refs = Counter(b for s in running for b in s.block_table)
    clean, cached = set(bm.clean), set(bm.cached_free)
    assert len(clean) == len(bm.clean) and not clean & cached
    for block in bm.blocks:
        assert block.ref_count == refs[block.id]
        free = block.id in clean or block.id in cached
        assert free == (block.ref_count == 0), f"block {block.id} free={free} refs={block.ref_count}"
        if block.id in clean:
            assert block.hash is None
        if block.id in cached:
            assert bm.hash_to_block[block.hash] == block.id
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    assert bm.num_free + sum(1 for b in bm.blocks if b.ref_count) == bm.num_blocks
    for seq in running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        assert len(set(seq.block_table)) == len(seq.block_table)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=BS)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    running: list[Sequence] = []
    committed: list[list[int]] = []  # token lists whose full blocks were published at some point
    evictions = 0
    for _ in range(400):
        before = snapshot(bm)
        hashes_before = set(bm.hash_to_block)
        op = rng.random()
        if op < 0.35 or not running:
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            seq = Sequence(rng.choice(stems) + tail, SamplingParams(max_tokens=1))
            expect = bm.cached_prefix_len(seq.token_ids)
            assert snapshot(bm) == before
            if not bm.can_allocate(seq):
                hit = [bm.hash_to_block[h] for h in chain(seq.token_ids, BS)[:expect // BS]]
                free_hits = sum(1 for b in hit if bm.blocks[b].ref_count == 0)
                assert bm.blocks_needed(len(seq)) - len(hit) > bm.num_free - free_hits
                continue
            bm.allocate(seq)
            assert seq.num_computed_tokens == expect
            seq.num_computed_tokens = len(seq)  # the prefill ran
            bm.commit(seq)
            committed.append(list(seq.token_ids))
            running.append(seq)
        elif op < 0.75:
            seq = rng.choice(running)
            if not bm.can_append(seq):
                continue
            bm.append(seq)
            seq.num_computed_tokens = len(seq)  # a decode step ran
            bm.commit(seq)
            seq.token_ids.append(rng.randrange(50))
            committed.append(list(seq.token_ids[:seq.num_computed_tokens]))
        else:
            seq = running.pop(rng.randrange(len(running)))
            bm.free(seq)
            assert seq.block_table == []
        gone = hashes_before - set(bm.hash_to_block)
        if gone:  # only LRU eviction of free cached blocks drops a hash: the oldest released go first
            evicted = {before[2][h] for h in gone}
            reused = {b for b in before[1] if b not in bm.cached_free and bm.hash_to_block.get(
                bm.blocks[b].hash) == b and bm.blocks[b].hash == before[5][b][1]}
            lru = [b for b in before[1] if b not in reused]
            assert evicted == set(lru[:len(evicted)])
            assert not bm.clean  # clean blocks are taken before any cached one is evicted
            evictions += len(gone)
        check(bm, running)
        for tokens in committed[-20:]:
            found = 0
            for h in chain(tokens, BS)[:(len(tokens) - 1) // BS]:
                if h not in bm.hash_to_block:
                    break
                found += 1
            assert bm.cached_prefix_len(tokens) == found * BS
    assert evictions > 0
    while running:
        bm.free(running.pop())
        check(bm, running)
    assert bm.num_free == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_blocks_are_referenced_once_per_sequence():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence(list(range(10)), SamplingParams())
    bm.allocate(a)
    a.num_computed_tokens = len(a)
    bm.commit(a)
    b = Sequence(list(range(9)) + [99], SamplingParams())
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free == 8 - 3
    bm.free(b)
    assert bm.num_free == 8
    assert bm.cached_prefix_len(list(range(10))) == 8


def test_block_hashes_is_the_chain_over_full_blocks():
    """The one hash chain the engine, the simulator and the shadow index of a remote share."""
    tokens = list(range(100, 150))  # 12 full blocks of 4 and 2 tokens over
    assert list(block_hashes(tokens, BS)) == chain(tokens, BS)
    assert list(block_hashes(tokens, BS, tokens=len(tokens) - 2)) == chain(tokens, BS)[:12]
    assert list(block_hashes(tokens, BS, tokens=47)) == chain(tokens, BS)[:11]
    done = chain(tokens, BS)[:5]  # a chain resumed where it stopped
    assert done + list(block_hashes(tokens, BS, start=5, parent=done[-1])) == chain(tokens, BS)
    assert list(block_hashes(tokens)) == chain(tokens, BLOCK_SIZE)
    assert list(block_hashes(tokens[:3], BS)) == [] and list(block_hashes([], BS, tokens=-1)) == []


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig("synthetic:tiny-llama", dtype="float32", num_blocks=160, block_size=16))


def test_cached_prefix_len_of_a_warmed_prefix_changes_nothing(engine):
    rng = random.Random(0)
    prompt = [rng.randrange(500) for _ in range(516)]
    warmed = prompt[:496] + [rng.randrange(500) for _ in range(34)]  # diverges inside block 32
    assert warmed[496] != prompt[496] or warmed[496:512] != prompt[496:512]
    others = [[rng.randrange(500) for _ in range(n)] for n in (40, 70)]
    for p in [others[0], warmed, others[1]]:
        engine.warm(p)
    engine.add_request(others[0][:20], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # one request running, holding blocks, while we look
    bm = engine.blocks
    before = snapshot(bm)
    assert 0 < len(before[1]) and bm.num_free < bm.num_blocks
    assert engine.cached_prefix_len(prompt) == 496
    assert engine.cached_prefix_len(warmed) == 528
    assert engine.cached_prefix_len(prompt[:497]) == 496
    assert engine.cached_prefix_len(prompt[:496]) == 480  # the last token is always computed
    assert snapshot(bm) == before
    seq = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == 496
    assert bm.num_free == bm.num_blocks
