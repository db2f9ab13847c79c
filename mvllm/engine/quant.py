"""Weight quantization for the CPU backend: int8 weights, float32 activations.

PyTorch's dynamic int8 Linear (fbgemm/onednn) was picked by measurement: on a 2-core EPYC, a
896x9728 projection took 3.2 ms (float32), 0.45 ms (dynamic int8) and 6.4 ms (`_weight_int8pack_mm`)
at batch 1, and 83 / 41 / 3500 ms at 516 tokens. Activations are quantized per call (dynamic);
the output stays float32. The tied lm_head gets its own quantized copy; the embedding stays float32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from mvllm.errors import InvalidRequestError
from mvllm.model.decoder import Decoder

QUANTS = ("none", "int8")


def quantize(model: Decoder, quant: str, device: torch.device) -> Decoder:
    if quant == "none":
        return model
    if quant != "int8":
        raise InvalidRequestError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}", "quant")
    if device.type != "cpu":
        raise InvalidRequestError("quant=int8 runs on the cpu device only", "quant")
    if model.lm_head.weight is model.embed_tokens.weight:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
        model.lm_head = head
    engine = torch.backends.quantized.engine
    if engine not in ("fbgemm", "x86", "onednn", "qnnpack"):
        raise InvalidRequestError(f"this PyTorch build has no int8 CPU kernels (engine {engine!r})", "quant")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.float(), {nn.Linear}, dtype=torch.qint8, inplace=True)
