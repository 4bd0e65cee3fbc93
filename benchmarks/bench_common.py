"""Helpers shared by the benchmark scripts (they run as scripts, so this folder is on sys.path)."""

from __future__ import annotations


def parse_count(text: str) -> int:
    """"32k" -> 32768, "1m" -> 1048576, "100" -> 100 (powers of two, as batch sizes are)."""
    text = text.strip().lower()
    factor = {"k": 1024, "m": 1024 * 1024}.get(text[-1], 1)
    return int(text[:-1] if factor > 1 else text) * factor


def format_count(n: int) -> str:
    """The inverse of ``parse_count`` for table labels: 32768 -> "32k", 1048576 -> "1M"."""
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
