import os

import mlx.core as mx
import pytest

from ledger import WORKER_KEY, Ledger, WorkerCounts
from tqstore.errors import ConfigError
from tqstore.models.blas import active_blas, openblas_environment

# Keep every test on one backend; the GPU kernels have their own marked tests.
mx.set_default_device(mx.cpu)
# One BLAS for every process a test starts: the one this process runs on (the two libraries' logits
# differ in the last bits, and a CLI child would otherwise pick its own). Tests that want
# another ask for it with --blas.
os.environ["TQSTORE_BLAS"] = active_blas()
# Set to "bundled" to keep xdist's workers on MLX's bundled BLAS (see `pytest_configure`).
TEST_BLAS_ENV = "TQSTORE_TEST_BLAS"


# The reliability suite's options live here: pytest reads options only from the conftests it
# loads at startup, so `pytest -m reliability_long --trials 200` works from the repository root.
def pytest_addoption(parser) -> None:
    group = parser.getgroup("reliability")
    group.addoption("--trials", type=int, default=None,
                    help="scale of the long reliability storms (default 200 or TQSTORE_TRIALS): crash SIGKILLs in "
                         "all; corruption random positions per class N/50; fuzz examples 10N per target; "
                         "concurrency seconds max(60, N); churn cycles max(500, N)")
    parser.addoption("--exact-blas", action="store_true",
                     help="run only the tests marked exact_blas, on the bundled BLAS, where the run without "
                          "this flag left them out (its workers ran on OpenBLAS); else none")
    group.addoption("--reliability-report", metavar="FILE", default=None,
                    help="write every scenario's trial and outcome counts to FILE (JSON)")


def pytest_configure(config) -> None:
    config._reliability_ledger = Ledger()  # filled through tests/reliability's `ledger` fixture
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(WorkerCounts(config._reliability_ledger))
    _workers_on_openblas(config)


def _workers_on_openblas(config) -> None:
    """xdist's controller, before it starts the workers: they start on OpenBLAS where it is
    installed (`apt-get install libopenblas0-pthread`), one thread each. The tiny models' forwards
    run 10-15x faster there than on the bundled BLAS, which took most of the suite's time; every
    process a worker starts inherits the same library. A single process (`-n 0`) keeps the BLAS
    it was started with."""
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    env = _openblas_for_workers()
    if env is not None and not config.getoption("--exact-blas"):
        os.environ.update(env)


def _openblas_for_workers() -> dict[str, str] | None:
    """The environment that starts xdist's workers on OpenBLAS, or None where they stay on the
    bundled BLAS: OpenBLAS not installed, or `TQSTORE_TEST_BLAS=bundled`."""
    if os.environ.get(TEST_BLAS_ENV, "openblas") != "openblas":
        return None
    try:
        return {**openblas_environment(), "OPENBLAS_NUM_THREADS": "1"}
    except ConfigError:
        return None


def pytest_sessionfinish(session, exitstatus) -> None:
    if session.config.getoption("--exact-blas") and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK  # nothing was left out for it to run
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
    _split_exact_blas(config, items)


def _split_exact_blas(config, items) -> None:
    """The tests marked exact_blas run where rows do not depend on the batch: OpenBLAS's change
    in the last bits with the batch size (a row decoded alone or in a batch of 8, a prefix
    prefilled in other chunks), MLX's bundled BLAS computes each row alike. So a process on
    OpenBLAS leaves them out, and `--exact-blas` (the README's second pytest command, whose
    workers stay on the bundled BLAS) runs only them, or none where the first command's workers
    were not on OpenBLAS and so ran them already."""
    if config.getoption("--exact-blas"):
        left_out_before = _openblas_for_workers() is not None
        kept = [item for item in items if left_out_before and item.get_closest_marker("exact_blas") is not None]
    elif active_blas() == "openblas":
        kept = [item for item in items if item.get_closest_marker("exact_blas") is None]
    else:
        return
    if len(kept) < len(items):
        left = set(kept)
        config.hook.pytest_deselected(items=[item for item in items if item not in left])
        items[:] = kept


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


@pytest.fixture
def on_gpu():
    """The GPU as MLX's default device for one test (this file makes it the CPU for the rest)."""
    before = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(before)
