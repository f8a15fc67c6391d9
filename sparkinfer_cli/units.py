"""Sizes and counts as people read them, for reports and messages."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    units, i = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"), 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{int(n)} B" if i == 0 else f"{n:.2f} {units[i]}"


def format_count(n: int) -> str:
    for divisor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= divisor:
            return f"{n / divisor:.2f} {suffix}"
    return str(n)
