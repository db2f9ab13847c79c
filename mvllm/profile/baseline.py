"""The peer that speed targets are judged against: plain transformers `generate` on the same model (same
weights), device and dtype; int8-lossy CPU backends get torch's dynamic int8 Linear on the transformers
model, int8w ones (float32 activations) plain float32.
No mvllm code runs in the timed path. Backends in another dtype get float32 timed as well, since
transformers' bf16 decode loop can be slower than its float32 one."""

from __future__ import annotations

import gc
import statistics
import time
import warnings

import torch

from mvllm.model.loader import build_model, resolve
from mvllm.model.presets import PRESETS

PREFILL_LEN = 516
CONTEXT = 564


def hf_model(spec: str, device: str, dtype: torch.dtype, quant: str):
    import transformers

    source = resolve(spec)
    if source.synthetic:
        preset = dict(PRESETS[spec.split(":", 1)[1]])
        preset.pop("architectures")
        config = transformers.AutoConfig.for_model(preset.pop("model_type"), **preset)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        res = model.load_state_dict(hf_state_dict(build_model(source, torch.device("cpu"), torch.float32)),
                                    strict=False)
        if res.unexpected_keys or any("rotary" not in k for k in res.missing_keys):
            raise RuntimeError(f"transformers model does not take mvllm's weights: {res}")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    if quant == "int8-lossy":  # torch's own dynamic int8 Linear, the same kernels; int8w's peer is float32
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return model


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """mvllm's fused q/k/v and gate/up weights under transformers' names."""
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for n, w in zip("qkv", attn.qkv_proj.weight.split(sizes)):
            out[p + f"self_attn.{n}_proj.weight"] = w
        if attn.qkv_proj.bias is not None:
            for n, b in zip("qkv", attn.qkv_proj.bias.split(sizes)):
                out[p + f"self_attn.{n}_proj.bias"] = b
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


class Stamps:
    """A generate streamer that only notes the time each step's tokens come out (the prompt first)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model, ids: torch.Tensor, new: int) -> tuple[float, list[float]]:
    """Seconds to the first new token, and the gaps between the later ones (one decode step each)."""
    stamps = Stamps()
    if ids.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None, streamer=stamps)
    ts = stamps.times[1:]
    return ts[0] - t, [b - a for a, b in zip(ts, ts[1:])]


def timings(model, vocab: int, device: str, batches: list[int], repeats: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(1)

    def ids(b: int, n: int) -> torch.Tensor:
        return torch.randint(0, vocab - 1, (b, n), generator=gen).to(device)

    _generate(model, ids(1, 16), 3)
    pre = statistics.median(_generate(model, ids(1, PREFILL_LEN), 1)[0] for _ in range(repeats))
    out = {"prefill": [{"tokens": PREFILL_LEN, "ms": pre * 1000, "tok_s": PREFILL_LEN / pre}], "decode": []}
    for b in batches:
        gaps = [g for _ in range(repeats) for g in _generate(model, ids(b, CONTEXT), steps + 1)[1]]
        step = statistics.median(gaps)
        out["decode"].append({"batch": b, "context": CONTEXT + steps // 2, "step_ms": step * 1000, "tok_s": b / step})
    return out


def measure(spec: str, backend: dict, repeats: int = 3, steps: int = 16) -> dict:
    """Time transformers for one measured backend entry (its device, dtype, quant, max_active)."""
    import transformers

    device, quant = backend["device"], backend["quant"]
    batches = sorted({1, backend["max_active"]})
    dtypes = [backend["dtype"]]
    if backend["dtype"] != "float32":  # transformers' fastest may be float32 (CUDA launches; CPU kernels)
        dtypes.append("float32")
    result = {"library": "transformers", "version": transformers.__version__, "method": "generate",
              "quant": quant, "runs": {}}
    for name in dtypes:
        model = hf_model(spec, device, getattr(torch, name), quant)
        result["runs"][name] = timings(model, model.config.vocab_size, device, batches, repeats, steps)
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["dtype"] = backend["dtype"]
    return result


def compare(backend: dict, baseline: dict) -> dict:
    """mvllm speed / transformers speed (above 1: mvllm is faster), against the same dtype and, where
    more than one was timed, against transformers' fastest dtype."""
    cold = {p["tokens"]: p["tok_s"] for p in backend["prefill"] if p["kind"] == "cold"}
    runs = baseline["runs"]
    groups = {"same_dtype": [runs[baseline["dtype"]]]}
    if len(runs) > 1:
        groups["fastest"] = list(runs.values())
    ratios = {}
    for label, rs in groups.items():
        if PREFILL_LEN in cold:
            ratios[f"prefill_{PREFILL_LEN}_{label}"] = cold[PREFILL_LEN] / max(r["prefill"][0]["tok_s"] for r in rs)
        for d in backend["decode"]:
            peers = [x["tok_s"] for r in rs for x in r["decode"] if x["batch"] == d["batch"]]
            if peers:
                ratios[f"decode_b{d['batch']}_{label}"] = d["tok_s"] / max(peers)
    return ratios
