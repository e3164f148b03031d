"""`pytest -m gpu` on the GPU machine, which installs the GPU recipe's packages but not the test
extra (issue 32): the shared conftest must load and the gpu tests must be collected without
moto, hypothesis, openai or anthropic (blocked here in a subprocess, as if not installed)."""

import os
import subprocess
import sys
from pathlib import Path

TEST_ONLY = ("moto", "hypothesis", "openai", "anthropic")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_tests_are_collected_without_the_test_only_packages():
    code = ("import sys\n"
            f"for name in {TEST_ONLY!r}:\n"
            "    sys.modules[name] = None  # `import name` raises ImportError, as when not installed\n"
            "import pytest\n"
            "sys.exit(pytest.main(['-m', 'gpu', '--collect-only', '-q', '-p', 'no:cacheprovider']))\n")
    # no plugins from entry points: those of the blocked packages (hypothesis has one) are not there either
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out  # 0 only when nothing failed to import
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/test_kernels_gpu.py::") for line in collected), out
    assert any(line.startswith("tests/test_sinks.py::test_gpt_oss_sinks_through_the_gpu_kernels") for line in collected), out
