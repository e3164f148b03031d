"""`tqstore`: parse the command line, run the command, turn failures into exit codes.

Exit codes: 0 success; 1 a user error (one line `tqstore: ...` on stderr, or the JSON error
object on stdout with --json), also for a broken pipe; 2 a usage error; 130 interrupted.
Expected failures (TqstoreError, predictable OSErrors) never print a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import NoReturn

from tqstore.errors import RemoteNotConfigured, TqstoreError

from .commands import COMMANDS
from .context import Context
from .interrupt import Interrupt
from .output import Output

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# transformers logs "PyTorch was not found ..." when imported without torch; tqstore uses only
# its tokenizers, so that line is noise to a user (set before any command imports it).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
BLAS_CHOICES = ("auto", "bundled", "openblas")
# Commands that run the model: the only ones for which the BLAS matters to the user.
MODEL_COMMANDS = frozenset({"demo", "save", "ask", "chat", "serve", "chunk_add"})
# ... and selftest, which reports the BLAS it runs on: the commands `auto` restarts on OpenBLAS.
BLAS_COMMANDS = MODEL_COMMANDS | {"selftest"}

DESCRIPTION = "Save a long context's KV cache once; answer every later question without the prefill."
EPILOG = """examples:
  tqstore save contract --model ./Qwen2.5-0.5B --file contract.txt
  tqstore ask contract "Who pays for delays?"
  tqstore push contract          # to the bucket in s3.url
  tqstore demo                   # the whole tour on a shipped document

every command takes --home DIR, --json, -q and -v (before or after the command);
docs/cli.md documents each command and its JSON output."""


class UsageError(Exception):
    """argparse refused the command line (exit 2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so `main` decides how to report."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(self, message)


def global_options(suppress: bool) -> argparse.ArgumentParser:
    """The flags every command takes. On subcommands their defaults are suppressed, so a flag
    given before the command is not reset by the subcommand's parser."""
    parent = Parser(add_help=False)
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    group = parent.add_argument_group("global options")
    group.add_argument("--home", metavar="DIR", default=default(None),
                       help="the store's folder (default: $TQSTORE_HOME or ~/.cache/tqstore)")
    group.add_argument("--json", action="store_true", default=default(False),
                       help="print one JSON document on stdout (errors too)")
    group.add_argument("-q", "--quiet", action="store_true", default=default(False),
                       help="print only results: no notes, summaries or progress")
    group.add_argument("-v", "--verbose", action="store_true", default=default(False),
                       help="print more detail (and tracebacks of internal errors)")
    group.add_argument("--blas", choices=BLAS_CHOICES, default=default(None),
                       help="CPU matmul library on Linux (default: $TQSTORE_BLAS or auto: OpenBLAS where installed)")
    return parent


def build_parser() -> Parser:
    """The whole command tree."""
    parser = Parser(prog="tqstore", description=DESCRIPTION, epilog=EPILOG, parents=[global_options(False)],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    common = global_options(True)
    for module in COMMANDS:
        module.register(sub, common)
    return parser


class VersionAction(argparse.Action):
    """`--version`: the installed version, looked up only when asked for (the package metadata
    lookup imports importlib.metadata and scans the installed distributions: 0.05-0.1 s that every
    other command paid when the parser was built)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        sys.stdout.write(f"tqstore {_version()}\n")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tqstore")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None, keep: list[object] | None = None) -> int:
    """Run `tqstore` with `argv` (default: sys.argv[1:]); returns the exit code. What the command
    loaded (its Engine and models) is appended to `keep` instead of being freed, when given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except (UsageError, SystemExit) as exc:  # SystemExit: --help, --version
        return _stopped(exc, "--json" in argv)
    interrupt = Interrupt()
    out = Output(json_mode=args.json, quiet=args.quiet, verbose=args.verbose, checkpoint=interrupt.check)
    try:
        with interrupt.installed(), Context(args, out, keep) as ctx, warnings.catch_warnings():
            _choose_blas(ctx, argv)
            _keep_compiled_kernels(ctx)
            warnings.showwarning = _as_note(out)
            return args.func(ctx, args)
    except UsageError as exc:  # a command that checks its arguments further (ask)
        return _stopped(exc, args.json)
    except KeyboardInterrupt:
        out.error("Interrupted", "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_ERROR
    except RemoteNotConfigured:
        out.error("RemoteNotConfigured", "no S3 bucket configured: run `tqstore config set s3.url s3://BUCKET/PREFIX` "
                  "(and `tqstore config set s3.endpoint URL` for MinIO, R2 and other non-AWS servers), or set "
                  "TQSTORE_S3_URL")
        return EXIT_ERROR
    except TqstoreError as exc:
        out.error(type(exc).__name__, str(exc) or type(exc).__name__)
        return EXIT_ERROR
    except OSError as exc:
        out.error(type(exc).__name__, describe_os_error(exc))
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - a bug: one line unless -v asks for the traceback
        if args.verbose:
            traceback.print_exc()
        out.error("InternalError", f"internal error: {type(exc).__name__}: {exc} (run with -v for the traceback, "
                  "and please report it)")
        return EXIT_ERROR


def _as_note(out: Output):
    """A `warnings.showwarning` that prints a warning as one note line (no file, line or code;
    silent with -q and --json, like every note)."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        out.note(f"note: {message}")

    return show


def _stopped(exc: UsageError | SystemExit, json_mode: bool) -> int:
    """The exit code of a refused command line (after saying why) or of --help and --version."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    if json_mode:
        Output(json_mode=True).error("UsageError", str(exc))
    else:
        exc.parser.print_usage(sys.stderr)
        print(f"tqstore: {exc} (see {exc.parser.prog} --help)", file=sys.stderr)
    return EXIT_USAGE


def _choose_blas(ctx: Context, argv: list[str]) -> None:
    """Restart this process on OpenBLAS when --blas, $TQSTORE_BLAS or the config's store.blas
    says so, before MLX runs. The default, `auto`, restarts only the commands that run matmuls on
    the CPU, where OpenBLAS is installed and MLX has no GPU; commands that run the model say once
    how to install it when it is missing."""
    from tqstore.models import blas

    command = getattr(ctx.args.func, "__name__", "")
    choice = ctx.args.blas or ctx.config.blas
    if choice == "auto" and command not in BLAS_COMMANDS:
        return  # no matmul runs: a restart would only pay every import twice
    library, hint = blas.resolve(choice)
    if hint is not None and command in MODEL_COMMANDS:
        ctx.out.note(f"note: {hint}")
    if library == "bundled":
        return
    # The same command again through `python -m tqstore_cli`, whatever started this process.
    blas.reexec_with(library, ["-m", "tqstore_cli", *argv])


def _keep_compiled_kernels(ctx: Context) -> None:
    """Point MLX's CUDA kernel cache (compiled cubin/PTX, read before NVRTC runs) into the home
    unless the user chose a folder: MLX's default, /tmp/mlx, is emptied on reboot and absent in a
    fresh container, and every fused decode kernel variant then compiles again in the first ask."""
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(ctx.home / "cache" / "mlx-ptx"))


def describe_os_error(exc: OSError) -> str:
    """One line for the OSErrors people meet: full disk, permissions, missing files."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full writing{where}: free some space (tqstore gc removes expired and unused data) or use --home"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied:{where}: check the file's permissions, or use another --home"
    if exc.errno == errno.ENOENT:
        return f"no such file or folder:{where}"
    if exc.errno == errno.EROFS:
        return f"read-only file system:{where}: use a writable --home"
    if exc.errno == errno.EISDIR:
        return f"{where.strip()} is a folder, not a file"
    return f"{exc.strerror or exc}{':' + where if where else ''}"


def _silence_stdout() -> None:
    # Python flushes stdout at exit and would report the broken pipe again: point it at devnull.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The console script and `python -m tqstore_cli`: main(), then `leave` with its code."""
    _hide_torch()
    from tqstore.models import lazy_mlx_lm

    lazy_mlx_lm.install()  # mlx-lm's __init__ (transformers) only if a command asks for it
    loaded: list[object] = []  # alive until leave's os._exit: nothing is freed for nothing
    leave(main(keep=loaded))


def _hide_torch() -> None:
    """Mark PyTorch absent in this process: tqstore runs on MLX and uses only transformers'
    tokenizers, but transformers imports PyTorch wherever it is installed, and with it sympy,
    triton, pandas and scikit-learn: 6.9 s of a fresh `ask`'s 11.2 s of imports on the H200.
    A None entry in sys.modules makes `importlib.util.find_spec` (transformers' probe) say
    absent and any `import torch` fail; something that imported it already keeps it."""
    sys.modules.setdefault("torch", None)


def leave(code: int) -> NoReturn:
    """End the process with `code` without the interpreter's native teardown.

    When main() returns the command is done: its Store is closed (LMDB committed, the writer
    thread joined) and its files are written. What remains is the teardown, where native thread
    pools are shut down: an `ask` over 64 documents on OpenBLAS printed its answer and then hung
    there for over 15 minutes (issue 27). Python's exit handlers still run and the streams are
    flushed; then os._exit skips the C-level destructors.
    """
    atexit._run_exitfuncs()  # what sys.exit would run: logging's flush, LMDB's close-all
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what was left to print is lost
            code = code or EXIT_ERROR
    os._exit(code)
