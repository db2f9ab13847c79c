"""What every profile measures, whether in process (run.py), over HTTP (remote.py) or through a server
(serving.py): the prompt lengths, the warm and decode settings, and fresh random prompts."""

from __future__ import annotations

from collections.abc import Callable

import torch

LENGTHS = (128, 256, 516, 1024)
WARM_CACHED, WARM_NEW = 496, 20
DECODE_PREFIX, DECODE_NEW = 560, 4  # context 564 at the first decode step, ~580 at the end

Progress = Callable[[str], None]


class Tokens:
    """Fresh random prompts: distinct, so no prompt hits another's cache by accident."""

    def __init__(self, vocab: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, max(self.vocab - 1, 1), (n,), generator=self.gen).tolist()
