"""The int8 kernel (kernels/cpu_int8.py, lanes8 or lanes layout) against the bf16 GEMM int8w kept above its kernel
rows (oneDNN, activations cast to bf16 and back, as quant.Int8Linear did), for one gate/up and one down projection
of Qwen2.5-0.5B at several row counts, in the same process: the best of two alternating timings of each, their
ratio, and the kernel's rate. Which path the kernel takes (VNNI blocks, AMX tiles above 32 rows) follows
MVLLM_INT8_PATH and MVLLM_INT8_AMX, read once per process.

    python experiments/int8_rows_speed.py [ROWS, default 16,32,64,128,516] [THREADS, default 2]
    MVLLM_INT8_AMX=0 python experiments/int8_rows_speed.py 64,516 8     # the same without the AMX tiles
"""

from __future__ import annotations

import sys
import time

import torch

from mvllm.engine import quant
from mvllm.kernels import cpu_int8


def best_ms(fn, rows: int) -> float:
    fn()
    n = max(3, 2000 // rows)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "16,32,64,128,516").split(",")]
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    torch.manual_seed(0)
    cpu_int8.available()  # builds and loads the kernel
    print(f"threads {torch.get_num_threads()}, {cpu_int8.build_info().get('path', 'kernel unavailable')}")
    for out, inputs in [(9728, 896), (896, 4864)]:
        q, s = cpu_int8.quantize_weight(torch.randn(out, inputs) * 0.02)
        qp, sp = cpu_int8.pack(q, s)
        gemm = quant.dense(cpu_int8.dequantize(q, s).to(torch.bfloat16), None)
        for rows in rows_list:
            x = torch.randn(rows, inputs)
            paths = {"int8": lambda x=x, qp=qp, sp=sp: cpu_int8.int8_linear(x, qp, sp, None, check=False),
                     "bf16": lambda x=x, gemm=gemm: gemm(x.to(torch.bfloat16)).float()}
            times: dict[str, list[float]] = {}
            for name in ("int8", "bf16", "int8", "bf16"):
                times.setdefault(name, []).append(best_ms(paths[name], rows))
            k, b = min(times["int8"]), min(times["bf16"])
            print(f"{out}x{inputs} rows {rows}: int8 {k:.3f} ms  bf16 {b:.3f} ms  ratio {k / b:.2f}  "
                  f"GMAC/s int8 {rows * out * inputs / k / 1e6:.0f}")


if __name__ == "__main__":
    main()
