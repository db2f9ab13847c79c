"""Run an mvllm command, or an experiments script, with the C++ kernels built for another x86 CPU (-march=ARCH
instead of -march=native), in this process: on an AVX-512 machine, `haswell` gives the paths an AVX2 CPU takes (the
int8 kernel's int16 lanes, 8-wide attention lanes and silu), the nearest this machine comes to an M2's NEON build.
The kernels are cached apart by their flags.

    python experiments/probes/march.py haswell profile --model smollm2-135m --backends f32=cpu/dtype=float32/quant=none,int8w=cpu/quant=int8w
    python experiments/probes/march.py haswell experiments/probes/cpu_attention_speed.py --threads 2
"""

from __future__ import annotations

import runpy
import sys

from mvllm.kernels import build


def main() -> None:
    arch, args = sys.argv[1], sys.argv[2:]
    native = build.flag_sets

    def flag_sets():
        return [build.FlagSet(tuple(f"-march={arch}" if c == "-march=native" else c for c in s.cflags), s.ldflags,
                              s.openmp) for s in native()]

    build.flag_sets = flag_sets
    if args and args[0].endswith(".py"):
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    else:
        from mvllm.cli import app

        app(args)


if __name__ == "__main__":
    main()
