"""The installed `tqstore` console script as real processes: exit codes, stdout/stderr, SIGINT,
and the OpenBLAS re-exec."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_folder import write_model_folder

# The conftest pins this process's BLAS; these children must not pick another themselves.
PINNED_BLAS = {"TQSTORE_BLAS": os.environ["TQSTORE_BLAS"]}
DOC = "The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties."


def _script() -> list[str]:
    """The console script next to this interpreter, else the same through `python -m`."""
    script = Path(sys.executable).with_name("tqstore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tqstore_cli"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A home with entry `doc` saved through the console script."""
    root = tmp_path_factory.mktemp("process")
    model = write_model_folder(root / "tiny-qwen2", num_hidden_layers=2)  # the process is checked, not the model
    home = root / "home"
    run = tq(home, "save", "doc", "--model", str(model), "--prompt", DOC, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tokens"] > 10 and run.stderr == ""
    return home


def tq(home: Path, *argv: str, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_")} | PINNED_BLAS
    return subprocess.run([*_script(), "--home", str(home), *argv], capture_output=True, text=True, env=env,
                          timeout=120, **kw)


def test_help_and_version():
    run = subprocess.run([*_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "usage: tqstore" in run.stdout and "selftest" in run.stdout
    run = subprocess.run([*_script(), "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("tqstore ")


def test_ask_json_from_the_console_script(home):
    run = tq(home, "ask", "doc", "Who pays?", "--max-tokens", "3", "--json")
    answer = json.loads(run.stdout)
    assert run.returncode == 0 and run.stderr == ""
    assert answer["cached_tokens"] > 10 and answer["tier"] == "lmdb" and answer["generation_tokens"] == 3


def test_errors_exit_1_with_one_line_on_stderr(home):
    run = tq(home, "info", "nope")
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("tqstore: no entry nope") and run.stderr.count("\n") == 1
    usage = tq(home, "info")
    assert usage.returncode == 2 and "usage: tqstore info" in usage.stderr and "Traceback" not in usage.stderr


def test_sigint_during_ask_exits_130_without_a_traceback(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_")} | PINNED_BLAS
    # As from a terminal: SIGINT at its default even when this suite runs as a background job
    # (which starts with SIGINT ignored, and an ignored signal stays ignored across exec).
    proc = subprocess.Popen([*_script(), "--home", str(home), "ask", "doc", "Who pays?", "--max-tokens", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1)  # the answer is streaming: the model is decoding now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"Traceback" not in err and err.decode().strip().splitlines()[-1] == "tqstore: interrupted"


def test_output_into_a_closed_pipe_is_quiet(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_")} | PINNED_BLAS
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command prints anything (as `| head` that exited)
    try:
        run = subprocess.run([*_script(), "--home", str(home), "ls"], stdout=write, stderr=subprocess.PIPE,
                             text=True, env=env, timeout=60)
    finally:
        os.close(write)
    assert run.returncode == 1 and run.stderr == ""


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is for MLX's Linux CPU backend")
def test_blas_openblas_reexecs_the_command(home):
    from tqstore.models import blas
    from tqstore.errors import ConfigError

    try:
        blas.openblas_environment()
    except ConfigError as exc:
        run = tq(home, "--blas", "openblas", "ls")
        assert run.returncode == 1 and run.stderr.strip() == f"tqstore: {exc}"
        return
    start = time.perf_counter()
    run = tq(home, "--blas", "openblas", "selftest", "--json")
    checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    assert run.returncode == 0 and checks["blas"]["active"] == "openblas", run.stderr
    assert time.perf_counter() - start < 60


def test_python_warnings_are_one_note_line(tmp_path):
    """Before: the sliding-window notice came out raw ("engine.py:135: UserWarning: ..." and the
    source line after it)."""
    model = write_model_folder(tmp_path / "tiny-gemma3", kind="gemma3_text")
    run = tq(tmp_path / "home", "save", "g", "--model", str(model), "--prompt", DOC)
    assert run.returncode == 0, run.stderr
    assert "note: layer kind RotatingKVCache (sliding window, overwritten in place) of family gemma3_text " \
        "is stored uncompressed under turbo5v4" in run.stderr
    assert "Warning" not in run.stderr and ".py:" not in run.stderr, run.stderr


def test_transformers_advice_about_pytorch_is_not_printed():
    """Before: importing transformers (mlx-lm's tokenizers) without torch printed "PyTorch was not
    found. Models won't be available ..." to the user."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    run = subprocess.run([sys.executable, "-c", "import tqstore_cli.main, transformers"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0 and "PyTorch was not found" not in run.stderr, run.stderr
