"""Run folders on disk and the aggregate over runs.

    results/<experiment>/experiment.toml           the experiment as given (plus experiment.json, resolved)
    results/<experiment>/<run-id>/summary.json     run metadata + vLLM-named metrics, and under "environment"
                                                   the devices, CPU, versions, git commit, command line
    results/<experiment>/<run-id>/requests.csv     one row per request
    results/<experiment>/<run-id>/routing.jsonl    the server's routing log (managed runs)
    results/<experiment>/<run-id>/server.log       the server's own log
    results/<experiment>/aggregate.json|csv         mean and spread per policy, change against gpu-only

bench writes them plain; committed results keep requests.csv and routing.jsonl (and any log of 50 KB or
more) gzipped, as requests.csv.gz etc. (experiments/compress_results.py); the readers take either (`find_file`).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import statistics
from pathlib import Path

from mvllm.bench.metrics import RequestRecord
from mvllm.errors import MvllmError

CSV_COLUMNS = ("id", "backend", "arrival", "sent", "first_token", "finish", "ttft_ms", "tpot_ms", "e2el_ms",
               "prompt_tokens", "cached_tokens", "output_tokens", "error", "itl_ms", "max_tokens", "target_tokens",
               "finish_reason", "parent")
BASELINE = "gpu-only"


class ResultsError(MvllmError):
    pass


def run_id(policy: str, run: int, knob: str | None = None, value=None) -> str:
    name = f"{policy}-run{run}"
    if knob is not None:
        name = f"{knob.split('.')[-1]}={value}-{name}"
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def write_requests(path: Path, records: list[RequestRecord]) -> None:
    def ms(x):
        return "" if x is None else repr(1000.0 * x)

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            ok = r.ok
            w.writerow([r.id, r.backend, repr(r.arrival), _num(r.sent), _num(r.first_token), _num(r.finish),
                        ms(r.ttft) if ok else "", ms(r.tpot) if ok else "", ms(r.e2el) if ok else "",
                        r.prompt_tokens, "" if r.cached_tokens is None else r.cached_tokens, r.output_tokens,
                        r.error, " ".join(f"{1000.0 * x:.3f}" for x in r.itl), _num(r.max_tokens),
                        _num(r.target_tokens), r.finish_reason, _num(r.parent)])


def _num(x) -> str:
    return "" if x is None else repr(x)


def find_file(folder: Path, name: str) -> Path | None:
    """folder/name, or its gzipped copy folder/name.gz where only that is there; None where neither is."""
    for p in (folder / name, folder / f"{name}.gz"):
        if p.is_file():
            return p
    return None


def open_text(path: Path) -> io.TextIOBase:
    """A text file, plain or gzipped (by its .gz name), opened for reading (csv-ready: newline="")."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def request_rows(folder: Path) -> list[dict]:
    """One run's requests.csv (or requests.csv.gz) as csv.DictReader rows (every value a string)."""
    path = find_file(folder, "requests.csv")
    if path is None:
        raise ResultsError(f"{folder} holds no requests.csv (nor requests.csv.gz)")
    with open_text(path) as f:
        return list(csv.DictReader(f))


def _value(row: dict, key: str, kind=float):
    """One CSV cell as `kind`, None where empty or absent (an older CSV lacks the later columns)."""
    v = row.get(key)
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return None
    return kind(float(v)) if kind is int else kind(v)


def records_from_rows(rows: list[dict]) -> list[RequestRecord]:
    """The request records back from requests.csv rows (request_rows, or a DataFrame's to_dict("records")):
    every field write_requests saves; the chunk times rebuilt from the first token and the ITL gaps."""
    out = []
    for row in rows:
        first = _value(row, "first_token")
        gaps = [float(x) / 1000.0 for x in str(row.get("itl_ms") or "").split()] if first is not None else []
        chunks = [first] if first is not None else []
        for g in gaps:
            chunks.append(chunks[-1] + g)
        out.append(RequestRecord(
            id=_value(row, "id", int), arrival=_value(row, "arrival"), sent=_value(row, "sent"), first_token=first,
            finish=_value(row, "finish"), prompt_tokens=_value(row, "prompt_tokens", int) or 0,
            backend=_value(row, "backend", str) or "", cached_tokens=_value(row, "cached_tokens", int),
            output_tokens=_value(row, "output_tokens", int) or 0, chunks=chunks,
            error=_value(row, "error", str) or "", max_tokens=_value(row, "max_tokens", int),
            target_tokens=_value(row, "target_tokens", int), finish_reason=_value(row, "finish_reason", str) or "",
            parent=_value(row, "parent", int)))
    return out


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def read_json(path: Path):
    """A JSON file, plain or gzipped (by its .gz name)."""
    try:
        with open_text(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ResultsError(f"cannot read {path}: {e}") from None


def read_aggregate(folder: Path) -> list[dict]:
    """An experiment folder's aggregate.json (or the aggregate.json.gz committed results keep); [] where neither."""
    path = find_file(folder, "aggregate.json")
    return [] if path is None else read_json(path)


def runs_in(folder: Path) -> list[dict]:
    """Every run summary under an experiment folder, each with its folder under key "_dir"."""
    out = []
    for p in sorted(folder.glob("*/summary.json")):
        s = read_json(p)
        s["_dir"] = p.parent
        out.append(s)
    return out


def experiments_in(root: Path) -> list[Path]:
    """Every experiment folder (one holding */summary.json) under root, also those a level or more down
    (results/compiled-gpu/paper-48); an experiment's own subfolders (simulated/) are not searched."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir():
            out += [p] if any(p.glob("*/summary.json")) else experiments_in(p)
    return out


META = ("run", "value", "max_active", "start_time")
PER_BACKEND = ("backend_hit_rate", "backend_p99_itl_ms", "backend_max_itl_ms")  # aggregated per backend, as
# "backend_hit_rate.gpu"


def _numeric(s: dict) -> dict[str, float]:
    flat = dict(s)
    for name in PER_BACKEND:
        flat.update({f"{name}.{b}": v for b, v in (s.get(name) or {}).items()})
    return {k: float(v) for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in META}


def _key(s: dict):
    return (s.get("value"), s["policy"])


def aggregate(summaries: list[dict]) -> list[dict]:
    """One row per (sweep value, policy): mean, std, min, max over runs of every numeric metric (each
    backend's hit rate as backend_hit_rate.NAME), the per-run backend counts, and each metric's mean change in
    percent against gpu-only (same value)."""
    groups: dict = {}
    for s in summaries:
        groups.setdefault(_key(s), []).append(s)
    rows = []
    for (value, policy), runs in groups.items():
        metrics = {}
        names = sorted({k for s in runs for k in _numeric(s)})
        for k in names:
            xs = [_numeric(s)[k] for s in runs if k in _numeric(s)]
            metrics[k] = {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                          "min": min(xs), "max": max(xs), "n": len(xs)}
        rows.append({"value": value, "policy": policy, "runs": len(runs), "knob": runs[0].get("knob"),
                     "metrics": metrics, "backend_requests": [s.get("backend_requests", {}) for s in runs]})
    by_key = {(r["value"], r["policy"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["value"], BASELINE))
        r["change_vs_gpu_only"] = {}
        if base is None:
            continue
        for k, m in r["metrics"].items():
            b = base["metrics"].get(k, {}).get("mean")
            if b and not math.isclose(b, 0.0):
                r["change_vs_gpu_only"][k] = 100.0 * (m["mean"] - b) / b
    return sorted(rows, key=lambda r: (value_order(r["value"]), r["policy"] != BASELINE, r["policy"]))


def value_order(value) -> tuple:
    """Sweep values in numeric order where they are numbers (2 before 16), else as text."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, float(value), "") if number else (1, 0.0, str(value))


def write_aggregate(folder: Path) -> list[dict]:
    rows = aggregate(runs_in(folder))
    write_json(folder / "aggregate.json", rows)
    with open(folder / "aggregate.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("knob", "value", "policy", "metric", "mean", "std", "min", "max", "runs", "change_vs_gpu_only_pct"))
        for r in rows:
            for k, m in r["metrics"].items():
                ch = r["change_vs_gpu_only"].get(k)
                w.writerow((r["knob"] or "", "" if r["value"] is None else r["value"], r["policy"], k, m["mean"],
                            m["std"], m["min"], m["max"], m["n"], "" if ch is None else ch))
    return rows
