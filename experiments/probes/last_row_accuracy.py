"""The served prefill's last-token logits, which the fused CPU path now computes with its last layer trimmed to
that row (meta.out_rows), against float32 on real weights: for prefixes of the evaluation text every `--every`
tokens, a fresh prefill through the engine's ModelRunner with rows=[last] (the served path) and with every row (the
path `mvllm profile`'s accuracy measures), both against the float32 reference's logits at that position (mean KL,
top-1, profile.accuracy.compare), and the two against each other.

    python experiments/probes/last_row_accuracy.py [--model smollm2-135m] [--quant int8w] [--every 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.profile.accuracy import Reference, compare
from mvllm.profile.run import environment


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default="int8w")
    ap.add_argument("--every", type=int, default=24)
    ap.add_argument("--out")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model=a.model, device="cpu", quant=a.quant))
    runner = engine.runner
    ref = Reference(engine.source)
    trimmed, full, at = [], [], []
    for n in range(a.every, len(ref.ids) + 1, a.every):
        seq = SimpleNamespace(token_ids=ref.ids[:n], block_table=list(range(-(-n // runner.block_size))))
        trimmed.append(runner.logits([seq], [(0, n)], torch.tensor([n - 1]))[0][-1].float())
        full.append(runner.logits([seq], [(0, n)])[0][-1].float())
        at.append(n - 1)
    trimmed, full, reference = torch.stack(trimmed), torch.stack(full), ref.logits[at]
    result = {"model": a.model, "quant": a.quant, "rows": len(at), "every": a.every,
              "trimmed_vs_float32": compare(reference, trimmed), "full_vs_float32": compare(reference, full),
              "trimmed_vs_full": compare(full, trimmed), "bitwise_equal_rows": int((trimmed == full).all(-1).sum()),
              "environment": environment(a.model),
              "command": "python experiments/probes/last_row_accuracy.py" + (f" --quant {a.quant}" if a.quant != "int8w" else "")}
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
