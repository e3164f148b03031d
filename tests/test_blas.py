import os
import subprocess
import sys

import pytest

from tqstore.models import blas
from tqstore.errors import ConfigError


def test_bundled_is_a_no_op(monkeypatch):
    monkeypatch.delenv(blas.MARKER, raising=False)
    blas.reexec_with("bundled")  # returns: nothing to change
    assert blas.active_blas() == "bundled"


def test_unknown_choice_is_refused():
    with pytest.raises(ConfigError, match="auto, bundled, openblas"):
        blas.reexec_with("mkl")


def test_missing_library_says_how_to_install(monkeypatch):
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", ())
    with pytest.raises(ConfigError, match="apt-get install libopenblas0-pthread"):
        blas.openblas_environment()


@pytest.mark.parametrize("flags, kind", [
    ({"sse2", "avx2", "fma"}, "HASWELL"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}, "SKYLAKEX"),
    ({"sse2", "avx"}, None),
])
def test_core_type_follows_the_instruction_sets(monkeypatch, tmp_path, flags, kind):
    """Before: a CPU without AVX-512 was refused, though OpenBLAS's Haswell kernels run there
    at 20x the bundled BLAS."""
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (lib,))
    monkeypatch.setattr(blas, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(blas.platform, "machine", lambda: "x86_64")
    env = blas.openblas_environment()
    assert env["LD_PRELOAD"] == str(lib) and env.get("OPENBLAS_CORETYPE") == kind


def test_auto_picks_openblas_where_installed_and_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", ())
    assert blas.resolve("auto") == ("bundled", blas.INSTALL_HINT)
    assert "apt-get install libopenblas0-pthread" in blas.INSTALL_HINT
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (lib,))
    assert blas.resolve("auto") == ("openblas", None)
    assert blas.resolve("bundled") == ("bundled", None)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.resolve("auto") == ("bundled", None)


def test_the_tests_run_on_one_pinned_blas():
    """The children a test starts run on this process's BLAS (tests/conftest.py)."""
    assert os.environ["TQSTORE_BLAS"] == blas.active_blas()
    on_openblas = "libopenblas" in os.environ.get("LD_PRELOAD", "")
    assert blas.active_blas() == ("openblas" if on_openblas else "bundled")


@pytest.mark.skipif(blas.openblas_library() is None, reason="needs Debian's OpenBLAS")
def test_reexec_preloads_openblas_into_the_process():
    code = ("import sys; from tqstore.models import blas; blas.reexec_with('openblas'); "
            "print(blas.active_blas(), open('/proc/self/maps').read().count('libopenblas'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "openblas" and int(out[1]) > 0
