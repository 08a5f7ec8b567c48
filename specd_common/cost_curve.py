"""Costs measured at a few sizes, read at any size: the verify's start-up pass costs
(specd_engine/autotune.py) and the gateway's round prices (gateway/adaptive.py) share this rule."""

from __future__ import annotations


def interpolate(costs: dict[int, float], positions: int) -> float:
    """Cost at `positions` from measured sizes: linear between neighbours, flat beyond the ends."""
    sizes = sorted(costs)
    if positions <= sizes[0]:
        return costs[sizes[0]]
    if positions >= sizes[-1]:
        return costs[sizes[-1]]
    upper = next(n for n in sizes if n >= positions)
    lower = max(n for n in sizes if n <= positions)
    if upper == lower:
        return costs[lower]
    share = (positions - lower) / (upper - lower)
    return costs[lower] + share * (costs[upper] - costs[lower])
