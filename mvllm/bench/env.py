"""The environment a run was measured in: devices, CPU, library versions, git commit, command line."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path


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
    root = Path(__file__).resolve().parents[2]
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

