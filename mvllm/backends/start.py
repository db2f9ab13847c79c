"""How a backend's worker process starts, and the short-lived process that checks a backend list.

On Linux a fork server that has imported torch once (nothing in it touches a device: CUDA is initialized in the
worker, after the fork): each worker is a fork of it, without a torch import of its own (results/server-start).
Elsewhere a fresh interpreter (spawn): macOS's frameworks are not safe to fork. A process that needs no torch (a
null backend's worker) is spawned: a fork of the fork server would map torch. MVLLM_START picks either.
A forked worker writes to the fork server's stdout and stderr: those of the process that first started one (for
`mvllm serve`, its own at start).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

from mvllm.errors import MvllmError

PRELOAD = ["torch"]


def context(torch: bool = True):
    how = os.environ.get("MVLLM_START") or ("forkserver" if sys.platform == "linux" else "spawn")
    if how not in ("spawn", "forkserver"):
        raise MvllmError(f"MVLLM_START={how!r}: use spawn or forkserver")
    if how == "spawn" or not torch:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (effective until the fork server has started)
    return ctx
