"""The TQSTORE_* switches that attention reads on every call, read at the cost of a dict lookup.

A compressed layer's attention call reads about eight switches (the backend, the mirror's
length, the kernels' tuning, the question's prefill), normally all unset, in every layer of
every question and decode step, so that a process may change them between calls. For a
variable that is not set, `os.environ.get` raises and catches a KeyError inside CPython's
`os._Environ`: 0.6 us on the CI machine, several times a kernel launch's share of a step
(bench/kernel_call_cost.py). On POSIX `os.environ` keeps its contents in a dict of encoded
names (`_data`) that every change through `os.environ` updates, so a lookup there sees exactly
what `os.environ.get` sees (a bare `os.putenv` changes neither). Where that dict is not there,
`setting` is `os.environ.get`.
"""

from __future__ import annotations

import functools
import os

_DATA = getattr(os.environ, "_data", None)
# (only where that dict holds encoded names, as CPython's has on POSIX since 3.2)
_ENCODED = os.name == "posix" and isinstance(_DATA, dict) and all(isinstance(k, bytes) for k in _DATA)


def setting(name: str, default: str | None = None) -> str | None:
    """`os.environ.get(name, default)`, without an exception for an unset variable."""
    if not _ENCODED:
        return os.environ.get(name, default)
    value = _DATA.get(_encoded(name))
    return default if value is None else os.fsdecode(value)


@functools.lru_cache(maxsize=None)
def _encoded(name: str) -> bytes:
    # (how os.environ encodes its keys on POSIX; a handful of constant names)
    return os.fsencode(name)
