import subprocess
import sys

import pytest

from tqstore import blas
from tqstore.errors import ConfigError


def test_bundled_is_a_no_op(monkeypatch):
    monkeypatch.delenv(blas.MARKER, raising=False)
    blas.reexec_with("bundled")  # returns: nothing to change
    assert blas.active_blas() == "bundled"


def test_unknown_choice_is_refused():
    with pytest.raises(ConfigError, match="bundled, openblas"):
        blas.reexec_with("mkl")


def test_missing_library_says_how_to_install(monkeypatch):
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", ())
    with pytest.raises(ConfigError, match="apt-get install libopenblas0-pthread"):
        blas.openblas_environment()


def test_cpu_without_avx512_is_refused(monkeypatch, tmp_path):
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", (lib,))
    monkeypatch.setattr(blas, "_cpu_flags", lambda: {"sse2", "avx2"})
    monkeypatch.setattr(blas.platform, "machine", lambda: "x86_64")
    with pytest.raises(ConfigError, match="AVX-512"):
        blas.openblas_environment()


@pytest.mark.skipif(blas.openblas_library() is None or "avx512f" not in blas._cpu_flags(),
                    reason="needs Debian's OpenBLAS and an AVX-512 CPU")
def test_reexec_preloads_openblas_into_the_process():
    code = ("import sys; from tqstore import blas; blas.reexec_with('openblas'); "
            "print(blas.active_blas(), open('/proc/self/maps').read().count('libopenblas'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "openblas" and int(out[1]) > 0
