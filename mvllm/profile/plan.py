"""What every profile measures, whether in process (run.py), over HTTP (remote.py) or through a server
(serving.py): the prompt lengths, the warm and decode settings, and fresh random prompts."""

from __future__ import annotations

from collections.abc import Callable

import torch

LENGTHS = (128, 256, 516, 1024)
WARM_CACHED, WARM_NEW = 496, 20
DECODE_PREFIX, DECODE_NEW = 560, 4  # context 564 at the first decode step, ~580 at the end

Progress = Callable[[str], None]


def spec_budget(spec) -> int | None:
    """The step's token budget a backend spec runs under: its max_step_tokens, else its device's default where
    this host can tell it (CPU, MPS, a CUDA device here); None for a remote backend or a CUDA device not here."""
    from mvllm.engine.sizes import default_step_tokens

    if getattr(spec, "max_step_tokens", None):
        return spec.max_step_tokens
    if spec.remote:
        return None
    device = torch.device(spec.device)
    if device.type != "cuda":
        return default_step_tokens(device.type)[0]
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        return None
    return default_step_tokens("cuda", torch.cuda.get_device_properties(device).total_memory / 2**30)[0]


class Tokens:
    """Fresh random prompts: distinct, so no prompt hits another's cache by accident."""

    def __init__(self, vocab: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, max(self.vocab - 1, 1), (n,), generator=self.gen).tolist()
