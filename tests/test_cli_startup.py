"""What a `tqstore` process loads before its work: commands that run no model import no model
stack, and the default BLAS choice restarts a process only where a CPU matmul will run (issue 28:
a fresh `ls` took 3.9 s for 0.7 s of work, a fresh `ask` on the H200 41 s for 17-20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tqstore.models import blas

# What `ask` needs and `ls` does not: the model stack, the codec's scipy, the server, the progress bars,
# the S3 client (no bucket is configured here) and the package metadata (only --version reads it).
HEAVY = ("transformers", "mlx_lm", "torch", "scipy", "starlette", "uvicorn", "pydantic", "prometheus_client", "rich",
         "boto3", "botocore", "urllib3", "importlib.metadata")
PROBE = """
import json, os, sys
from tqstore_cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(m for m in %r if m in sys.modules),
                  "blas": os.environ.get("TQSTORE_BLAS_ACTIVE", "bundled")}))
""" % (HEAVY,)


def probe(tmp_path: Path, *argv: str) -> dict:
    """Run `tqstore *argv` through main() in a fresh interpreter under the default BLAS choice
    (auto); a restart would replace the probe and print nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_") and k != "LD_PRELOAD"}
    run = subprocess.run([sys.executable, "-c", PROBE, "--home", str(tmp_path / "home"), *argv],
                         capture_output=True, text=True, env=env, timeout=60)
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"no report (restarted?): {run.stdout!r} {run.stderr!r}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("argv", [("--version",), ("ls",), ("info", "nothing"), ("config", "show")])
def test_commands_without_a_model_load_no_model_stack_and_never_restart(tmp_path, argv):
    """Before: every command imported mlx-lm and transformers (the parser's `ask --doc` help
    imported the engine), and `auto` restarted even `ls` on OpenBLAS, paying the imports twice.
    Then: opening the store imported boto3 (0.1-0.25 s) without a bucket, and building the parser
    read the package metadata for --version's text."""
    report = probe(tmp_path, *argv)
    expected = ["importlib.metadata"] if argv == ("--version",) else []
    assert report["modules"] == expected and report["blas"] == "bundled", report


def test_auto_keeps_the_bundled_blas_when_mlx_runs_on_a_gpu(monkeypatch, tmp_path):
    """Before: a machine with a GPU and OpenBLAS installed restarted every command on OpenBLAS,
    whose matmuls never run there."""
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (Path(sys.executable),))
    monkeypatch.setattr(blas, "gpu_default", lambda: False)
    assert blas.resolve("auto") == ("openblas", None)
    monkeypatch.setattr(blas, "gpu_default", lambda: True)
    assert blas.resolve("auto") == ("bundled", None)
    assert blas.resolve("openblas") == ("openblas", None)  # a pinned choice stays the user's



def test_the_console_script_never_imports_torch(tmp_path):
    """Before: transformers imported PyTorch wherever it was installed (6.8 s of a fresh `ask`'s
    11 s of imports on the H200, with sympy, triton, pandas). A stand-in `torch` on the path
    leaves a mark when anything imports it."""
    from model_folder import write_model_folder

    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    marker = tmp_path / "torch-imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n__version__ = '2.9.0'\n")
    model = write_model_folder(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_") and k != "LD_PRELOAD"}
    env.update(PYTHONPATH=str(tmp_path / "site"), TQSTORE_BLAS="bundled")
    script = Path(sys.executable).with_name("tqstore")
    run = subprocess.run([str(script), "--home", str(tmp_path / "home"), "save", "doc", "--model", str(model),
                          "--prompt", "The seller pays for delays.", "-q"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert not marker.exists(), "torch was imported"
    assert run.returncode == 0, run.stderr


def test_the_console_script_keeps_what_a_command_loaded_until_exit(tmp_path, monkeypatch, capsys):
    """Before: the command's Engine was dropped when it ended, and freeing the model's arrays cost
    0.3-1.4 s of a fresh `ask` with a 0.5B model here, just before os._exit. `main(keep=...)`
    (what the console script passes) hands the Engine over instead; without `keep` (in-process
    callers) nothing is kept."""
    from model_folder import write_model_folder
    from tqstore_cli.main import main

    monkeypatch.setenv("TQSTORE_BLAS", "bundled")
    model = str(write_model_folder(tmp_path / "model"))
    home = str(tmp_path / "home")
    assert main(["--home", home, "save", "doc", "--model", model, "--prompt", "The seller pays.", "-q"]) == 0
    kept: list[object] = []
    assert main(["--home", home, "ask", "doc", "Who pays?", "--max-tokens", "2", "-q"], keep=kept) == 0
    assert len(kept) == 1 and [loaded.ref for loaded in kept[0].models._models.values()] == [model]
    assert main(["--home", home, "ls", "-q"], keep=kept) == 0 and len(kept) == 1  # ls opens no Engine
    capsys.readouterr()
