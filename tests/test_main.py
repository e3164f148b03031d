import subprocess
import sys


def test_python_m_turboquant_prints_tables():
    out = subprocess.run([sys.executable, "-m", "turboquant"], capture_output=True, text=True, check=True).stdout
    assert "0.07066157" in out and "0.23766383" in out  # d=128 codebooks
    assert "| turbo8v3 | affine 8 | turbo 3 | no | 96 | 2.67 | 188 | 2.72 |" in out
    assert "Round trip" in out
