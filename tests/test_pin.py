"""A CPU backend's worker threads pinned one a core (machine.places, cpu_fused.pin_threads) and huge pages for its
packed int8 weights (cpu_int8.huge_empty)."""

import os
import sys

import pytest
import torch

from mvllm import machine
from mvllm.backends.spec import parse_backends, share_cores
from mvllm.errors import InvalidRequestError
from mvllm.kernels import cpu_fused, cpu_int8


@pytest.fixture
def linux(monkeypatch):
    monkeypatch.setattr(machine, "system", lambda: "linux")


def test_places_spread_one_thread_a_core(linux, monkeypatch):
    monkeypatch.setattr(machine, "cores", lambda: [[c] for c in range(16)])  # the H200 machine's 16 vCPUs
    assert machine.places(8) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert machine.places(4) == [0, 4, 8, 12]
    fifteen = machine.places(15)
    assert len(set(fifteen)) == 15
    assert machine.places(16) is None  # as many threads as cores: they float
    monkeypatch.setattr(machine, "cores", lambda: [[c, c + 8] for c in range(8)])  # SMT siblings c and c + 8
    assert machine.places(4) == [0, 2, 4, 6]  # one a core, never a core's second CPU
    assert machine.places(8) is None


def test_places_none_off_linux(monkeypatch):
    monkeypatch.setattr(machine, "cores", lambda: [[c] for c in range(16)])
    monkeypatch.setattr(machine, "system", lambda: "darwin")
    assert machine.places(8) is None


def test_cores_cover_the_allowed_cpus():
    found = machine.cores()
    assert sorted(c for core in found for c in core) == machine.ALLOWED


def test_pin_setting():
    specs = parse_backends("gpu=cpu/threads=1,cpu=cpu/threads=1/pin=on")
    share_cores(specs)
    assert [s.pin for s in specs] == [False, True]  # off unless asked
    assert specs[1].engine_config("m").pin is True
    with pytest.raises(InvalidRequestError, match="bad value 'maybe' for pin"):
        parse_backends("cpu=cpu/pin=maybe")


@pytest.mark.skipif(not sys.platform.startswith("linux") or machine.logical_cpus() < 2,
                    reason="pinning needs Linux and two CPUs")
def test_pin_threads_hold_across_regions():
    if not cpu_fused.available():
        pytest.skip(f"the fused kernels did not build: {cpu_fused.why_unavailable}")
    before = torch.get_num_threads()
    a, b = machine.ALLOWED[:2]
    try:
        torch.set_num_threads(2)
        assert cpu_fused.pin_threads([a, b]) == [b]  # thread 0 (this one) is never pinned
        for _ in range(5):  # every later parallel region: the worker stays on its CPU
            assert cpu_fused.thread_cpus()[1] == b
        assert os.sched_getaffinity(0) == set(machine.ALLOWED)
        cpu_fused.pin_threads([b, a])
        assert cpu_fused.thread_cpus()[1] == a
    finally:
        assert cpu_fused.pin_threads(None) is None
        torch.set_num_threads(before)
    assert cpu_fused.pin_threads(None) is None  # nothing pinned: a no-op


def test_huge_empty_holds_what_pack_writes():
    w = torch.randn(4096, 512) * 0.02  # 2 MB of int8: one huge page
    q, s = cpu_int8.quantize_weight(w)
    plain = cpu_int8.pack(q, s, "lanes8", huge=False)
    huge = cpu_int8.pack(q, s, "lanes8", huge=True)
    assert torch.equal(plain[0], huge[0]) and torch.equal(plain[1], huge[1])
    assert huge[0].is_contiguous() and huge[0].shape == plain[0].shape
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert huge[0].data_ptr() % cpu_int8.HUGE == 0  # aligned, so the whole page can be huge
    small = cpu_int8.huge_empty((3, 5), torch.float32)  # under a page: a plain tensor
    assert small.shape == (3, 5) and small.dtype == torch.float32
