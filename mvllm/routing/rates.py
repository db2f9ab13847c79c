"""The profile's rates: reading a profile JSON (`mvllm profile`'s, or a hand-written one with only the two rates
per backend), the rule that picks each backend's prefill_rate and decode_rate from its measurements, and the
rates a backend has as it is served (its decode table cut at the max_active it runs with).

Rule (RULE): prefill_rate is the cold-prefill throughput of a 516-token prompt (the reference prompt length;
the longest measured length under it when 516 is not measured), since the router divides uncached prompt
tokens by it; decode_rate is the aggregate decode throughput at full occupancy (batch = max_active) at a
context near 516 + 64, since the router divides the summed decode budgets of all active and queued requests
by it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mvllm.errors import MvllmError

REFERENCE_LEN = 516
RULE = ("prefill_rate: cold prefill tok/s of a {n}-token prompt; decode_rate: aggregate decode tok/s at "
        "batch max_active={b}, context ~{c}")


def choose_rates(backend: dict) -> dict:
    cold = [p for p in backend["prefill"] if p["kind"] == "cold"]
    under = [p for p in cold if p["tokens"] <= REFERENCE_LEN] or cold
    pre = max(under, key=lambda p: p["tokens"]) if under else next(p for p in backend["prefill"])
    full = max(backend["decode"], key=lambda d: d["batch"])
    warm = next((p for p in backend["prefill"] if p["kind"] == "warm"), None)
    return {"prefill_rate": pre["tok_s"], "decode_rate": full["tok_s"],
            "warm_prefill_rate": warm["tok_s"] if warm else None,
            "rule": RULE.format(n=pre["tokens"], b=full["batch"], c=full["context"])}


def rates_as_served(profile: dict, max_active: dict[str, int]) -> dict[str, dict]:
    """Each backend's profiled rates, as it will serve with `max_active[name]` running at most: the decode table
    is cut there and its rates chosen again by RULE; a table that stops short of max_active is kept, and eta's
    timing repeats its largest batch's step time up to max_active."""
    rates = dict(profile["backends"])
    for name, most in max_active.items():
        entry = rates.get(name)
        decode = (entry or {}).get("decode") or []
        fit = [d for d in decode if d["batch"] <= most]
        if not fit:
            continue
        entry = dict(entry, decode=fit, max_active=most)
        rates[name] = entry | choose_rates(entry) if len(fit) < len(decode) and entry.get("prefill") else entry
    return rates


def validate(profile, where: str) -> dict:
    if not isinstance(profile, dict) or not isinstance(profile.get("backends"), dict) or not profile["backends"]:
        raise MvllmError(f"{where} is not a profile: it needs a non-empty \"backends\" object")
    for name, b in profile["backends"].items():
        if not isinstance(b, dict):
            raise MvllmError(f"{where}: backend {name!r} must be an object")
        for key in ("prefill_rate", "decode_rate"):
            rate = b.get(key)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise MvllmError(f"{where}: backend {name!r} needs a positive number {key}, got {rate!r}")
    return profile


def load_profile(path: str | Path) -> dict:
    """Read and check a profile JSON; a hand-written one needs only prefill_rate/decode_rate per backend."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MvllmError(f"profile {path} does not exist; make one with `mvllm profile --out {path}`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MvllmError(f"profile {path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise MvllmError(f"profile {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return validate(data, f"profile {path}")
