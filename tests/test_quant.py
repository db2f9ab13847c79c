"""Quantized CPU backends: int8 (dynamic int8 Linear) and int8w (weight-only int8)."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts

from mvllm import LLM, SamplingParams
from mvllm.engine.engine import EngineConfig
from mvllm.engine.quant import Int8Linear, quantize
from mvllm.errors import InvalidRequestError
from mvllm.model.attention import build_meta
from mvllm.model.loader import build_model, resolve

# Stated tolerances, per position, quantized logits vs float32 logits: int8w (weights only) >= 0.99
# everywhere; int8 (activations quantized per call too) >= 0.99 on the synthetic models (small,
# outlier-free weights) and >= 0.9 on the tiny HF model, whose large random biases make activation outliers.
COSINE = {("int8w", "synthetic"): 0.99, ("int8w", "hf"): 0.99, ("int8", "synthetic"): 0.99, ("int8", "hf"): 0.9}


def all_logits(model, ids: list[int]) -> torch.Tensor:
    bs, n = 16, len(ids)
    blocks = -(-n // bs)
    caches = [torch.zeros(2, blocks * bs, model.cfg.num_kv_heads, model.cfg.head_dim) for _ in model.layers]
    meta = build_meta([(0, n)], [list(range(blocks))], bs, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
        return model.logits(hidden)


def quantized_layers(model, quant: str) -> list:
    kind = Int8Linear if quant == "int8w" else torch.ao.nn.quantized.dynamic.Linear
    return [m for m in (model.lm_head, model.layers[0].mlp.down_proj, model.layers[-1].self_attn.qkv_proj)
            if isinstance(m, kind)]


@pytest.mark.parametrize("quant", ["int8", "int8w"])
@pytest.mark.parametrize("spec", ["synthetic:tiny-qwen2", "synthetic:tiny-llama", "hf"])
def test_quantized_logits_close_to_float32(spec, quant, tiny):
    source = resolve(str(tiny("qwen2")[0]) if spec == "hf" else spec)
    cpu = torch.device("cpu")
    full = build_model(source, cpu, torch.float32)
    q = quantize(build_model(source, cpu, torch.float32), quant, cpu)
    assert len(quantized_layers(q, quant)) == 3
    assert q.embed_tokens.weight.dtype == torch.float32
    for n in (40, 3):  # 40 rows: de-quantized GEMM path; 3 rows: the packed int8 kernel
        ids = prompts(4, [n], vocab=source.config.vocab_size - 1)[0]
        a, b = all_logits(full, ids), all_logits(q, ids)
        assert not torch.equal(a, b)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.shape == (n,)
        assert cos.min().item() >= COSINE[quant, "hf" if spec == "hf" else "synthetic"], cos


@pytest.mark.parametrize("quant", ["int8", "int8w"])
def test_quantized_engine_generates(quant):
    ids = prompts(5, [30, 9], vocab=500)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        q = LLM("synthetic:tiny-qwen2", quant=quant, threads=1, num_blocks=32).generate(ids, params)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert [len(o.token_ids) for o in q] == [8, 8]


def test_int8w_keeps_smollm2_logits(smollm2):
    """Real weights (SmolLM2-135M, with its activation outliers): weight-only int8 stays close."""
    source = smollm2.engine.source
    ids = smollm2.tokenizer.encode("The capital of France is Paris. The quick brown fox jumps over the lazy dog. " * 3)
    cpu = torch.device("cpu")
    a = all_logits(build_model(source, cpu, torch.float32), ids)
    b = all_logits(quantize(build_model(source, cpu, torch.float32), "int8w", cpu), ids)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.mean().item() >= 0.99 and cos.min().item() >= 0.98, cos
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("kw, words", [
    (dict(quant="int4"), "quant must be one of"),
    (dict(quant="int8", dtype="bfloat16"), "float32"),
])
def test_bad_quant_settings(kw, words):
    with pytest.raises(InvalidRequestError, match=words):
        EngineConfig(model="synthetic:tiny-qwen2", **kw).validate()
