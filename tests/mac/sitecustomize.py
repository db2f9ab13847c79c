"""A stand-in for PyTorch's macOS arm64 wheel on an Apple M2, loaded into every Python process a test starts
(the server and each backend worker too) by putting this folder on PYTHONPATH with MVLLM_EMULATE=mac.

What it changes, as that wheel and machine report themselves: platform darwin/arm64 (as mvllm.machine
reports it: patching `platform` itself sends other libraries down macOS-only paths); no oneDNN
(`torch.backends.mkldnn.is_available()` False and `torch.ops.mkldnn` without its ops, bf16 probe included);
no AVX (torch's CPU capability DEFAULT); 8 logical CPUs of which 4 are performance cores, and no
`os.sched_getaffinity`; with MVLLM_EMULATE_LIBOMP, torch's own OpenMP runtime in that folder. The compiler is
the test's business (CXX=tests/mac/clang++, which rejects what Apple clang rejects)."""

import os

if os.environ.get("MVLLM_EMULATE") == "mac":
    import torch

    class _NoOneDNN:
        def __getattr__(self, name):
            raise AttributeError(f"'_OpNamespace' 'mkldnn' object has no attribute '{name}'")

    torch.backends.mkldnn.is_available = lambda: False
    torch.ops.mkldnn = _NoOneDNN()
    torch.backends.cpu.get_cpu_capability = lambda: "DEFAULT"
    os.cpu_count = lambda: 8
    if hasattr(os, "sched_getaffinity"):
        del os.sched_getaffinity

    import mvllm.machine

    _SYSCTL = {"hw.perflevel0.physicalcpu": 4, "hw.perflevel1.physicalcpu": 4, "hw.physicalcpu": 8}
    mvllm.machine.sysctl = _SYSCTL.get
    mvllm.machine.system = lambda: "darwin"  # mvllm's own view only: other libraries keep Linux's
    mvllm.machine.arch = lambda: "arm64"
    if os.environ.get("MVLLM_EMULATE_LIBOMP"):  # the wheel's torch/lib/libomp.dylib (conftest.libomp_standin)
        from pathlib import Path

        import mvllm.kernels.build

        mvllm.kernels.build.torch_libomp = lambda: Path(os.environ["MVLLM_EMULATE_LIBOMP"])
