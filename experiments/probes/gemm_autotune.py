"""Inductor's max-autotune (Triton GEMM templates against cuBLAS, chosen by timing) on the four decode GEMMs of
Qwen2.5-0.5B at 4 rows, each then timed as experiments/probes/small_linear_speed.py times them: in a CUDA graph over one
weight copy per layer, so the weights come from memory and not the L2 cache (autotune's own timing reuses one
weight, which is how it picked a slower kernel for the down projection).
    python3 experiments/probes/gemm_autotune.py
"""

import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from small_linear_speed import timed  # noqa: E402 - experiments/ is not a package

SHAPES = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)]


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # one compile per shape
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON"
    for name, n, k in SHAPES:
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(24)]
        x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
        start = time.time()
        tuned = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
        tuned(x, w[0])
        took = time.time() - start
        print(f"{name}: cublas {timed(partial(F.linear, x), w)} us, autotuned {timed(partial(tuned, x), w)} us "
              f"(compile {took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
