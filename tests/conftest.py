import os

import mlx.core as mx
import pytest

from ledger import WORKER_KEY, Ledger, WorkerCounts

# Keep every test on one backend; the GPU kernels have their own marked tests.
mx.set_default_device(mx.cpu)
# One BLAS for every process a test starts (the CLI would otherwise restart itself on OpenBLAS,
# whose logits differ in the last bits): tests that want OpenBLAS ask for it with --blas.
os.environ["TQSTORE_BLAS"] = "bundled"


# The reliability suite's options live here: pytest reads options only from the conftests it
# loads at startup, so `pytest -m reliability_long --trials 200` works from the repository root.
def pytest_addoption(parser) -> None:
    group = parser.getgroup("reliability")
    group.addoption("--trials", type=int, default=None,
                    help="scale of the long reliability storms (default 200 or TQSTORE_TRIALS): crash SIGKILLs in "
                         "all; corruption random positions per class N/50; fuzz examples 10N per target; "
                         "concurrency seconds max(60, N); churn cycles max(500, N)")
    group.addoption("--reliability-report", metavar="FILE", default=None,
                    help="write every scenario's trial and outcome counts to FILE (JSON)")


def pytest_configure(config) -> None:
    config._reliability_ledger = Ledger()  # filled through tests/reliability's `ledger` fixture
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(WorkerCounts(config._reliability_ledger))


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the sum
        workeroutput[WORKER_KEY] = session.config._reliability_ledger.plain()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    config._reliability_ledger.report(terminalreporter, config.getoption("--reliability-report"))


def pytest_collection_modifyitems(config, items):
    has_gpu = _has_gpu()
    skip_gpu = pytest.mark.skip(reason="needs an MLX GPU backend (CUDA or Metal)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def pytest_ignore_collect(collection_path, config):
    """`pytest -m gpu` (the GPU machine, which has the GPU recipe's packages but not the test
    extra's moto, hypothesis, openai or anthropic) collects only the modules that mark gpu tests:
    importing the others would fail there on those packages, and none of them holds a gpu test."""
    if config.getoption("markexpr") != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return True if "mark.gpu" not in collection_path.read_text() else None


def _has_gpu() -> bool:
    if os.environ.get("TQSTORE_FORCE_CPU"):
        return False
    try:
        return mx.cuda.is_available() or mx.metal.is_available()
    except AttributeError:
        return False


# A real S3 server (moto) for the tier and store tests: `s3` fixture, one server per session (the
# module imports moto only inside the fixture, so this conftest loads without the test extra).
from s3_server import moto_server, s3  # noqa: E402, F401
