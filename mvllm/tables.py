"""Rich tables that read at 80 columns (a terminal, a CI log, a pipe): no vertical rules, one space between
columns, short headers whose units a legend below the table gives, and name columns (policies, backends) that
are never cut: they keep their width and the other columns wrap at their spaces."""

from __future__ import annotations

from rich import box
from rich.table import Table

WIDTH = 80  # what a table is built to fit; bench, simulate and profile print to 80 columns off a terminal


def narrow(title: str | None = None, legend: str | None = None, **kw) -> Table:
    """A table without vertical rules or edge padding, its title and legend (the caption) flush left."""
    return Table(title=title, caption=legend, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 padding=(0, 1), collapse_padding=True, title_justify="left", caption_justify="left", **kw)


def name_column(t: Table, header: str) -> None:
    """A column of names (policy, backend): never wrapped, never cut."""
    t.add_column(header, no_wrap=True, overflow="fold")


def number_column(t: Table, header: str) -> None:
    t.add_column(header, justify="right")


def text_column(t: Table, header: str) -> None:
    """Free text (requests per backend, settings): wraps at its spaces."""
    t.add_column(header, overflow="fold")


def decimals(x: float, digits: int) -> int:
    """`digits`, fewer from 100 (one at most) and none from 1,000: a wide number stays short."""
    return 0 if abs(x) >= 1000 else min(digits, 1) if abs(x) >= 100 else digits


def plus_minus(mean: str, std: str | None) -> str:
    """mean over ±std on the next line: the pair wraps there instead of widening the column."""
    return mean if std is None else f"{mean}\n±{std}"


def pct_change(pct: float) -> str:
    """A relative change in percent: one decimal below 100%, none from there."""
    return f"{pct:+.1f}%" if abs(pct) < 100 else f"{pct:+.0f}%"


def short(knob: str) -> str:
    """A sweep's knob as a column header: its last part, words apart (workload.suffix_tokens: suffix tokens)."""
    return knob.rsplit(".", 1)[-1].replace("_", " ")
