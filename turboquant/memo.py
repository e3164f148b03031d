"""Bounded per-process tables of things made once from objects: a restore's plans and
calibrations, the GPU kernels' tables and call templates. An entry is kept beside the objects
it was made from and checked against them by identity on every hit (an id is reused once its
object is gone); the oldest entries go first past a table's bound, so a long-running server that
restores many entries keeps a bounded number of them alive.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def keep(table: dict, key, entry, kept: int) -> None:
    """Put `entry` under `key`, dropping the oldest entries past `kept`."""
    while len(table) >= kept:
        del table[next(iter(table))]
    table[key] = entry


def same(objects: tuple, kept: tuple) -> bool:
    """Whether `objects` are the objects `kept` holds, one by one (identity, compared in C)."""
    return len(objects) == len(kept) and all(map(operator.is_, objects, kept))


def once(table: dict, key, sources: tuple, kept: int, make: Callable[..., T], *args) -> T:
    """What `make(*args)` made from `sources`, kept in `table` under `key` beside them and made
    again only when `key` holds something made from other objects. (`make` and `args` rather
    than a closure: a hit, the usual case on a hot path, then builds no function object.)"""
    hit = table.get(key)
    if hit is not None and same(sources, hit[0]):
        return hit[1]
    made = make(*args)
    keep(table, key, (sources, made), kept)
    return made
