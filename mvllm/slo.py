"""SLOs as vLLM writes them (`--goodput ttft:500 tpot:50`): parsed here for bench, simulate, the capacity search
and the server's slo policy alike, below all of them."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from mvllm.errors import MvllmError

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


class SloError(MvllmError):
    pass


def parse_slo(items: Iterable[str], flag: str = "--goodput") -> dict[str, float]:
    """vLLM's `--goodput KEY:MS` pairs (KEY ttft, tpot or e2el; repeated, or several in one value apart by
    spaces or commas) as {"ttft_ms": MS, ...}."""
    out: dict[str, float] = {}
    for item in items:
        for pair in re.split(r"[\s,]+", item.strip()):
            if not pair:
                continue
            name, sep, value = pair.partition(":")
            key = name if name.endswith("_ms") else f"{name}_ms"
            if not sep:
                raise SloError(f"{flag} {pair!r}: expected KEY:MS (vLLM's form), e.g. {flag} ttft:500")
            if key not in SLO_KEYS:
                raise SloError(f"{flag} {pair!r}: unknown metric {name!r}; give KEY:MS with KEY one of ttft, "
                               f"tpot, e2el, e.g. {flag} ttft:500")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if not 0 < ms < math.inf:
                raise SloError(f"{flag} {pair!r}: the bound must be a positive number of milliseconds, "
                               f"e.g. {name}:500")
            out[key] = ms
    return out
