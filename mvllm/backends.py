"""The backend-spec syntax shared by profile, serve and bench.

    NAME=DEVICE[/KEY=VALUE]...[,NAME=DEVICE...]
    e.g.  gpu=cuda,cpu=cpu/threads=8      gpu=cpu,cpu=cpu (tests: two CPU backends)

Keys: dtype, quant (none|int8w|int8-lossy; left out on a CPU backend: the accurate mode fastest here,
see engine/quant.py), threads, max_active, num_blocks, kv_cache_gb, graphs (on|off),
fused (on|off: the CPU's fused float32 kernels).
A backend's name is its role for the router (the "gpu" of gpu-only); its device is a setting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from mvllm.engine.engine import DEFAULT_DTYPES, EngineConfig
from mvllm.errors import InvalidRequestError


@dataclass(slots=True)
class BackendSpec:
    name: str
    device: str
    dtype: str | None = None
    quant: str | None = None
    threads: int | None = None
    max_active: int = 4
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    graphs: bool = True
    fused: bool = True

    def engine_config(self, model: str, block_size: int = 16) -> EngineConfig:
        return EngineConfig(model=model, device=self.device, dtype=self.dtype, max_active=self.max_active,
                            block_size=block_size, num_blocks=self.num_blocks, kv_cache_gb=self.kv_cache_gb,
                            threads=self.threads, quant=self.quant, graphs=self.graphs,
                            fused=self.fused)

    def as_dict(self) -> dict:
        return asdict(self)


def convert(key: str, value: str, name: str):
    types = {f.name: f.type for f in fields(BackendSpec)}
    if key not in types or key in ("name", "device"):
        known = ", ".join(k for k in types if k not in ("name", "device"))
        raise InvalidRequestError(f"backend {name}: unknown setting {key!r}; known: {known}", "backends")
    try:
        if key in ("graphs", "fused"):
            if value not in ("on", "off"):
                raise ValueError
            return value == "on"
        if "int" in types[key]:
            return int(value)
        if "float" in types[key]:
            return float(value)
        return value
    except ValueError:
        raise InvalidRequestError(f"backend {name}: bad value {value!r} for {key}", "backends") from None


def parse_backends(text: str, max_active: int | None = None, check_devices: bool = True) -> list[BackendSpec]:
    """Parse and validate a backend list; every error is raised before any model is loaded.
    check_devices=False: the settings only (the simulator models a cuda backend on any machine)."""
    specs: list[BackendSpec] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise InvalidRequestError(f"backend {part!r} must look like NAME=DEVICE[/KEY=VALUE...]", "backends")
        name, rest = part.split("=", 1)
        device, *options = rest.split("/")
        settings = {}
        if max_active is not None:
            settings["max_active"] = max_active
        for opt in options:
            key, _, value = opt.partition("=")
            settings[key] = convert(key, value, name)
        specs.append(BackendSpec(name=name, device=device, **settings))
    if not specs:
        raise InvalidRequestError("no backend given; e.g. --backends gpu=cuda,cpu=cpu", "backends")
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise InvalidRequestError(f"backend name {spec.name!r} is given twice", "backends")
        seen.add(spec.name)
        if check_devices:
            validate(spec)
    return specs


def set_option(text: str, name: str, key: str, value: str) -> str:
    """The backend list `text` with backend `name`'s setting `key` set to `value` (replaced if given)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for i, part in enumerate(parts):
        if part.split("=", 1)[0] == name:
            head, *options = part.split("/")
            options = [o for o in options if o.partition("=")[0] != key]
            parts[i] = "/".join([head, *options, f"{key}={value}"])
            return ",".join(parts)
    raise InvalidRequestError(f"no backend named {name!r} in {text!r}", "backends")


def validate(spec: BackendSpec) -> None:
    if spec.dtype is not None and not isinstance(getattr(torch, spec.dtype, None), torch.dtype):
        raise InvalidRequestError(f"backend {spec.name}: unknown dtype {spec.dtype!r}", "backends")
    try:
        device_type = torch.device(spec.device).type
    except RuntimeError:
        device_type = spec.device
    if device_type not in DEFAULT_DTYPES:
        raise InvalidRequestError(f"backend {spec.name}: unknown device {spec.device!r}; use cpu, cuda or mps",
                                  "backends")
    try:
        spec.engine_config("-").validate()
    except InvalidRequestError as e:
        raise InvalidRequestError(f"backend {spec.name}: {e}", "backends") from None


def default_backends() -> str:
    """A GPU backend where the machine has one, and the CPU backend; two CPU backends otherwise."""
    if torch.cuda.is_available():
        return "gpu=cuda,cpu=cpu"
    if torch.backends.mps.is_available():
        return "gpu=mps,cpu=cpu"
    return "gpu=cpu,cpu=cpu"
