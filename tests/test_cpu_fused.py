"""The fused CPU kernels (mvllm/kernels/cpu_fused.py, csrc/fused.cpp) against their pure-torch references."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mvllm.kernels import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(),
                                reason=f"the fused kernels did not build here: {cpu_fused.why_unavailable[:300]}")

# (heads, kv_heads, head_dim): qwen2.5-0.5b-like, smollm-like, tiny ones (D 24: not a multiple of 16, the
# plain-loop path), llama-like D 128 and a wide group (12 query heads per kv head)
SHAPES = [(14, 2, 64), (9, 3, 64), (4, 1, 16), (4, 2, 24), (8, 2, 128), (12, 1, 32)]
BLOCK = 16


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@contextlib.contextmanager
def num_threads(n: int):
    """1 thread: each (token, kv head) in one piece; 2: decode splits the keys into chunks (merged after)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def attention_lanes(mode: int):
    """0: every row one (token, kv head) at a time; 1: a prefill's rows but its newest in vector lanes; 2: every row
    in lanes."""
    old = cpu_fused.attention_knob("lanes", mode)
    try:
        yield
    finally:
        cpu_fused.attention_knob("lanes", old)


@pytest.mark.parametrize("tokens,hidden", [(1, 896), (4, 576), (37, 64), (3, 20)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(tokens, hidden, with_residual):
    torch.manual_seed(tokens + hidden)
    x, weight = torch.randn(tokens, hidden), torch.randn(hidden)
    residual = torch.randn(tokens, hidden) if with_residual else None
    original = residual.clone() if with_residual else None
    ref_residual = residual.clone() if with_residual else None
    normed, r = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_r = cpu_fused.reference_add_rms_norm(x, ref_residual, weight, 1e-6)
    close(normed, ref_normed)
    if with_residual:
        assert r is residual
        assert torch.equal(residual, original + x)  # updated in place
        assert torch.equal(ref_r, original + x)
    else:
        assert r is x


def random_cache(slots: int, kv_heads: int, d: int) -> torch.Tensor:
    return torch.randn(2, slots, kv_heads, d)


def rope_tables(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_rope_store(heads, kv_heads, d, tokens):
    torch.manual_seed(heads * tokens + d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    cos, sin = rope_tables(torch.randint(0, 2000, (tokens,)), d)
    cache = random_cache(8 * BLOCK + 1, kv_heads, d)
    slots = torch.randperm(8 * BLOCK)[:tokens]
    ref_cache = cache.clone()
    q = cpu_fused.rope_store(qkv, cos, sin, cache, slots, heads, kv_heads)
    ref_q = cpu_fused.reference_rope_store(qkv, cos, sin, ref_cache, slots, heads, kv_heads)
    assert q.shape == (tokens, heads, d)
    close(q, ref_q)
    close(cache[:, slots], ref_cache[:, slots])
    untouched = torch.ones(cache.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache[:, untouched], ref_cache[:, untouched])


def paged_setup(lengths: list[int], kv_heads: int, d: int, seed: int = 0):
    """A cache whose blocks are handed out shuffled; block_table rows padded with junk block ids."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK) for n in lengths]
    total = sum(needed) + 3
    cache = torch.randn(2, total * BLOCK + 1, kv_heads, d, generator=g)
    order = torch.randperm(total, generator=g)
    width = max(needed) + 2
    table = torch.randint(0, total, (len(lengths), width), generator=g)
    start = 0
    for row, n in enumerate(needed):
        table[row, :n] = order[start:start + n]
        start += n
    return cache, table


def check_attention(q, cache, table, seq, key_len):
    scale = q.shape[-1] ** -0.5
    out = cpu_fused.paged_attention(q, cache, table, seq, key_len, BLOCK, scale)
    ref = cpu_fused.reference_paged_attention(q, cache, table, seq, key_len, BLOCK, scale)
    assert out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    close(out, ref)


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300, 700])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [1, 2])
def test_paged_attention_decode(heads, kv_heads, d, length, threads, lanes):
    cache, table = paged_setup([length], kv_heads, d, seed=length)
    q = torch.randn(1, heads, d) * 3
    with num_threads(threads), attention_lanes(lanes):
        check_attention(q, cache, table, torch.tensor([0]), torch.tensor([length]))


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [1, 2])
def test_paged_attention_batch(heads, kv_heads, d, table_dtype, threads, lanes):
    """4 sequences, one token each; token t belongs to block-table row seq[t]."""
    lengths = [700, 1, 300, 17]
    cache, table = paged_setup(lengths, kv_heads, d, seed=heads)
    q = torch.randn(4, heads, d) * 3
    seq = torch.tensor([2, 0, 3, 1])
    with num_threads(threads), attention_lanes(lanes):
        check_attention(q, cache, table.to(table_dtype), seq, torch.tensor(lengths)[seq])


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lanes", [0, 1, 2])
def test_paged_attention_prefill(heads, kv_heads, d, threads, lanes):
    """One sequence, 40 query tokens at positions 100..139, each causal; then two sequences mixed, in each setting
    of the lanes path (attention_knob "lanes")."""
    cache, table = paged_setup([140, 60], kv_heads, d, seed=d)
    q = torch.randn(40, heads, d) * 3
    positions = torch.arange(100, 140)
    with num_threads(threads), attention_lanes(lanes):
        check_attention(q, cache, table, torch.zeros(40, dtype=torch.long), positions + 1)
        seq = torch.tensor([0] * 25 + [1] * 15)
        key_len = torch.cat([torch.arange(116, 141), torch.arange(46, 61)])
        check_attention(q, cache, table, seq, key_len)


def test_paged_attention_long_prefill():
    """Two cold sequences of 350 and 250 tokens in one call (the prefill shape), causal."""
    heads, kv_heads, d = SHAPES[0]
    cache, table = paged_setup([350, 250], kv_heads, d, seed=7)
    q = torch.randn(600, heads, d) * 3
    seq = torch.tensor([0] * 350 + [1] * 250)
    key_len = torch.cat([torch.arange(1, 351), torch.arange(1, 251)])
    with num_threads(2):
        check_attention(q, cache, table, seq, key_len)


def test_lanes_take_a_prefills_rows_but_its_newest():
    """Decode rows and a prefill's newest row get the per-token path's bits in lanes mode 1; a prefill's other rows
    another path (so the lanes are really taken), within the reference's tolerance either way; in mode 2 every
    row takes the lanes."""
    heads, kv_heads, d = SHAPES[0]
    cache, table = paged_setup([140, 700, 300], kv_heads, d, seed=3)
    q = torch.randn(42, heads, d) * 3
    seq = torch.tensor([0] * 40 + [1, 2])
    key_len = torch.cat([torch.arange(101, 141), torch.tensor([700, 300])])
    args = (q, cache, table, seq, key_len, BLOCK, d ** -0.5)
    with num_threads(1):
        with attention_lanes(0):
            off = cpu_fused.paged_attention(*args)
        with attention_lanes(1):
            on = cpu_fused.paged_attention(*args)
        with attention_lanes(2):
            every = cpu_fused.paged_attention(*args)
    assert torch.equal(on[39:], off[39:])  # the prefill's newest, then two decode rows
    assert not torch.equal(on[:39], off[:39])
    assert torch.equal(every[:39], on[:39]) and not torch.equal(every[39:], off[39:])
    close(on, cpu_fused.reference_paged_attention(*args))
    close(every, cpu_fused.reference_paged_attention(*args))


def test_the_lanes_default_fits_the_vector_width():
    """Every row in lanes where they are 8 wide (a decode row's 7 query heads fill 7 of 8), a prefill's rows but
    its newest with AVX-512 (16 wide)."""
    from mvllm import machine

    wide = machine.avx512() and "-march=native" in cpu_fused.build_info().get("flags", [])
    mode = cpu_fused.attention_knob("lanes", 1)
    cpu_fused.attention_knob("lanes", mode)
    assert mode == (1 if wide else 2)


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_lanes_row_does_not_depend_on_the_rows_beside_it(lanes):
    """On one thread (no key split) a prefill row's result depends on its own query and keys alone: the same
    rows in other blocks of lanes (fewer rows before them, another sequence beside) give the same bits."""
    heads, kv_heads, d = (9, 3, 64)
    cache, table = paged_setup([140, 60], kv_heads, d, seed=5)
    q = torch.randn(40, heads, d) * 3
    key_len = torch.arange(101, 141)
    with num_threads(1), attention_lanes(lanes):
        whole = cpu_fused.paged_attention(q, cache, table, torch.zeros(40, dtype=torch.long), key_len, BLOCK, 0.125)
        tail = cpu_fused.paged_attention(q[13:], cache, table, torch.zeros(27, dtype=torch.long), key_len[13:],
                                         BLOCK, 0.125)
        other = torch.randn(20, heads, d)
        beside = cpu_fused.paged_attention(torch.cat([other, q[13:]]), cache, table,
                                           torch.tensor([1] * 20 + [0] * 27), torch.cat([torch.arange(41, 61),
                                                                                         key_len[13:]]),
                                           BLOCK, 0.125)
    assert torch.equal(tail, whole[13:])
    assert torch.equal(beside[20:], whole[13:])


def test_paged_attention_rejects_bad_input():
    cache, table = paged_setup([20], 2, 16)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="key_len"):
        cpu_fused.paged_attention(q, cache, table, torch.tensor([0]), torch.tensor([10_000]), BLOCK, 0.25, check=True)
    bad = table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        cpu_fused.paged_attention(q, cache, bad, torch.tensor([0]), torch.tensor([20]), BLOCK, 0.25, check=True)
    with pytest.raises(ValueError, match="seq_of_token"):
        cpu_fused.paged_attention(q, cache, table, torch.tensor([3]), torch.tensor([20]), BLOCK, 0.25, check=True)
    out = cpu_fused.paged_attention(q, cache, table, torch.tensor([0]), torch.tensor([20]), BLOCK, 0.25, check=True)
    assert out.shape == (1, 64)


@pytest.mark.parametrize("tokens,inter", [(1, 4864), (4, 1536), (3, 37), (600, 64)])
def test_silu_mul(tokens, inter):
    torch.manual_seed(inter)
    gate_up = torch.randn(tokens, 2 * inter) * 4
    close(cpu_fused.silu_mul(gate_up), cpu_fused.reference_silu_mul(gate_up))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 151936])
def test_argmax_matches_torch(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=gen)
    x[0] = float("-inf")  # all -inf: index 0
    x[1] = 0.0  # ties: the first index
    x[2, n // 2] = float("inf")
    x[3, -1] = x[3].max() + 1  # the largest at the end (the scalar tail)
    x[4, (2 * n) // 3] = float("nan")  # a NaN counts as the largest
    assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=-1))
