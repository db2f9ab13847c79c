"""The table of experiments/cpu_peer.sh: each cell of issue 27 for llama.cpp and mvllm from one call's
outputs, and mvllm's time over llama.cpp's (below 1: mvllm is faster; for prefill, tok/s the other way).

    python experiments/cpu_peer_table.py OUT [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def llama_bench(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        return []
    try:
        return json.loads(text)
    except ValueError:  # cut by its timeout: the tests that finished
        cut = text.rfind("}")
        return json.loads(text[:cut + 1] + "]") if cut > 0 else []


def batched(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{") and "speed_tg" in line]


def peer_cells(out: Path) -> dict:
    cells = {}
    for r in llama_bench(out / "lcpp" / "depth.json"):
        if r.get("n_gen"):
            cells[("decode", 1, r["n_threads"], r.get("n_depth", 0))] = 1000 / r["avg_ts"]
    for r in llama_bench(out / "lcpp" / "llama-bench.json"):
        if r.get("n_prompt") and not r.get("n_gen"):
            cells[("prefill", 1, r["n_threads"], r["n_prompt"])] = r["avg_ts"]
    for path in sorted((out / "lcpp").glob("batched-bench-t*.jsonl")):
        threads = int(path.stem.split("-t")[1])
        for r in batched(path):
            depth = 0 if r["pp"] <= 1 else r["pp"]
            cells.setdefault(("decode", r["pl"], threads, depth), 1000 * r["t_tg"] / r["tg"])
    return cells


def mvllm_cells(out: Path) -> tuple[dict, dict]:
    profile = json.loads((out / "mvllm.json").read_text())
    cells, names = {}, {}
    for name, b in profile["backends"].items():
        t = b["threads"]
        names[name] = {k: b.get(k) for k in ("threads", "quant", "batch_invariant", "picked")}
        for c in b.get("contexts", []):
            cells[(name, "decode", c["batch"], t, c["depth"])] = c["step_ms"]
        for p in b.get("prefill", []):
            if p["kind"] == "cold":
                cells[(name, "prefill", 1, t, p["tokens"])] = p["tok_s"]
            elif p["kind"] == "warm":
                cells[(name, "warm", 1, t, p["tokens"])] = p["ms"]
    return cells, names


def table(out: Path) -> dict:
    peer = peer_cells(out)
    mine, names = mvllm_cells(out)
    rows = []
    for (name, kind, batch, threads, n), value in sorted(mine.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][2], kv[0][4], kv[0][0])):
        other = peer.get((kind, batch, threads, n))
        row = {"backend": name, "cell": kind, "batch": batch, "threads": threads,
               ("depth" if kind == "decode" else "tokens"): n, "mvllm": round(value, 2),
               "llama_cpp": None if other is None else round(other, 2)}
        if other is not None:
            row["mvllm_over_llama_cpp"] = round(value / other if kind == "decode" else other / value, 3)
        if kind == "warm":
            step = mine.get((name, "decode", 1, threads, 516))
            row["decode_steps"] = None if step is None else round(value / step, 2)
        rows.append(row)
    return {"backends": names, "rows": rows,
            "rule": "decode: ms a step; prefill: tok/s; warm: ms for 20 new tokens after 496 cached, and in decode "
                    "steps at depth 516. mvllm_over_llama_cpp: mvllm's time over llama.cpp's (below 1: mvllm faster)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t = table(a.out)
    print(f"{'backend':<10} {'cell':<8} {'batch':>5} {'threads':>7} {'n':>5} {'mvllm':>9} {'llama.cpp':>9} {'ratio':>6}")
    for r in t["rows"]:
        n = r.get("depth", r.get("tokens"))
        ratio = r.get("mvllm_over_llama_cpp", r.get("decode_steps"))
        print(f"{r['backend']:<10} {r['cell']:<8} {r['batch']:>5} {r['threads']:>7} {n:>5} {r['mvllm']:>9} "
              f"{'-' if r['llama_cpp'] is None else r['llama_cpp']:>9} {'-' if ratio is None else ratio:>6}")
    (a.json or a.out / "table.json").write_text(json.dumps(t, indent=1) + "\n")


if __name__ == "__main__":
    main()
