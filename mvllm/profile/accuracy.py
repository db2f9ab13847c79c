"""How far a backend's numbers are from the float32 model's, on real weights.

Teacher-forced over a fixed English text (mvllm/data/eval.txt, ~700 tokens with SmolLM2's tokenizer): at
every position, the mean KL(float32 || backend) of the next-token distribution in nats and the share of
positions whose top-1 token agrees. Two passes per backend, since the two use different kernels: `prefill`
(the whole text in one forward) and `decode` (the text fed DECODE_CHUNK tokens at a time over the cache
built so far, the row counts a decode batch has). The reference is mvllm's decoder in float32 with plain
F.linear, which tests/test_parity.py holds to transformers token for token.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.errors import InvalidRequestError
from mvllm.model.attention import build_meta
from mvllm.model.decoder import Decoder
from mvllm.model.loader import ModelSource, build_model, load_tokenizer

EVAL_TEXT = Path(__file__).parents[1] / "data" / "eval.txt"
MIN_TOKENS = 512
DECODE_CHUNK = 4
KL_BOUND = 0.005  # nats/token: what an accurate mode must keep (bf16 measured 0.0013 on SmolLM2)
SYNTHETIC_NOTE = "synthetic weights: random logits have no meaningful accuracy; profile a real model"


def eval_tokens(source: ModelSource, path: Path | None = None, max_len: int | None = None) -> list[int]:
    """The evaluation text as token ids; a clear error where it cannot be measured."""
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise InvalidRequestError(f"model {source.spec} has no tokenizer, so its accuracy on a text cannot be "
                                  "measured; profile it with --no-accuracy", "model")
    path = Path(path or EVAL_TEXT)
    try:
        ids = tokenizer.encode(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"the evaluation text {path} cannot be read: {e}", "eval_text") from None
    if len(ids) < 2:
        raise InvalidRequestError(f"the evaluation text {path} has fewer than 2 tokens", "eval_text")
    limit = min(max_len or source.config.max_position, source.config.max_position)
    if len(ids) > limit:
        raise InvalidRequestError(f"the evaluation text has {len(ids)} tokens but the context is {limit}; "
                                  "use a shorter text", "eval_text")
    return ids


@torch.inference_mode()
def logits(model: Decoder, ids: list[int], device: torch.device, dtype: torch.dtype, chunk: int | None = None,
           block_size: int = BLOCK_SIZE, layout: str = "") -> torch.Tensor:
    """Float32 logits [n, vocab] on the CPU at every position; `chunk` tokens per forward (None: all at once)."""
    cfg, n = model.cfg, len(ids)
    blocks = -(-n // block_size)
    caches = [torch.zeros(2, blocks * block_size + 1, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype)
              for _ in range(cfg.num_layers)]
    table, step, out = [list(range(blocks))], chunk or n, []
    for start in range(0, n, step):
        end = min(start + step, n)
        meta = build_meta([(start, end)], table, block_size, device, layout)
        as_long = dict(dtype=torch.long, device=device)
        hidden = model(torch.tensor(ids[start:end], **as_long), torch.arange(start, end, **as_long), caches, meta)
        out.append(model.logits(hidden).float().cpu())
    return torch.cat(out)


def fits(runner, tokens: int) -> bool:
    """Whether `tokens` fit the runner's KV cache (its last slot is the graphs' scratch)."""
    return -(-tokens // runner.block_size) * runner.block_size < runner.caches[0].shape[1]


@torch.inference_mode()
def served_logits(runner, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """As `logits`, through an engine's ModelRunner: the served path itself (CUDA graphs, compiled steps, fused
    CPU kernels). Writes the runner's KV cache from block 0 on: only for an idle engine about to be dropped."""
    n = len(ids)
    if not fits(runner, n):
        raise ValueError(f"the evaluation text's {n} tokens do not fit the engine's KV cache")
    seq = SimpleNamespace(token_ids=list(ids), block_table=list(range(-(-n // runner.block_size))))
    step, out = chunk or n, []
    for start in range(0, n, step):
        out.append(runner.logits([seq], [(start, min(start + step, n))])[0].float().cpu())
    return torch.cat(out)


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean KL(reference || other) per token in nats, and top-1 agreement, over all positions."""
    ref, oth = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (ref.exp() * (ref - oth)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1": (reference.argmax(-1) == other.argmax(-1)).float().mean().item()}


class Reference:
    """The float32 model's logits on the evaluation text, computed once per profile."""

    def __init__(self, source: ModelSource, path: Path | None = None):
        self.source, self.text = source, Path(path or EVAL_TEXT)
        self.ids = eval_tokens(source, self.text)
        cpu = torch.device("cpu")
        model = build_model(source, cpu, torch.float32)
        self.logits = logits(model, self.ids, cpu, torch.float32)
        del model

    def measure(self, model: Decoder, device: torch.device, dtype: torch.dtype, layout: str = "",
                runner=None) -> dict:
        """layout: the engine's attention layout (ModelRunner.layout): "fused" runs the CPU's fused kernels,
        "table" the GPU's Triton attention (eagerly, outside torch.compile). With `runner` (an idle engine's
        ModelRunner, whose KV cache this overwrites) both passes run the served path instead: CUDA graphs and
        compiled steps included."""
        served = runner is not None and fits(runner, len(self.ids))

        def run(chunk):
            if served:
                return served_logits(runner, self.ids, chunk)
            return logits(model, self.ids, device, dtype, chunk, layout=layout)

        passes = {name: compare(self.logits, run(chunk)) for name, chunk in (("prefill", None),
                                                                             ("decode", DECODE_CHUNK))}
        worst = max(passes.values(), key=lambda p: p["kl_mean"])
        return {"tokens": len(self.ids), "text": self.text.name, "kl_mean": worst["kl_mean"], "top1": worst["top1"],
                "within_bound": worst["kl_mean"] <= KL_BOUND, "bound": KL_BOUND,
                "path": "served" if served else "model", **passes}
