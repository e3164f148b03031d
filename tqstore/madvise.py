"""Advice to the kernel about memory ranges (madvise(2)) where the platform has it: pages to read
ahead, memory to back with huge pages. Advice only: where the
call or the advice is missing it does nothing, and the code it speeds up works the same."""

from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np

WILLNEED = 3  # read these file-backed pages ahead (Linux and macOS)
HUGEPAGE = 14  # back this anonymous memory with transparent huge pages (Linux)
PAGE = 4096
HUGE_PAGE = 2 << 20


def advise(buffer: np.ndarray | memoryview, advice: int, page: int = PAGE) -> bool:
    """Give `advice` for the whole `page`-sized pages inside `buffer` (numpy array or buffer);
    whether the kernel took it. Releases the GIL for the call (ctypes does)."""
    madvise = _madvise()
    if madvise is None or (advice == HUGEPAGE and not sys.platform.startswith("linux")):
        return False
    view = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
    start = -(-view.ctypes.data // page) * page
    stop = (view.ctypes.data + view.nbytes) // page * page
    return stop > start and madvise(start, stop - start, advice) == 0


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where there is none to call."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
