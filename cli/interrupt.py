"""Ctrl-C that ends the command even where C code swallowed it.

Python's SIGINT handler raises KeyboardInterrupt wherever the main thread is, and C code that
clears errors can discard it. `mx.array(numpy array)` does: MLX compares the array's dtype with
numpy, whose dtype parsing checks for signals, and drops the failed comparison's error. An `ask`
on a CPU, which builds such arrays in every decode step, went on decoding after about one Ctrl-C
in ten. The handler here also records the request, and `check` raises it again at the command's
next output (a streamed piece of the answer, a progress update).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Interrupt:
    """The Ctrl-C of one command run."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """This handler for SIGINT while the block runs, where Python's own is in place (so not in
        a thread, where SIGINT is ignored, or where the caller handles it)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (its first raise was then discarded)."""
        if self.requested:
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt
