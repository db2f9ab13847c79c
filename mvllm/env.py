"""The environment a run was measured in (devices, CPU, library versions, git commit, command line: `describe`),
and `mvllm env`: what this machine will run, before anything is loaded (as vLLM's collect-env and llama.cpp's
system info): the torch build, the devices, and for each backend of a spec the mode it picks and why, its
threads, its max_active and why, and whether each of its kernels built (or the compiler's first error).
`profile` records the same facts in every profile."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from mvllm import knobs, machine
from mvllm.backends.spec import (
    NULL_STEP_MS,
    BackendSpec,
    api_servers,
    is_cuda,
    parse_backends,
    share_cores,
)
from mvllm.model.config import ModelConfig
from mvllm.model.presets import DEFAULT_MODEL, PRESETS


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """HEAD (with -dirty for uncommitted changes), or MVLLM_GIT_COMMIT where the tree was copied
    without its .git (e.g. to a GPU machine)."""
    if os.environ.get("MVLLM_GIT_COMMIT"):
        return os.environ["MVLLM_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_name() -> str | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if torch.backends.mps.is_available():
        return "Apple MPS"
    return None


def describe(backends: list | None = None) -> dict:
    """`backends`: BackendSpecs, whose devices are named (cuda -> the GPU's name, cpu -> the CPU's)."""
    import torch

    cpu, gpu = cpu_name(), gpu_name()
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "git_commit": git_commit(),
        "command": sys.argv,
    }
    if backends:
        env["devices"] = {b.name: (cpu if b.device == "cpu" else gpu or b.device) for b in backends}
    return env





def devices() -> dict:
    out = {"cpu": cpu_name()}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        out[f"cuda:{i}"] = torch.cuda.get_device_name(i)
    if machine.mps():
        out["mps"] = "Apple MPS"
    return out


def kernels(spec: BackendSpec, dtype: str, quant: str) -> dict:
    """Each CPU kernel this backend would use: built (with which flags), or why not, or not needed."""
    from mvllm.kernels import cpu_fused, cpu_int8

    out = {}
    if spec.fused and dtype == "float32":  # the layer's non-matmul work, int8w included (ModelRunner.fused)
        out["fused"] = kernel_state(cpu_fused)
    else:
        out["fused"] = {"used": False, "why": "fused=off" if not spec.fused else f"not used by {dtype} {quant}"}
    if quant == "int8w":
        out["int8"] = kernel_state(cpu_int8)
    else:
        out["int8"] = {"used": False, "why": f"not used by quant={quant}"}
    return out


def kernel_state(module) -> dict:
    ok = module.available()
    info = module.build_info() if hasattr(module, "build_info") else {}
    state = {"used": ok, **info}
    if not ok:
        state["why"] = (module.why_unavailable.splitlines() or ["unknown"])[0]
    return state


def max_active(spec: BackendSpec, config, model: str, model_cfg) -> tuple[int, str]:
    """The max_active a local backend runs with and why: set, or its device's default (engine/sizes.py), which
    on CUDA depends on the model's KV pool."""
    from mvllm.engine.engine import served_pool

    _, auto, why = served_pool(replace(config, max_active=None), model_cfg)
    if spec.max_active is None:
        return auto, f"{model}: {why}"
    if spec.max_active == auto and not is_cuda(spec.device):
        return auto, why
    return spec.max_active, "set"


def backend_facts(spec: BackendSpec, model: str = DEFAULT_MODEL, model_cfg=None) -> dict:
    """The mode, threads and kernels `serve` would give this backend (after share_cores); `model_cfg`: the
    model's config (default: the default model's shapes), which sizes a CUDA backend's default max_active."""
    if spec.remote:
        return {"device": spec.device, "remote": True, "max_active": spec.max_active}
    if spec.null:
        return {"device": spec.device, "null": True, "max_active": spec.max_active, "step_ms": spec.step_ms}
    config = spec.engine_config("-")
    config.validate()
    device = torch.device(config.device)
    dtype = config.dtype or {"cpu": "float32", "cuda": "bfloat16", "mps": "float16"}[device.type]
    most, why = max_active(spec, config, model, model_cfg or ModelConfig.from_dict(PRESETS[DEFAULT_MODEL]))
    from mvllm.engine.engine import step_tokens

    budget, budget_why = step_tokens(config, most)
    facts = {"device": spec.device, "dtype": dtype, "quant": config.quant, "threads": spec.threads,
             "max_active": most, "max_active_why": why, "max_step_tokens": budget,
             "max_step_tokens_why": budget_why, "overlap": config.overlap}
    if device.type == "cpu":
        facts["picked"] = config.picked
        facts["kernels"] = kernels(spec, dtype, config.quant)
    else:
        from mvllm.engine.sampler import supports_float64
        from mvllm.kernels import triton_attention

        facts["graphs"] = spec.graphs and device.type == "cuda"
        facts["compiled"] = spec.compile and triton_attention.available(device)
        facts["sampling"] = "float64 CDF" if supports_float64(device) else "float32 CDF (no float64 here)"
    return facts


def collect(backends: str) -> dict:
    specs = parse_backends(backends)
    threads = share_cores(specs)
    apis, why = api_servers()
    return {"platform": platform.platform(), "python": platform.python_version(), "build": machine.build_facts(),
            "compute_cores": machine.compute_cores()[1], "threads": threads, "devices": devices(),
            "api_servers": apis, "api_servers_why": why,
            "backends_spec": backends,
            "backends": {s.name: backend_facts(s) for s in specs}, "knobs": knobs.set_now()}


def render(facts: dict) -> str:
    b = facts["build"]
    yes = {True: "yes", False: "no"}
    lines = [f"platform      {facts['platform']} (python {facts['python']})",
             f"torch         {b['torch']}: oneDNN {yes[b['onednn']]} (native bf16 {yes[b['onednn_bf16']]}), "
             f"OpenMP {yes[b['openmp']]}, CPU kernels {b['cpu_capability']}, CUDA {b['cuda'] or 'no'}, "
             f"MPS {yes[b['mps']]}",
             f"cores         {facts['compute_cores']} to compute on"]
    if facts.get("threads"):
        lines.append(f"threads       {facts['threads']}")
    if facts.get("api_servers"):
        lines.append(f"api servers   {facts['api_servers']} ({facts['api_servers_why']}; serve --api-servers N)")
    lines += [f"device        {name}: {what}" for name, what in facts["devices"].items()]
    lines.append(f"backends      {facts['backends_spec']}")
    for name, f in facts["backends"].items():
        if f.get("remote"):
            lines.append(f"  {name:<10}  {f['device']}: a remote server, measured over HTTP")
            continue
        if f.get("null"):
            step = f["step_ms"] or NULL_STEP_MS
            lines.append(f"  {name:<10}  null: no model, a token a running request every {step:g} ms, "
                         f"max_active {f['max_active']}")
            continue
        mode = f"{f['dtype']}" + ("" if f["quant"] == "none" else f" {f['quant']}")
        head = (f"  {name:<10}  {f['device']}: {mode}, {f['threads']} thread(s), max_active {f['max_active']} "
                f"({f['max_active_why']})")
        lines.append(head + (f", overlap {'on' if f['overlap'] else 'off'}"))
        lines.append(f"  {'':<10}  max_step_tokens {f['max_step_tokens']} ({f['max_step_tokens_why']}): the tokens "
                     "one step computes, decodes first, then chunks of prompts")
        if "picked" in f:
            lines.append(f"  {'':<10}  mode: {f['picked']}")
            for kernel, k in f["kernels"].items():
                lines.append(f"  {'':<10}  {kernel}: {describe_kernel(k)}")
        else:
            lines.append(f"  {'':<10}  graphs {yes[f['graphs']]}, compiled {yes[f['compiled']]}, "
                         f"sampling {f['sampling']}")
    set_knobs = facts.get("knobs") or {}
    lines.append("variables     " + (", ".join(f"{k}={v}" for k, v in set_knobs.items()) if set_knobs else
                                     "no MVLLM_* variable set (docs/knobs.md lists them)"))
    return "\n".join(lines)


def describe_kernel(k: dict) -> str:
    if k["used"]:
        flags = " ".join(k.get("flags", []))
        omp = "" if "openmp" not in k else (", OpenMP" if k["openmp"] else ", no OpenMP: one thread")
        return f"built{' with ' + flags if flags else ''}{omp}"
    return f"not used ({k['why']})"
