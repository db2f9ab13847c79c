"""CPU modes: int8w (int8 weights in groups, float32 activations), int8-lossy (dynamic int8), and the
per-machine pick with its fallbacks."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts

from mvllm import LLM, SamplingParams
from mvllm.backends.spec import parse_backends
from mvllm.engine import quant
from mvllm.engine.engine import EngineConfig
from mvllm.engine.quant import Int8Linear, cpu_mode, quantize
from mvllm.errors import InvalidRequestError
from mvllm.kernels import cpu_int8
from mvllm.model.attention import build_meta
from mvllm.model.loader import build_model, resolve

# Per position, quantized logits vs float32 logits: int8w >= 0.995 everywhere (its prefill GEMM runs in bf16
# where the CPU has native bf16); int8-lossy (activations
# quantized per call too) >= 0.99 on the synthetic models (small, outlier-free weights) and >= 0.9 on the
# tiny HF model, whose large random biases make activation outliers.
COSINE = {("int8w", "synthetic"): 0.995, ("int8w", "hf"): 0.995, ("int8-lossy", "synthetic"): 0.99,
          ("int8-lossy", "hf"): 0.9}
needs_kernel = pytest.mark.skipif(not cpu_int8.available(), reason="the int8 kernel did not build here")


def all_logits(model, ids: list[int]) -> torch.Tensor:
    bs, n = 16, len(ids)
    blocks = -(-n // bs)
    caches = [torch.zeros(2, blocks * bs, model.cfg.num_kv_heads, model.cfg.head_dim) for _ in model.layers]
    meta = build_meta([(0, n)], [list(range(blocks))], bs, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
        return model.logits(hidden)


def quantized_layers(model, mode: str) -> list:
    kind = Int8Linear if mode == "int8w" else torch.ao.nn.quantized.dynamic.Linear
    return [m for m in (model.lm_head, model.layers[0].mlp.down_proj, model.layers[-1].self_attn.qkv_proj)
            if isinstance(m, kind)]


@pytest.mark.parametrize("mode", [pytest.param("int8w", marks=needs_kernel), "int8-lossy"])
@pytest.mark.parametrize("spec", ["synthetic:tiny-qwen2", "synthetic:tiny-llama", "hf"])
def test_quantized_logits_close_to_float32(spec, mode, tiny):
    source = resolve(str(tiny("qwen2")[0]) if spec == "hf" else spec)
    cpu = torch.device("cpu")
    full = build_model(source, cpu, torch.float32)
    q = quantize(build_model(source, cpu, torch.float32), mode, cpu)
    assert len(quantized_layers(q, mode)) == 3
    assert q.embed_tokens.weight.dtype == torch.float32
    for n in (40, 3):  # 40 rows: the prefill GEMM; 3 rows: the decode kernel
        ids = prompts(4, [n], vocab=source.config.vocab_size - 1)[0]
        a, b = all_logits(full, ids), all_logits(q, ids)
        assert not torch.equal(a, b)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.shape == (n,)
        assert cos.min().item() >= COSINE[mode, "hf" if spec == "hf" else "synthetic"], cos


@pytest.mark.parametrize("mode", [pytest.param("int8w", marks=needs_kernel), "int8-lossy"])
def test_quantized_engine_generates(mode):
    ids = prompts(5, [30, 9], vocab=500)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        q = LLM("synthetic:tiny-qwen2", quant=mode, threads=1, num_blocks=32).generate(ids, params)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert [len(o.token_ids) for o in q] == [8, 8]


@pytest.mark.parametrize("kw, words", [
    (dict(quant="int4"), "quant must be one of"),
    (dict(quant="int8"), "now called quant=int8-lossy"),
    (dict(quant="int8-lossy", dtype="bfloat16"), "float32"),
    (dict(quant="int8w", dtype="bfloat16"), "float32"),
])
def test_bad_quant_settings(kw, words):
    with pytest.raises(InvalidRequestError, match=words):
        EngineConfig(model="synthetic:tiny-qwen2", **kw).validate()


def test_the_pick_says_what_it_chose():
    dtype, mode, why = cpu_mode(None, None)
    assert why.startswith("picked")
    assert f"quant={mode}" in quant.cpu_modes() or f"dtype={dtype}" in quant.cpu_modes()
    assert cpu_mode("float32", None) == ("float32", "none", "as asked")
    config = parse_backends("cpu=cpu")[0].engine_config("-")
    config.validate()
    assert (config.dtype, config.quant, config.picked) == (dtype, mode, why)


@pytest.mark.parametrize("kernel, avx512, bf16, expect", [
    (False, False, True, ("bfloat16", "none")),
    (False, False, False, ("float32", "none")),
    (True, True, False, ("float32", "int8w")),
    (True, False, False, ("float32", "int8w")),  # an ARM Mac: the kernel's portable path (NEON)
    (True, False, True, ("float32", "int8w")),  # a quarter of float32's bytes beats bf16's half
])
def test_pick_falls_back_per_machine(monkeypatch, kernel, avx512, bf16, expect):
    """int8w wherever the int8 kernel builds (AVX-512 or its portable path); where it does not, bf16 on a CPU
    with native bf16, else float32."""
    monkeypatch.setattr(cpu_int8, "available", lambda: kernel)
    monkeypatch.setattr(quant, "avx512", lambda: avx512)
    real = quant.packable
    monkeypatch.setattr(quant, "packable", lambda d, t: bf16 if t == torch.bfloat16 else real(d, t))
    assert cpu_mode(None, None)[:2] == expect
    assert ("portable" in cpu_mode(None, None)[2]) == (kernel and not avx512)
    if not kernel:
        monkeypatch.setattr(cpu_int8, "why_unavailable", "RuntimeError: no compiler")
        with pytest.raises(InvalidRequestError, match="does not run on this machine.*no compiler.*dtype=float32"):
            cpu_mode(None, "int8w")
        out = LLM("synthetic:tiny-qwen2", threads=1, num_blocks=32).generate(
            [[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 3


def test_bfloat16_is_refused_where_it_is_not_native(monkeypatch):
    """A CPU without native bf16 (or a build without oneDNN, as PyTorch's macOS wheel) would emulate every op."""
    monkeypatch.setattr(quant, "packable", lambda d, t: t != torch.bfloat16)
    with pytest.raises(InvalidRequestError, match="dtype=bfloat16 does not run on this CPU.*it runs: dtype=float32"):
        cpu_mode("bfloat16", None)
    with pytest.raises(InvalidRequestError, match="backend cpu: dtype=bfloat16 does not run"):
        parse_backends("cpu=cpu/dtype=bfloat16")


@pytest.mark.parametrize("avx512_bf16, amx, native", [(False, False, False), (True, False, True),
                                                      (False, True, True)])
def test_native_bf16_takes_the_cpus_flags_not_onednns_word(monkeypatch, avx512_bf16, amx, native):
    """oneDNN's probe says yes on plain AVX-512 too, where it emulates bf16 (7x the int8 kernel's prefill time on
    such a Xeon): on x86 the CPU's BF16 or AMX flags decide, and without them the lanes8 kernel takes every row."""
    from mvllm import machine

    monkeypatch.setattr(machine, "onednn", lambda: True)
    monkeypatch.setattr(machine, "x86", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(cpu_int8, "amx", lambda: False)
    monkeypatch.setattr(quant, "_packing_works", lambda dtype: True)
    assert machine.onednn_bf16() is native
    assert quant.packable(torch.device("cpu"), torch.bfloat16) is native
    assert quant.lanes8_every_row() is not native
    monkeypatch.setattr(machine, "x86", lambda: False)  # ARM: oneDNN's word stands
    assert machine.onednn_bf16()


def test_more_threads_than_cpus_is_one_error(monkeypatch):
    from mvllm import machine

    monkeypatch.setattr(machine, "logical_cpus", lambda: 4)
    with pytest.raises(InvalidRequestError, match="threads=5 is more than the 4 CPUs this process may run on"):
        parse_backends("cpu=cpu/threads=5")
    assert parse_backends("cpu=cpu/threads=4")[0].threads == 4
    assert parse_backends("gpu=cuda,cpu=cpu/threads=8", check_devices=False)[1].threads == 8  # the simulator's
