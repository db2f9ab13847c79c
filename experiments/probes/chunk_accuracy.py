"""Chunked prefill on real weights: the evaluation text (mvllm/data/eval.txt) through an engine's served path whole
and in chunks of each size given, each against the float32 reference (mean KL, top-1; profile/accuracy.py) and the
chunked logits against the whole ones. Chunking changes which kernels and row counts a prompt's tokens take.

    python3 experiments/probes/chunk_accuracy.py [--model smollm2-135m] [--device cpu] [--chunks 64,256]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.env import describe
from mvllm.profile.accuracy import Reference, compare, served_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunks", default="64,256")
    ap.add_argument("--out")
    a = ap.parse_args()
    eng = Engine(EngineConfig(a.model, device=a.device, max_active=1, num_blocks=128))
    ref = Reference(eng.source)
    whole = served_logits(eng.runner, ref.ids)
    rows = [{"chunk": None, **compare(ref.logits, whole)}]
    for chunk in (int(c) for c in a.chunks.split(",")):
        got = served_logits(eng.runner, ref.ids, chunk)
        rows.append({"chunk": chunk, **compare(ref.logits, got), "against_whole": compare(whole, got)})
    mode = f"{eng.config.dtype} {eng.config.quant}"
    for r in rows:
        vs = r.get("against_whole")
        print(f"{a.model} {a.device} {mode}, chunk {r['chunk'] or 'whole'}: against float32 KL {r['kl_mean']:.5f} "
              f"top-1 {r['top1']:.4f}" + (f"; against whole KL {vs['kl_mean']:.2e} top-1 {vs['top1']:.4f}" if vs else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": describe(), "model": a.model, "mode": mode, "tokens": len(ref.ids), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
