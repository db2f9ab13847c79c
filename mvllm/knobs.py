"""Every MVLLM_* environment variable mvllm reads (Python or C++), in one table: name, default, what it does,
and who it is for. "user": a setting of a deployment; "developer": a kernel path or tuning value kept for
same-run comparisons (experiments/), whose default is the measured best. `mvllm env` prints those set; a test
fails on any variable read in mvllm/ that is not here, and docs/knobs.md is written from this table."""

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
    Knob("MVLLM_INT8_PATH", "(best built)", "force the int8 kernel's path: lanes8, lanes, int16, float, float4, "
         "float8"),
    Knob("MVLLM_INT8_AMX", "1", "0: no AMX tiles in the int8 kernel"),
    Knob("MVLLM_INT8_AMX_ABOVE", "8", "calls of more rows than this take AMX tiles"),
    Knob("MVLLM_INT8_AMX_ROWS", "1", "how a call's rows split into AMX passes"),
    Knob("MVLLM_INT8_FINISH", "4", "groups whose AMX products are finished together (1-8)"),
    Knob("MVLLM_INT8_GEMM_MIN", "8", "the fewest rows that take the blocks of several tiles"),
    Knob("MVLLM_INT8_CHUNKS", "8", "work items a thread the int8 kernel's output blocks are cut into"),
    Knob("MVLLM_INT8_BANDS", "1", "1 cuts a call's rows into bands the threads claim apart"),
    Knob("MVLLM_INT8_STAGE", "1", "1 prefetches the next block's weights into L2 during a call of several passes"),
    Knob("MVLLM_INT8_PREFETCH", "4096", "bytes ahead of each weight stream the lanes kernels prefetch"),
    Knob("MVLLM_INT8_TILES", "1", "tiles of a thread's range streamed at once at 1-2 rows (float paths)"),
    Knob("MVLLM_INT8_HINT", "0", "prefetch into L1 (0), L2 (1) or L3 (2)"),
    Knob("MVLLM_INT8_AHEAD", "1", "blocks ahead the float4/float8 paths prefetch"),
    Knob("MVLLM_TEAM", "1", "1 runs a CPU step's layers in one team of threads, 0 a parallel region an op"),
    Knob("MVLLM_TEAM_LAST", "1", "1 runs the last layer, its rows trimmed, in the team too"),
    Knob("MVLLM_TEAM_EVEN", "75", "percent of a linear's output blocks the team splits evenly"),
    Knob("MVLLM_TEAM_AHEAD", "1 MiB", "bytes of its next share a thread waiting at a barrier prefetches"),
    Knob("MVLLM_TEAM_AMX_BLOCKS", "6", "below this many output blocks a thread, an AMX linear halves its blocks"),
    Knob("MVLLM_ATTN_LANES", "2 (AVX-512), 1", "which attention rows take the lanes path: 0 none, 1 prefill, 2 all"),
    Knob("MVLLM_ATTN_ITEMS", "4", "work items a thread the keys of lanes pairs are cut into"),
    Knob("MVLLM_ATTN_TOKEN_ITEMS", "1", "the same for decode's (token, kv head) pairs"),
]
NAMES = {k.name for k in KNOBS}


def set_now() -> dict[str, str]:
    """The registered variables set in this environment, with their values."""
    return {k.name: os.environ[k.name] for k in KNOBS if k.name in os.environ}


def markdown() -> str:
    """docs/knobs.md's table."""
    rows = [f"| `{k.name}` | {k.default} | {k.who} | {k.what} |" for k in KNOBS]
    return "\n".join(["| variable | default | for | what it does |", "| --- | --- | --- | --- |", *rows]) + "\n"
