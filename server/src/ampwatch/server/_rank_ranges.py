"""Rank lists in words: ``"0-999, 1001-1023"`` rather than a thousand numbers."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["rank_ranges"]


def rank_ranges(ranks: Iterable[int]) -> str:
    """Return ``"0-3, 7, 9-10"`` for ranks 0, 1, 2, 3, 7, 9, 10; O(n log n).

    >>> rank_ranges([3, 1, 2, 7, 9, 10, 1])
    '1-3, 7, 9-10'
    """
    parts: list[list[int]] = []
    for n in sorted(set(ranks)):
        if parts and parts[-1][1] == n - 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
