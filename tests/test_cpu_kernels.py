"""The int8 weight-only CPU kernel (mvllm/kernels/cpu_int8.py) against its float32 reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mvllm import machine
from mvllm.kernels import cpu_int8 as ck


@pytest.fixture(scope="module")
def kernel():
    if not ck.available():
        pytest.skip(f"int8 CPU kernel unavailable: {ck.why_unavailable}")


def reference(x, q, scales, bias=None):
    y = x.double() @ ck.dequantize(q, scales).double().T
    return (y if bias is None else y + bias.double()).float()


def assert_close(y, ref):
    # 1e-4 relative to the output's scale: the kernel sums in a different order than the reference.
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
@pytest.mark.parametrize("out,inputs", [(100, 64), (1000, 896), (7, 4864)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(kernel, rows, out, inputs, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out)
    q, scales = ck.quantize_weight(torch.randn(out, inputs, generator=gen))
    x = torch.randn(rows, inputs, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    assert_close(ck.int8_linear(x, q, scales, bias), reference(x, q, scales, bias))


@pytest.mark.parametrize("group", [8, 48, 64])
def test_other_group_sizes(kernel, group):
    """Groups that are not a multiple of 16 take the portable path."""
    q, scales = ck.quantize_weight(torch.randn(37, 192), group=group)
    x = torch.randn(5, 192)
    assert_close(ck.int8_linear(x, q, scales), reference(x, q, scales))


def test_leading_dims_and_threads(kernel):
    q, scales = ck.quantize_weight(torch.randn(300, 128))
    x = torch.randn(2, 3, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = ck.int8_linear(x, q, scales)
    finally:
        torch.set_num_threads(threads)
    assert y.shape == (2, 3, 300)
    assert_close(y.reshape(6, 300), reference(x.reshape(6, 128), q, scales))


def test_rejects_bad_inputs(kernel):
    q, scales = ck.quantize_weight(torch.randn(16, 64))
    with pytest.raises(ValueError, match="float32"):
        ck.int8_linear(torch.randn(1, 64, dtype=torch.float64), q, scales)
    with pytest.raises(ValueError, match="inputs"):
        ck.int8_linear(torch.randn(1, 32), q, scales)


def test_quantize_round_trip():
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 256)
    w[3, :32] = 0  # an all-zero group gets scale 0 and q 0
    q, scales = ck.quantize_weight(w)
    assert q.dtype == torch.int8 and q.shape == (64, 256)
    assert scales.dtype == torch.float32 and scales.shape == (64, 8)
    assert q.abs().max() <= 127 and scales[3, 0] == 0 and (q[3, :32] == 0).all()
    assert torch.equal(scales.half().float(), scales)  # float16 values, at or above absmax / 127
    exact = w.reshape(64, 8, 32).abs().amax(-1) / 127
    assert (scales >= exact).all() and (scales <= exact * (1 + 2 ** -10) + 2 ** -24).all()
    bound = scales.repeat_interleave(32, dim=1) / 2
    assert ((w - ck.dequantize(q, scales)).abs() <= bound * (1 + 1e-4)).all()


def test_half_up_rounds_to_the_next_float16_at_or_above():
    s = torch.tensor([0.0, 1.0, 1.0 + 2 ** -12, 1.0 - 2 ** -13, 3e-6, 65504.0])
    h = ck.half_up(s)
    assert torch.equal(h.half().float(), h) and (h >= s).all()
    assert h[:4].tolist() == [0.0, 1.0, 1.0 + 2 ** -10, 1.0] and h[5] == 65504.0
    assert h[4] - 3e-6 < 2 ** -24  # a subnormal: the next step up is 2^-24


def test_quantize_rejects_partial_group():
    with pytest.raises(ValueError, match="multiple of the group size"):
        ck.quantize_weight(torch.randn(8, 40))
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        ck.quantize_weight(torch.randn(8, 96), group=64)


def test_build_failure_is_reported(monkeypatch):
    def broken():
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(ck, "_load", broken)
    monkeypatch.setattr(ck, "_op", ck._op)
    monkeypatch.setattr(ck, "why_unavailable", ck.why_unavailable)
    assert ck.available.__wrapped__() is False
    assert ck.why_unavailable == "RuntimeError: Error building extension: no compiler"


def test_missing_ninja_is_reported(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(ck.build, "ninja_on_path", lambda: None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    op, reason = ck._try_load()
    assert op is None and "ninja" in reason


def test_fallback_without_kernel(monkeypatch):
    """With the kernel unavailable, int8_linear still computes the same result with torch ops."""
    monkeypatch.setattr(ck, "available", lambda: False)
    q, scales = ck.quantize_weight(torch.randn(50, 64))
    x, bias = torch.randn(3, 64), torch.randn(50)
    assert_close(ck.int8_linear(x, q, scales, bias), reference(x, q, scales, bias))


def test_integer_activations_are_exact(kernel):
    """By default each row is rounded to int16 (one scale per row) and each group summed in int32: a row of
    integers whose largest magnitude is 32767 passes unchanged, so only the float sum over groups rounds."""
    gen = torch.Generator().manual_seed(3)
    q, scales = ck.quantize_weight(torch.randn(64, 896, generator=gen))
    x = torch.randint(-32767, 32768, (3, 896), generator=gen).float()
    x[:, 5] = 32767.0
    ref = reference(x, q, scales)
    torch.testing.assert_close(ck.int8_linear(x, q, scales), ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item())


def test_rounding_error_is_within_a_step_of_the_row(kernel):
    """The error of int16 activations is at most half a step (absmax / 32767) per input: bounded, and far below
    the int8 weights' own (they are compared here against their de-quantized selves)."""
    gen = torch.Generator().manual_seed(4)
    q, scales = ck.quantize_weight(torch.randn(200, 4864, generator=gen))
    x = torch.randn(4, 4864, generator=gen)
    x[0, 7] = 400.0  # an outlier sets the row's step
    w = ck.dequantize(q, scales).double()
    bound = (x.abs().amax(-1, keepdim=True).double() / 32767 / 2) * w.abs().sum(-1) + 1e-4
    assert ((ck.int8_linear(x, q, scales).double() - x.double() @ w.T).abs() <= bound).all()


def built(kind: str) -> None:
    if not (ck.has_lanes8() if kind == "lanes8" else ck.has_lanes()):
        pytest.skip(f"this build has no {kind} kernel ({'AVX-512 VNNI' if kind == 'lanes8' else 'AVX2 or AVX-512BW'})")


@pytest.fixture(scope="module")
def lanes(kernel):
    built("lanes")


def test_lanes_layout_round_trips_and_rejects_odd_outputs():
    gen = torch.Generator().manual_seed(6)
    q, scales = ck.quantize_weight(torch.randn(48, 96, generator=gen))
    qp, sp = ck.pack(q, scales, "lanes")
    assert qp.shape == (3, 3, 16 * 32) and sp.shape == (3, 3, 16) and sp.dtype == torch.float16
    assert qp[1, 2, 2 * 16 + 2 * 5 + 1] == q[16 + 5, 2 * 32 + 3]  # input pair 1 of group 2, output 5, odd input
    assert all(torch.equal(a, b) for a, b in zip(ck.unpack(qp, sp), (q, scales)))
    with pytest.raises(ValueError, match="multiple of 16"):
        ck.pack(*ck.quantize_weight(torch.randn(40, 96, generator=gen)), "lanes")
    with pytest.raises(ValueError, match="multiple of 8 inputs, got 32 and 4"):
        ck.pack(*ck.quantize_weight(torch.randn(32, 96, generator=gen), group=4), "lanes")


@pytest.mark.parametrize("out,inputs", [(64, 896), (1152, 896), (896, 4864), (32, 64)])
def test_lanes_kernel_matches_and_is_batch_invariant(lanes, out, inputs):
    """The lanes layout, whichever path is the default: every row count up to prefill sizes (tiles of rows beyond
    the kernel's 4 or 8), against the reference at int16 activations' accuracy, and each row alone bitwise as in
    its batch."""
    gen = torch.Generator().manual_seed(out + inputs)
    q, scales = ck.quantize_weight(torch.randn(out, inputs, generator=gen))
    bias = torch.randn(out, generator=gen)
    qp, sp = ck.pack(q, scales, "lanes")
    x = torch.randn(20, inputs, generator=gen)
    y = ck.int8_linear(x, qp, sp, bias)
    ref = reference(x, q, scales, bias)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for rows in (1, 2, 3, 5, 8, 9):
        assert torch.equal(ck.int8_linear(x[:rows], qp, sp, bias), y[:rows]), rows


@pytest.fixture(scope="module")
def lanes8(kernel):
    built("lanes8")


def int8_groups(x, group=ck.GROUP):
    """x rounded as the lanes8 kernel rounds it: int8 per group of inputs, absmax / 127 its scale."""
    g = x.view(*x.shape[:-1], -1, group)
    top = g.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))  # as the kernel: x * (127 / absmax), then round
    return (torch.round(g * inv) * (top / 127)).view(x.shape)


def test_lanes8_layout_round_trips_and_rejects_odd_groups():
    gen = torch.Generator().manual_seed(7)
    q, scales = ck.quantize_weight(torch.randn(48, 96, generator=gen))
    qp, sp = ck.pack(q, scales, "lanes8")
    assert qp.dtype == torch.uint8 and qp.shape == (3, 3, 16 * 32) and sp.shape == (3, 3, 16)
    assert int(qp[1, 2, 64 + 4 * 5 + 3]) == int(q[16 + 5, 2 * 32 + 7]) + 128  # group 2, input 7 (four 1, place 3), output 5
    assert all(torch.equal(a, b) for a, b in zip(ck.unpack(qp, sp), (q, scales)))
    with pytest.raises(ValueError, match="lanes8 layout needs .* multiple of 16 inputs, got 32 and 8"):
        ck.pack(*ck.quantize_weight(torch.randn(32, 96, generator=gen), group=8), "lanes8")
    with pytest.raises(ValueError, match="the layouts are lanes and lanes8, got 'lanes4'"):
        ck.pack(q, scales, "lanes4")


def anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds addr (/proc/self/smaps), in kB."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_pack_puts_q_in_huge_pages():
    """pack(huge=True) gives the same layout in 2 MB-aligned memory advised MADV_HUGEPAGE before it was written: where
    Linux's transparent_hugepage allows it (madvise or always), the mapping holds huge pages."""
    gen = torch.Generator().manual_seed(11)
    q, scales = ck.quantize_weight(torch.randn(8192, 512, generator=gen))  # 4 MB of int8: two huge pages
    plain = ck.pack(q, scales, "lanes8", huge=False)
    huge = ck.pack(q, scales, "lanes8", huge=True)
    assert torch.equal(plain[0], huge[0]) and torch.equal(plain[1], huge[1]) and huge[0].is_contiguous()
    small = ck.huge_empty((3, 5), torch.float32)  # under a page: a plain tensor
    assert small.shape == (3, 5) and small.dtype == torch.float32
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("no transparent huge pages here")
    assert huge[0].data_ptr() % ck.HUGE == 0
    assert anon_huge_kb(huge[0].data_ptr()) >= 2048
    if "[madvise]" in open(thp).read():  # a plain pack stays in 4 KB pages
        assert anon_huge_kb(plain[0].data_ptr()) == 0


def test_lanes8_falls_back_without_kernel(monkeypatch):
    monkeypatch.setattr(ck, "available", lambda: False)
    q, scales = ck.quantize_weight(torch.randn(32, 64))
    x = torch.randn(3, 64)
    assert_close(ck.int8_linear(x, *ck.pack(q, scales, "lanes8")), reference(x, q, scales))


@pytest.mark.parametrize("out,inputs", [(64, 896), (1152, 896), (896, 4864), (32, 64), (80, 96)])
def test_lanes8_kernel_matches_and_is_batch_invariant(lanes8, out, inputs):
    """lanes8 computes exactly what int8 activations per group give (to float rounding), stays within their
    accuracy of the float result, and gives each row alone the bits it gets in a batch of up to 72. Where AMX
    is used (ck.amx()), calls of more than 8 rows take the tiles (passes of up to 32 rows, of 2 tiles or 1: 80
    outputs are 5 tiles, 96 inputs 3 groups) and a row alone takes vpdpbusd: the same bits."""
    gen = torch.Generator().manual_seed(out + inputs + 1)
    q, scales = ck.quantize_weight(torch.randn(out, inputs, generator=gen))
    bias = torch.randn(out, generator=gen)
    qp, sp = ck.pack(q, scales, "lanes8")
    x = torch.randn(72, inputs, generator=gen)
    y = ck.int8_linear(x, qp, sp, bias)
    exact = reference(int8_groups(x), q, scales, bias)
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    ref = reference(x, q, scales, bias)
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()  # int8 activations: ~0.5% of the largest output
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 33, 48):
        assert torch.equal(ck.int8_linear(x[:rows], qp, sp, bias), y[:rows]), rows


@pytest.mark.parametrize("kind", ["lanes", "lanes8"])
def test_the_thread_count_changes_no_bits(kernel, kind):
    """How a call is shared among threads (one range each on one thread, or where a call has too few chunks; else
    chunks each thread claims in turn, the rows cut into bands, narrower where a call has few chunks a thread, and
    the next block prefetched into L2) changes only which thread computes an output and when: the same bits at 1, 2
    and 3 threads, at a decode row, the VNNI blocks' 20 rows (several passes over a block), 48 (AMX tiles where
    ck.amx()) and 300 (bands)."""
    if kind == "lanes8" and not ck.has_lanes8():
        pytest.skip("this build has no lanes8 kernel (AVX-512 VNNI)")
    if kind == "lanes" and not ck.has_lanes():
        pytest.skip("this build has no lanes kernel (AVX2 or AVX-512BW)")
    gen = torch.Generator().manual_seed(7)
    q, scales = ck.quantize_weight(torch.randn(1936, 896, generator=gen))  # 121 tiles: the last block partial
    qp, sp = ck.pack(q, scales, kind)
    x = torch.randn(300, 896, generator=gen)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 20, 48, 300):
            torch.set_num_threads(1)
            alone = ck.int8_linear(x[:rows], qp, sp)
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(ck.int8_linear(x[:rows], qp, sp), alone), (rows, n)
    finally:
        torch.set_num_threads(threads)


def test_amx_passes_of_any_rows_give_the_vnni_bits(lanes8):
    """With AMX, a call of more than 8 rows goes in passes of up to 16 rows (the tiles configured to 1-16 rows), the
    rows past the last 16 on the VNNI blocks where no more than 8, the float steps 4 groups at a time: each row's bits
    are those it gets alone (1 row: the VNNI blocks), for inputs of 28 groups (chunks of 4 that divide them) and 30
    (that do not), at 1 and 3 threads."""
    if not ck.amx():
        pytest.skip("no AMX tiles here (a Sapphire Rapids or later Xeon, the tile state granted by Linux)")
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        for inputs in (896, 960):
            q, scales = ck.quantize_weight(torch.randn(1936, inputs, generator=gen))  # 121 tiles: blocks of 2 and 1
            bias = torch.randn(1936, generator=gen)
            qp, sp = ck.pack(q, scales, "lanes8")
            x = torch.randn(70, inputs, generator=gen)
            vnni = torch.cat([ck.int8_linear(x[r:r + 1], qp, sp, bias) for r in range(70)])
            for n in (1, 3):
                torch.set_num_threads(n)
                for rows in (9, 15, 16, 17, 20, 24, 25, 31, 32, 33, 47, 64, 70):
                    assert torch.equal(ck.int8_linear(x[:rows], qp, sp, bias), vnni[:rows]), (inputs, n, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind,top", [("lanes", 32767), ("lanes8", 127)])
def test_lanes_integer_activations_are_exact(kernel, kind, top):
    """Integers whose largest magnitude is the layout's step count (a row's for lanes' int16, each group's of 32
    for lanes8's int8) are their own rounding: only the float sum over groups rounds."""
    built(kind)
    gen = torch.Generator().manual_seed(3)
    q, scales = ck.quantize_weight(torch.randn(64, 896, generator=gen))
    x = torch.randint(-top, top + 1, (3, 896), generator=gen).float()
    x[:, ::32] = float(top)
    x[1, 64:96] = 0.0  # a zero group
    ref = reference(x, q, scales)
    y = ck.int8_linear(x, *ck.pack(q, scales, kind))
    torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["lanes", "lanes8"])
def test_lanes_layouts_check_their_inputs(kernel, kind):
    built(kind)
    qp, sp = ck.pack(*ck.quantize_weight(torch.randn(32, 64)), kind)
    with pytest.raises(ValueError, match="inputs of 64 features"):
        ck.int8_linear(torch.randn(1, 32), qp, sp)
    with pytest.raises(ValueError, match="scales are float16 in the lanes layouts"):
        ck.int8_linear(torch.randn(1, 64), qp, sp.float())


def default_path(has_lanes: bool) -> str:
    """The path MVLLM_INT8_PATH unset (or unknown) takes: lanes8 where it builds (AVX-512 VNNI), else lanes
    (AVX2, AVX-512BW), else int16."""
    return "lanes8" if ck.has_lanes8() else "lanes" if has_lanes else "int16"


PATH_CHECK = textwrap.dedent("""
    import torch
    from mvllm.kernels import cpu_int8 as ck
    assert ck.available(), ck.why_unavailable
    gen = torch.Generator().manual_seed(5)
    q, s = ck.quantize_weight(torch.randn(304, 896, generator=gen))
    b = torch.randn(304, generator=gen)
    x = torch.randn(7, 896, generator=gen)
    xr = x
    if ck.layout() == "lanes8":  # int8 activations per group: the reference takes x so rounded
        g = x.view(7, -1, 32)
        top = g.abs().amax(-1, keepdim=True)
        xr = (torch.round(g * (127 / top)) * (top / 127)).view(7, -1)
    ref = (xr.double() @ ck.dequantize(q, s).double().T + b.double()).float()
    if ck.packs():  # a lanes path: weights in its layout, as Int8Linear packs them
        q, s = ck.pack(q, s)
    y = ck.int8_linear(x, q, s, b)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for r in range(7):  # each row alone gets the bits it gets in the batch
        assert torch.equal(ck.int8_linear(x[r:r + 1], q, s, b)[0], y[r]), r
    print(ck.packs(), q.dim(), ck.build_info()["path"])
""")


@pytest.mark.parametrize("path,name", [("int16", "int16"), ("float", "float"), ("lanes", ""), ("lanes8", ""),
                                       ("float4", ""), ("nonsense", ""), ("", "")])
def test_each_path_matches_and_is_batch_invariant(kernel, path, name):
    """MVLLM_INT8_PATH picks the path (read once per process, so one process each): every path agrees with the
    reference, gives a row alone the bits it gets in a batch, and is the one build_info names. Unset or unknown (a
    removed path, float4, among them): the default (default_path: the weights are then packed in a lanes layout
    where it has one); lanes8 where it is not built falls back to lanes."""
    env = {**os.environ, "MVLLM_INT8_PATH": path}
    done = subprocess.run([sys.executable, "-c", PATH_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    packs, dims, named = done.stdout.strip().splitlines()[-1].split(" ", 2)
    has_lanes = machine.x86() and machine.cpu_capability().startswith(("AVX2", "AVX512"))
    if path in ("lanes", "lanes8") and (has_lanes, ck.has_lanes8())[path == "lanes8"]:
        name = path
    if not name:
        name = default_path(has_lanes)
    first = named.split(" ")[0]
    assert first == name, named
    assert (packs, dims) == (("True", "3") if name.startswith("lanes") else ("False", "2")), (packs, dims)
    assert ("is not one of int16, float, lanes, lanes8" in done.stderr) == (path in ("float4", "nonsense")), \
        done.stderr
