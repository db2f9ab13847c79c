"""Every MVLLM_* environment variable mvllm reads (Python or C++), in one table: name, default, what it does,
and who it is for. "user": a setting of a deployment; "developer": a kernel path kept for tests and same-run
comparisons (experiments/), whose default is the measured best (tuning values are constants in the kernels).
`mvllm env` prints those set; a test fails on any variable read in mvllm/ that is not here, and docs/knobs.md is
written from this table."""

from __future__ import annotations

import os
from typing import NamedTuple


class Knob(NamedTuple):
    name: str
    default: str
    what: str
    who: str = "developer"


KNOBS = [
    Knob("MVLLM_CACHE", "~/.cache/mvllm", "where built CPU kernels and compiled GPU code are kept", "user"),
    Knob("MVLLM_GIT_COMMIT", "(git HEAD)", "the commit results record, for a copy of the tree without .git", "user"),
    Knob("MVLLM_KEEP_FREED", "1", "0 leaves glibc's malloc as it is (1: freed CPU activations are kept for the "
         "next step, not unmapped)", "user"),
    Knob("MVLLM_HUGE_PAGES", "1", "0: pack int8 weights without asking Linux for transparent huge pages", "user"),
    Knob("MVLLM_START", "forkserver (Linux), spawn", "how backend workers start: spawn gives each a fresh "
         "interpreter (and its own torch import), forkserver forks them from a process that imported torch once",
         "user"),
    Knob("MVLLM_INT8_PATH", "(best built)", "force the int8 kernel's path: lanes8, lanes, int16 or float"),
    Knob("MVLLM_INT8_AMX", "1", "0: no AMX tiles in the int8 kernel"),
    Knob("MVLLM_TEAM", "1", "1 runs a CPU step's layers in one team of threads, 0 a parallel region an op"),
    Knob("MVLLM_ATTN_LANES", "1 (AVX-512), 2", "which attention rows take the lanes path: 0 none, 1 prefill, 2 all"),
]
NAMES = {k.name for k in KNOBS}


def set_now() -> dict[str, str]:
    """The registered variables set in this environment, with their values."""
    return {k.name: os.environ[k.name] for k in KNOBS if k.name in os.environ}


def markdown() -> str:
    """docs/knobs.md's table."""
    rows = [f"| `{k.name}` | {k.default} | {k.who} | {k.what} |" for k in KNOBS]
    return "\n".join(["| variable | default | for | what it does |", "| --- | --- | --- | --- |", *rows]) + "\n"
