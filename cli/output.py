"""Everything the command prints: JSON documents, human text, tables, progress bars.

Rules (docs/cli.md): with --json, stdout holds exactly one JSON document (chat: one per turn)
and nothing else; otherwise results go to stdout and notes (summaries, hints) to stderr, which
-q silences. Progress bars, spinners and colours appear only when stderr is a terminal, and
never with --json or -q. Streams are looked up at each write, so tests can capture them.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqstore.units import format_size

Progress = Callable[..., None]


class Output:
    """How one command run prints (chosen by --json, -q and -v)."""

    def __init__(self, json_mode: bool = False, quiet: bool = False, verbose: bool = False,
                 checkpoint: Callable[[], None] | None = None) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.verbose = verbose
        # Called at every streamed piece and progress update: where a Ctrl-C that C code
        # swallowed is raised again (interrupt.py).
        self.checkpoint = checkpoint or _ignore
        self._streamed_newline = True

    # --- streams ---------------------------------------------------------------------------

    @property
    def stdout(self):
        return sys.stdout

    @property
    def stderr(self):
        return sys.stderr

    def _is_tty(self, stream) -> bool:
        try:
            return stream.isatty()
        except (AttributeError, ValueError):
            return False

    @property
    def interactive(self) -> bool:
        """Whether progress and colours may be shown (stderr is a terminal; not --json or -q)."""
        return self._is_tty(self.stderr) and not self.json_mode and not self.quiet

    # --- results ---------------------------------------------------------------------------

    def document(self, doc: Any) -> None:
        """Print one JSON document on stdout (indented on a terminal, one line otherwise)."""
        indent = 2 if self._is_tty(self.stdout) else None
        print(json.dumps(doc, indent=indent, default=_jsonable), file=self.stdout, flush=True)

    def json_line(self, doc: Any) -> None:
        """Print one JSON object as one line (JSON lines: chat turns)."""
        print(json.dumps(doc, default=_jsonable), file=self.stdout, flush=True)

    def emit(self, doc: Any, human: Callable[[], None] | None = None) -> None:
        """The result of a command: `doc` as JSON with --json, else whatever `human` prints."""
        if self.json_mode:
            self.document(doc)
        elif human is not None:
            human()

    def line(self, text: str = "") -> None:
        """A line of the human result on stdout."""
        print(text, file=self.stdout, flush=True)

    def stream(self, text: str) -> None:
        """Part of a streamed answer on stdout, flushed at once (with --json nothing: the answer
        is in the document)."""
        self.checkpoint()
        if text and not self.json_mode:
            self.stdout.write(text)
            self.stdout.flush()
            self._streamed_newline = text.endswith("\n")

    def end_stream(self) -> None:
        """End a streamed answer with a newline if it did not end with one."""
        if not self._streamed_newline:
            self.stdout.write("\n")
            self.stdout.flush()
        self._streamed_newline = True

    def note(self, text: str) -> None:
        """A note for people on stderr (summaries, hints); silent with -q or --json."""
        if not self.quiet and not self.json_mode:
            print(text, file=self.stderr, flush=True)

    def detail(self, text: str) -> None:
        """A note shown only with -v."""
        if self.verbose:
            self.note(text)

    def error(self, kind: str, message: str) -> None:
        """A failure: the JSON error object on stdout with --json, else one line on stderr."""
        if self.json_mode:
            self.document({"error": {"type": kind, "message": message}})
        else:
            print(f"tqstore: {message}", file=self.stderr, flush=True)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> None:
        """Aligned columns on stdout; `align` holds 'r' for each right-aligned column. The
        header is bold on a terminal, and rows never wrap (a pipe gets the same columns)."""
        cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

        def render(row: list[str]) -> str:
            parts = [c.rjust(w) if align[i:i + 1] == "r" else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
            return "  ".join(parts).rstrip()

        header = render(cells[0])
        if self._is_tty(self.stdout):
            header = f"\x1b[1m{header}\x1b[0m"
        self.line(header)
        for row in cells[1:]:
            self.line(render(row))

    # --- progress ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def progress(self, description: str, unit: str = "") -> Iterator[Progress]:
        """A progress bar on stderr (terminal only): yields `update(done, total, ...)`.

        `unit` "bytes" shows sizes and a byte rate, any other unit a count and a rate per
        second in that unit; `update(..., stage=NAME)` starts a new stage. Without a terminal
        `update` does nothing.
        """
        if not self.interactive:
            yield self._checked(_ignore)
            return
        from .progress import progress_bar  # rich is imported only when a bar is shown

        with progress_bar(self.stderr, description, unit) as update:
            yield self._checked(update)

    def _checked(self, update: Progress) -> Progress:
        def checked(*args: Any, **kwargs: Any) -> None:
            self.checkpoint()
            update(*args, **kwargs)
        return checked

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        """A spinner with `text` on stderr while a slow step runs (terminal only)."""
        if not self.interactive:
            yield
            return
        from rich.console import Console

        with Console(file=self.stderr).status(text):
            yield


def _ignore(*_: object, **__: object) -> None:
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# --- formatting helpers shared by the commands ------------------------------------------------


def seconds(value: float) -> str:
    """A duration for people: "0.031 s", "48.2 s", "3 min 20 s"."""
    if value < 1:
        return f"{value:.3f} s"
    if value < 120:
        return f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    return f"{minutes} min {secs} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def ago(timestamp: float, now: float | None = None) -> str:
    """How long ago a Unix time was: "just now", "5 min ago", "3 d ago"."""
    delta = (time.time() if now is None else now) - timestamp
    if delta < 60:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if delta >= size:
            return f"{math.floor(delta / size)} {unit} ago"
    return "just now"


def size(n: int | None) -> str:
    """Bytes for tables ("-" when unknown)."""
    return "-" if n is None else format_size(int(n))
