"""The reliability suite (issue 9): fault injection against real LMDB, a real S3 server,
real subprocesses and SIGKILL.

Markers: `reliability` marks the short versions, which run in the default CI run;
`reliability_long` marks the long storms, which pyproject's addopts deselects:

    pytest tests/reliability                                        # the short versions
    pytest tests/reliability -m reliability_long --trials 200       # the long storms

(`--trials` is defined here, so pass the folder, or set TQSTORE_TRIALS, when running from the
repository root.) Every scenario counts its trials and outcomes in the `ledger` fixture; the
counts are printed after the run and written as JSON with `--reliability-report FILE`, the
figures docs/reliability.md quotes (tests/ledger.py, through the root conftest).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ledger import Ledger

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: the fault-injection suite, short version (runs by default)")
    config.addinivalue_line("markers", "reliability_long: the long fault storms (on demand: -m reliability_long)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here that is not a long storm belongs to the short version."""
    for item in items:
        if item.path.is_relative_to(HERE) and "reliability_long" not in item.keywords:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture(scope="session")
def ledger(request: pytest.FixtureRequest) -> Ledger:
    """Trial and outcome counts per scenario, printed and reported at the end of the session."""
    return request.config._reliability_ledger


@pytest.fixture(scope="session")
def trials(request: pytest.FixtureRequest) -> int | None:
    """--trials (or TQSTORE_TRIALS), None when not given: each long storm then uses its default."""
    given = request.config.getoption("--trials")
    if given is None and os.environ.get("TQSTORE_TRIALS"):
        given = int(os.environ["TQSTORE_TRIALS"])
    return given
