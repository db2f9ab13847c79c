"""The backend-spec syntax shared by profile, serve and bench.

    NAME=DEVICE[/KEY=VALUE]...[,NAME=DEVICE...]
    e.g.  gpu=cuda,cpu=cpu/threads=8      gpu=cpu,cpu=cpu (tests: two CPU backends)
          gpu=http://10.0.0.2:8000/max_active=8,cpu=cpu      (a remote server and a local CPU backend)

Keys of a local backend: dtype, quant (none|int8w|int8-lossy; left out on a CPU backend: the accurate mode
fastest here, see engine/quant.py), threads, max_active (default 4; on CUDA what the KV pool holds, at most
256: engine/sizes.py), max_step_tokens (the tokens one step computes: decodes, then chunks of prompts; default
8,192 on a CUDA GPU of 70 GiB or more, 2,048 below, 256 on the CPU and MPS), num_blocks, kv_cache_gb, graphs
(on|off), compile (on|off: on CUDA, torch.compile and Triton attention inside the graphs), fused (on|off: the
CPU's fused float32 kernels), overlap (on|off; default on for CUDA, off elsewhere: schedule and launch the next
step while the device runs this one), batch_invariant (on|off, CPU int8w: every token through the int8 kernel,
so a request's greedy tokens do not depend on its batch mates; off: prefill-sized batches through a GEMM, bf16
where the CPU has it; see engine/quant.py).

A DEVICE of http://HOST:PORT or https://HOST:PORT (an optional path such as /v1 may follow) is a remote
backend: any OpenAI-compatible server (another `mvllm serve`, vLLM, SGLang, llama.cpp's server) serving
the same model with the same tokenizer, reached over HTTP by backends/remote.py. Its keys:
max_active (the router books at most this many as running there; default 4), model (the name the remote
serves; default: the first of its /v1/models), num_blocks (the size of the router's shadow prefix index, in
blocks of the remote's block size, else of the engine's BLOCK_SIZE; default: what an mvllm remote reports,
else 4096), timeout (seconds to wait for the next chunk, default 60), api_key_env (the name of an
environment variable holding the bearer token; the key itself never appears in a spec, a log or an error).

A DEVICE of `null` is a backend without a model (backends/null.py): a worker process that emits tokens on a
clock, for measuring everything but the engine (the API process, the router, the client). Its keys: step_ms (the
time of one step, in which every running request gets one token; default 10) and max_active (default 4).

A backend's name is its role for the router (the "gpu" of gpu-only); its device is a setting.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from mvllm import machine
from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.engine.sizes import MAX_ACTIVE, check_step_tokens
from mvllm.errors import InvalidRequestError

if TYPE_CHECKING:
    from mvllm.engine.engine import EngineConfig


@dataclass(slots=True)
class BackendSpec:
    name: str
    device: str
    dtype: str | None = None
    quant: str | None = None
    threads: int | None = None
    max_active: int | None = None  # None on a local CUDA backend until its engine sizes its KV pool
    max_step_tokens: int | None = None  # None: the device's default (engine/sizes.py)
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    graphs: bool = True
    compile: bool = True
    fused: bool = True
    overlap: bool | None = None  # None: on for a CUDA backend (EngineConfig.validate)
    batch_invariant: bool | None = None  # None: the engine's default (EngineConfig)
    model: str | None = None
    api_key_env: str | None = None
    timeout: float = 60.0
    step_ms: float | None = None  # a null backend's step time

    @property
    def remote(self) -> bool:
        return is_url(self.device)

    @property
    def null(self) -> bool:
        return self.device == NULL

    def engine_config(self, model: str, block_size: int = BLOCK_SIZE) -> EngineConfig:
        from mvllm.engine.engine import EngineConfig

        return EngineConfig(model=model, device=self.device, dtype=self.dtype, max_active=self.max_active,
                            max_step_tokens=self.max_step_tokens, block_size=block_size, num_blocks=self.num_blocks,
                            kv_cache_gb=self.kv_cache_gb,
                            threads=self.threads, quant=self.quant, graphs=self.graphs,
                            compile=self.compile, fused=self.fused, overlap=self.overlap,
                            batch_invariant=self.batch_invariant)

    def as_dict(self) -> dict:
        return asdict(self)


REMOTE_KEYS = ("max_active", "model", "num_blocks", "timeout", "api_key_env")
NULL_KEYS = ("max_active", "step_ms")
NULL, NULL_STEP_MS = "null", 10.0
LOCAL_ONLY = ("dtype", "quant", "threads", "max_step_tokens", "kv_cache_gb", "graphs", "compile", "fused", "overlap",
              "batch_invariant")


def is_url(device: str) -> bool:
    return device.startswith(("http://", "https://"))


def is_cuda(device: str) -> bool:
    return device.partition(":")[0] == "cuda"


def convert(key: str, value: str, name: str, remote: bool = False, null: bool = False):
    types = {f.name: f.type for f in fields(BackendSpec)}
    if key not in types or key in ("name", "device"):
        local = (k for k in types if k not in ("name", "device", "model", "timeout", "api_key_env", "step_ms"))
        known = ", ".join(REMOTE_KEYS if remote else NULL_KEYS if null else local)
        raise InvalidRequestError(f"backend {name}: unknown setting {key!r}; known: {known}", "backends")
    if null and key not in NULL_KEYS:
        raise InvalidRequestError(f"backend {name}: {key} is not a setting of a null backend; it takes "
                                  f"{', '.join(NULL_KEYS)}", "backends")
    if not null and key == "step_ms":
        raise InvalidRequestError(f"backend {name}: step_ms is a setting of a null backend (NAME=null)", "backends")
    if remote and key not in REMOTE_KEYS:
        raise InvalidRequestError(f"backend {name}: {key} is a setting of a local backend; a remote one takes "
                                  f"{', '.join(REMOTE_KEYS)}", "backends")
    if not remote and key in ("model", "timeout", "api_key_env"):
        raise InvalidRequestError(f"backend {name}: {key} is a setting of a remote backend (NAME=http://HOST:PORT)",
                                  "backends")
    try:
        if key in ("graphs", "compile", "fused", "overlap", "batch_invariant"):
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
        device, options = split_device(rest)
        settings = {}
        if max_active is not None:
            settings["max_active"] = max_active
        for opt in options:
            key, _, value = opt.partition("=")
            settings[key] = convert(key, value, name, is_url(device), device == NULL)
        spec = BackendSpec(name=name, device=device, **settings)
        if spec.max_active is None and not is_cuda(device):
            spec.max_active = MAX_ACTIVE
        try:
            check_step_tokens(spec.max_step_tokens, spec.max_active)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"backend {name}: {e}", "backends") from None
        specs.append(spec)
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


def parse_apart(text: str | None, max_active: int | None = None) -> list[BackendSpec]:
    """parse_backends (of default_backends() where text is None) in a short-lived process: checking a backend
    against the hardware imports torch, which the server's own process, that routes and streams, never does.
    Where torch is already imported (tests, the library API) there is nothing to keep out, so it parses here."""
    import sys

    if "torch" in sys.modules:
        return _parse_or_default(text, max_active)
    from concurrent.futures import ProcessPoolExecutor

    from mvllm.backends.start import context

    with ProcessPoolExecutor(1, mp_context=context()) as pool:
        return pool.submit(_parse_or_default, text, max_active).result()


def _parse_or_default(text: str | None, max_active: int | None) -> list[BackendSpec]:
    return parse_backends(text or default_backends(), max_active)


def split_device(rest: str) -> tuple[str, list[str]]:
    """("cpu", ["threads=8"]) from "cpu/threads=8"; a URL keeps its host and any path segments without "="
    ("http://h:8000/v1/max_active=8" -> "http://h:8000/v1", ["max_active=8"]), and a later segment without
    "=" belongs to the value before it (model=Qwen/Qwen2.5-0.5B)."""
    if not is_url(rest):
        device, *options = rest.split("/")
        return device, options
    scheme, _, tail = rest.partition("://")
    parts = tail.split("/")
    i = 1
    while i < len(parts) and "=" not in parts[i]:
        i += 1
    url = f"{scheme}://" + "/".join(parts[:i])
    options: list[str] = []
    for p in parts[i:]:
        if "=" in p or not options:
            options.append(p)
        else:
            options[-1] += "/" + p
    return url.rstrip("/"), [o for o in options if o]


def set_option(text: str, name: str, key: str, value: str) -> str:
    """The backend list `text` with backend `name`'s setting `key` set to `value` (replaced if given)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for i, part in enumerate(parts):
        if part.split("=", 1)[0] == name:
            head, options = split_device(part)
            options = [o for o in options if o.partition("=")[0] != key]
            parts[i] = "/".join([head, *options, f"{key}={value}"])
            return ",".join(parts)
    raise InvalidRequestError(f"no backend named {name!r} in {text!r}", "backends")


def validate(spec: BackendSpec) -> None:
    if spec.remote:
        validate_remote(spec)
        return
    if spec.null:
        if spec.max_active < 1 or (spec.step_ms is not None and not 0 < spec.step_ms <= 60e3):
            raise InvalidRequestError(f"backend {spec.name}: a null backend takes max_active of 1 or more and "
                                      "step_ms above 0 and at most 60000", "backends")
        return
    import torch

    from mvllm.engine.engine import DEFAULT_DTYPES
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


def validate_remote(spec: BackendSpec) -> None:
    from urllib.parse import urlsplit

    try:
        url = urlsplit(spec.device)
        url.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        url = None
    if url is None or not url.hostname:
        raise InvalidRequestError(f"backend {spec.name}: {spec.device!r} is not a server address; use "
                                  "http://HOST:PORT", "backends")
    if spec.max_active < 1 or (spec.num_blocks is not None and spec.num_blocks < 1) or not spec.timeout > 0:
        raise InvalidRequestError(f"backend {spec.name}: max_active, num_blocks and timeout must be positive",
                                  "backends")
    if spec.api_key_env is not None and spec.api_key_env not in os.environ:
        raise InvalidRequestError(f"backend {spec.name}: api_key_env names {spec.api_key_env!r}, which is not set "
                                  "in the environment", "backends")


def default_backends() -> str:
    """A GPU backend where the machine has one, and the CPU backend; two CPU backends otherwise."""
    import torch

    if torch.cuda.is_available():
        return "gpu=cuda,cpu=cpu"
    if torch.backends.mps.is_available():
        return "gpu=mps,cpu=cpu"
    return "gpu=cpu,cpu=cpu"


def api_servers(asked: int | None = None) -> tuple[int, str]:
    """How many API processes `serve` runs, and why: `asked` (--api-servers), else one. On an H100, two served
    0.80x of one where one was not busy (results/serve-pace); N pays only where one API process is the bottleneck."""
    if asked is not None:
        return asked, "--api-servers"
    return 1, "the default: more pay only where one API process is the bottleneck"


def share_cores(specs: list[BackendSpec], client: bool = False, apis: int | None = None) -> str:
    """Share the cores as `serve` runs the backends, each in its own process; returns why, in one line.

    CPU backends without a thread count split the compute cores (on Apple silicon the performance cores:
    machine.compute_cores) that the GPU workers (a core each) leave. Beside a GPU backend they also leave a core
    to each of the server's processes (its API processes, and the core where there are several: `apis`, by
    default api_servers'), and under `bench` (`client`) one to its client: at a GPU's token rates each of those
    keeps most of a core busy, and a CPU backend on every core but the GPU worker's slowed the GPU's serving
    (docs/backends.md); beside a CUDA GPU they take at most half the compute cores. Where the machine has more
    logical CPUs than compute cores (Apple's efficiency cores) those go there first. `profile` applies the same
    split, so a backend is measured with the threads it will be served with."""
    local = [s for s in specs if not s.remote and not s.null]  # a remote's threads are another machine's; a null
    # backend computes nothing
    cpu = [s for s in local if s.device == "cpu" and s.threads is None]
    gpus = len(local) - len([s for s in local if s.device == "cpu"])
    cores, what = machine.compute_cores()
    apis = api_servers()[0] if apis is None else apis
    serving = (apis + (apis > 1) + client) if gpus else 0  # N > 1 API processes have a core beside them
    elsewhere = max(0, machine.logical_cpus() - cores)  # cores no CPU backend computes on
    left = cores - gpus - max(0, serving - elsewhere)
    half = any(s.device.startswith("cuda") for s in local) and left > cores // 2
    if half:  # beside a CUDA GPU, more slowed its serving: 8 of 16 threads tied the GPU alone, 12 lost 13%, 15 lost
        left = cores // 2  # 37% (results/serve-pace)
    for s in cpu:
        s.threads = max(1, left // len(cpu))
    for s in local:
        if s.device != "cpu" and s.threads is None:
            s.threads = 1
    if not cpu:
        return ""
    less = [f"{gpus} GPU worker(s)"] if gpus else []
    if serving > elsewhere:
        server = "the API process" if apis == 1 else f"{apis} API processes and the core"
        less.append(server + (" and the bench client" if client else ""))
    over = f" over {len(cpu)} CPU backends" if len(cpu) > 1 else ""
    if half:
        return f"{cpu[0].threads} a CPU backend: half of {what}, beside a CUDA GPU" + over
    return f"{cpu[0].threads} a CPU backend: {what}" + (f" less {', '.join(less)}" if less else "") + over


def with_threads(text: str, client: bool = False, apis: int | None = None) -> str:
    """The backend list `text` with the threads share_cores gives each CPU backend written in: a profile and a
    server started from it run the same threads."""
    specs = parse_backends(text, check_devices=False)
    unset = [s.name for s in specs if s.device == "cpu" and s.threads is None]
    share_cores(specs, client, apis)
    for s in specs:
        if s.name in unset:
            text = set_option(text, s.name, "threads", str(s.threads))
    return text


def spec_budget(spec: BackendSpec) -> int | None:
    """The step's token budget a backend spec runs under (engine.step_tokens); None for a remote backend or a CUDA
    device this host does not have (its default depends on the GPU's memory)."""
    import torch

    from mvllm.engine.engine import step_tokens

    if spec.remote or spec.null:
        return None
    if spec.max_step_tokens is None and is_cuda(spec.device):
        index = torch.device(spec.device).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return None
    return step_tokens(spec.engine_config("-"), spec.max_active)[0]
