"""Gzip the bulky per-run files of a results folder in place, so the committed tree stays small.

    python experiments/compress_results.py [results/ ...] [--min-log-bytes 50000] [--dry-run]

bench writes requests.csv, routing.jsonl, aggregate.json and server.log plain (the server appends to its routing
log while it runs); `mvllm report`, `mvllm simulate` and the other readers take either the plain file or its .gz
(mvllm/bench/results.py: `find_file`, `open_text`, `read_aggregate`). This turns every requests.csv,
routing.jsonl and aggregate.json, and every *.log or *.txt of at least --min-log-bytes, into <name>.gz and removes the plain file. The gzip is deterministic (level 9, no
name, mtime 0), each one is read back before the plain file goes, and a second run changes nothing. Where
both are there (a run made again after compressing), the plain file is the newer one and replaces the .gz.
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

ALWAYS = ("requests.csv", "routing.jsonl", "aggregate.json")
LOGS = (".log", ".txt")


def wanted(path: Path, min_log_bytes: int) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    if path.name in ALWAYS:
        return True
    return path.suffix in LOGS and path.stat().st_size >= min_log_bytes


def compress(path: Path, dry_run: bool = False) -> tuple[int, int] | None:
    """path -> path.gz; returns (plain bytes, gzipped bytes), or None where an equal .gz was there already."""
    data = path.read_bytes()
    target = path.with_name(path.name + ".gz")
    if target.is_file() and gzip.decompress(target.read_bytes()) == data:
        if not dry_run:
            path.unlink()
        return None
    packed = gzip.compress(data, compresslevel=9, mtime=0)
    if gzip.decompress(packed) != data:
        raise SystemExit(f"{path}: gzip did not read back")
    if not dry_run:
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(packed)
        os.replace(tmp, target)
        path.unlink()
    return len(data), len(packed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path, default=[Path("results")])
    ap.add_argument("--min-log-bytes", type=int, default=50_000,
                    help="compress *.log and *.txt files of at least this size (default 50000)")
    ap.add_argument("--dry-run", action="store_true", help="list what would be compressed; change nothing")
    args = ap.parse_args(argv)
    before = after = n = 0
    for folder in args.folders:
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder")
        for path in sorted(folder.rglob("*")):
            if not wanted(path, args.min_log_bytes):
                continue
            got = compress(path, args.dry_run)
            if got is None:
                print(f"{path}: its .gz holds the same bytes; plain copy {'to remove' if args.dry_run else 'removed'}")
                continue
            n += 1
            before += got[0]
            after += got[1]
            print(f"{path} -> {path.name}.gz: {got[0]:,} -> {got[1]:,} bytes")
    print(f"{'would compress' if args.dry_run else 'compressed'} {n} files: {before:,} -> {after:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
