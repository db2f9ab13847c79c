"""The table of experiments/cpu_peer.sh: each cell of the comparison for llama.cpp and mvllm from one call's
outputs, and mvllm's time over llama.cpp's (below 1: mvllm is faster; for prefill, tok/s the other way).
With rounds (ROUNDS=N: OUT/round-K), each round's table, and per cell the median of the rounds' values and
ratios with their range.

    python experiments/cpu_peer_table.py OUT [--json FILE] [--bundle]
    python experiments/cpu_peer_table.py --step-mb      the MB a decode step's weights are (for read_bandwidth.cpp)

Where OUT holds read-bandwidth.jsonl (experiments/read_bandwidth.cpp, run by cpu_peer.sh), the table also gives the
floor under a batch-1 decode step at each thread count: the weights' bytes at the rate the host's threads read a
buffer of that size pass after pass (what of it the L3 keeps included), and each side's time over that floor.

--bundle then folds every other text output under OUT (the peer's and the profile's logs and JSON, mvllm.json
included) into OUT/raw.json.gz by relative path and deletes them, so a device call brings back two files
(table.json and raw.json.gz) and the results tree stays small.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def step_mb(preset: str = "qwen2.5-0.5b", group: int = 32) -> float:
    """MB of weights a decode step of int8w (and llama.cpp's Q8_0) reads: every linear and the tied LM head, one byte
    a weight and a float16 scale a group of 32 inputs."""
    from mvllm.model.presets import PRESETS

    c = PRESETS[preset]
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    weights = layers * (h * (h + 2 * kv) + h * h + 2 * h * i + i * h) + c["vocab_size"] * h
    return weights * (1 + 2 / group) / 1e6


def floors(out: Path) -> dict:
    """{threads: {"mb", "gb_s", "floor_ms", "dram_gb_s", "dram_floor_ms"}} from OUT/read-bandwidth.jsonl: the median
    rate of the step-sized buffer (what the L3 keeps of it included) and of the largest buffer (DRAM alone), and the
    step's weights at each."""
    path = out / "read-bandwidth.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")] if path.exists() else []
    mb, largest = step_mb(), max((r["mb"] for r in rows), default=0)
    found = {}
    for r in rows:
        f = found.setdefault(r["threads"], {"mb": round(mb, 1)})
        if abs(r["mb"] - mb) < 1:
            f.update(gb_s=r["median_gb_s"], floor_ms=round(mb / r["median_gb_s"], 2))
        if r["mb"] == largest and largest > 2 * mb:
            f.update(dram_gb_s=r["median_gb_s"], dram_floor_ms=round(mb / r["median_gb_s"], 2))
    return {t: f for t, f in found.items() if "floor_ms" in f}


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
        floor = floors(out).get(threads)
        if kind == "decode" and batch == 1 and floor:
            row["floor_ms"], row["dram_floor_ms"] = floor["floor_ms"], floor.get("dram_floor_ms")
            row["mvllm_over_floor"] = round(value / floor["floor_ms"], 3)
            if other is not None:
                row["llama_cpp_over_floor"] = round(other / floor["floor_ms"], 3)
        rows.append(row)
    return {"backends": names, "rows": rows, "read_bandwidth": floors(out),
            "rule": "decode: ms a step; prefill: tok/s; warm: ms for 20 new tokens after 496 cached, and in decode "
                    "steps at depth 516. mvllm_over_llama_cpp: mvllm's time over llama.cpp's (below 1: mvllm faster)"}


def by_rounds(out: Path) -> dict | None:
    """OUT/round-K tables, and per cell the median over the rounds (values, ratio, and the ratio's range)."""
    rounds = sorted(out.glob("round-*"), key=lambda p: int(p.name.split("-")[1]))
    if not rounds:
        return None
    tables = [table(r) for r in rounds]
    key = ("backend", "cell", "batch", "threads", "depth", "tokens")
    cells: dict[tuple, list[dict]] = {}
    for t in tables:
        for r in t["rows"]:
            cells.setdefault(tuple(r.get(k) for k in key), []).append(r)
    rows = []
    for rs in cells.values():
        row = {k: rs[0][k] for k in key if k in rs[0]}
        for k in ("mvllm", "llama_cpp", "mvllm_over_llama_cpp", "decode_steps", "floor_ms", "dram_floor_ms",
                  "mvllm_over_floor", "llama_cpp_over_floor"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                row[k] = round(statistics.median(vals), 3)
                if k in ("mvllm_over_llama_cpp", "decode_steps"):
                    row[f"{k}_range"] = [min(vals), max(vals)]
        rows.append(row)
    return {"backends": tables[0]["backends"], "rows": rows, "rounds": [r.name for r in rounds],
            "read_bandwidth": [t["read_bandwidth"] for t in tables],
            "round_tables": tables,
            "rule": tables[0]["rule"] + "; with rounds: the median over the rounds, the ratio's range beside it"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--step-mb", action="store_true", help="print the MB of weights a decode step reads, and stop")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--bundle", action="store_true", help="fold the other outputs into OUT/raw.json.gz")
    a = ap.parse_args()
    if a.step_mb:
        print(f"{step_mb():.1f}")
        return
    if a.out is None:
        ap.error("OUT is required")
    t = by_rounds(a.out) or table(a.out)
    if "rounds" in t:
        print(f"median of {len(t['rounds'])} rounds (range of the ratio)")
    print(f"{'backend':<10} {'cell':<8} {'batch':>5} {'threads':>7} {'n':>5} {'mvllm':>9} {'llama.cpp':>9} {'ratio':>6}")
    for r in t["rows"]:
        n = r.get("depth", r.get("tokens"))
        ratio = r.get("mvllm_over_llama_cpp", r.get("decode_steps"))
        spread = r.get("mvllm_over_llama_cpp_range", r.get("decode_steps_range"))
        print(f"{r['backend']:<10} {r['cell']:<8} {r['batch']:>5} {r['threads']:>7} {n:>5} {r['mvllm']:>9} "
              f"{'-' if r.get('llama_cpp') is None else r['llama_cpp']:>9} {'-' if ratio is None else ratio:>6}"
              + (f"  ({spread[0]}-{spread[1]})" if spread else "")
              + (f"  floor {r['floor_ms']} ms (DRAM {r.get('dram_floor_ms', '-')}): mvllm {r['mvllm_over_floor']}x, "
                 f"llama.cpp {r.get('llama_cpp_over_floor', '-')}x" if r.get("floor_ms") else ""))
    (a.json or a.out / "table.json").write_text(json.dumps(t, separators=(",", ":")) + "\n")  # compact: the tree travels
    if a.bundle:
        bundle(a.out)


def bundle(out: Path) -> None:
    keep = {out / "table.json", out / "raw.json.gz"}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p not in keep)
    raw = {str(p.relative_to(out)): p.read_text(errors="replace") for p in files if p.stat().st_size < 4_000_000}
    body = json.dumps({"what": "the call's other outputs, by path under OUT (cpu_peer.sh)", "files": raw}, indent=1)
    with gzip.GzipFile(out / "raw.json.gz", "wb", compresslevel=9, mtime=0) as f:
        f.write(body.encode())
    for p in files:
        p.unlink()
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()

if __name__ == "__main__":
    main()
