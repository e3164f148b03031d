"""`turboquant.environment.setting`: what `os.environ.get` returns, at every change."""

from __future__ import annotations

import os

import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels.host import KernelTuning
from turboquant.cache.mirror import MIRROR_ENV, MIRROR_TOKENS
from turboquant.environment import setting

NAME = "TQSTORE_TEST_ENVIRONMENT_SETTING"


@pytest.mark.parametrize("value", ["1", "", "0", "a value with spaces", "caf\u00e9", "\udcff"])
def test_a_setting_follows_every_change_of_os_environ(monkeypatch, value):
    monkeypatch.delenv(NAME, raising=False)
    assert setting(NAME) is None and setting(NAME, "d") == "d"
    monkeypatch.setenv(NAME, value)
    assert setting(NAME) == os.environ.get(NAME) == value
    os.environ[NAME] = value + "x"
    assert setting(NAME, "d") == value + "x"
    del os.environ[NAME]
    assert setting(NAME) is None
    os.environ.update({NAME: "again"})
    assert setting(NAME) == "again"
    os.environ.pop(NAME)
    assert setting(NAME, "d") == "d"


def test_the_attention_switches_are_read_at_each_call(monkeypatch):
    """The switches the attention path reads per call see a change made between two calls."""
    for name in (MIRROR_ENV, "TQSTORE_KERNELS", "TQSTORE_KERNEL_MMA"):
        monkeypatch.delenv(name, raising=False)
    assert KernelTuning.from_env().mma
    monkeypatch.setenv("TQSTORE_KERNEL_MMA", "0")
    assert not KernelTuning.from_env().mma
    monkeypatch.setenv("TQSTORE_KERNELS", "0")
    assert kernels.select_backend() is None
    monkeypatch.setattr(kernels, "select_backend", lambda: "cuda")
    from turboquant.cache import mirror

    assert mirror.mirror_tokens() == MIRROR_TOKENS
    monkeypatch.setenv(MIRROR_ENV, "7")
    assert mirror.mirror_tokens() == 7
