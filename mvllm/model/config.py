"""The decoder's shape, read from a Hugging Face config.json (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mvllm.errors import UnsupportedModelError

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if not archs:
            arch = MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            names = ", ".join(sorted(SUPPORTED))
            raise UnsupportedModelError(
                f"architecture {archs or d.get('model_type')} is not supported; mvllm runs {names}"
            )
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias=true) are not supported")
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "linear"):
            raise UnsupportedModelError(f"rope scaling {scaling} is not supported (default, linear, llama3)")
        max_position = d.get("max_position_embeddings", 2048)
        windowed = ("MistralForCausalLM" in archs or d.get("model_type") == "mistral" or d.get("use_sliding_window")
                    or "sliding_attention" in (d.get("layer_types") or []))
        if windowed and d.get("sliding_window"):  # within the window, sliding attention is full attention
            max_position = min(max_position, d["sliding_window"])
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position=max_position,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            o_proj_bias=arch == "llama" and bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg = cls.from_dict(_read_json(path / "config.json"))
        gen = path / "generation_config.json"
        if gen.exists():
            eos = _read_json(gen).get("eos_token_id")
            if eos is not None:
                cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return cfg


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise UnsupportedModelError(f"{path} does not hold a JSON object")
    return d
