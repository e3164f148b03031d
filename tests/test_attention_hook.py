"""The attention hook (turboquant/adapter/dispatch.py): installed per request by the server, it
scans sys.modules only after a module was imported, and still reaches a model module imported
since the last scan."""

import sys
import types

from turboquant import AttentionHook


def original(*a, **k):
    return "original"


def replacement(*a, **k):
    return "replacement"


class CountingModule(types.ModuleType):
    """A model module that counts reads of its attention attribute (a scan reads it)."""

    reads = 0

    @property
    def scaled_dot_product_attention(self):
        type(self).reads += 1
        return self.__dict__.get("_sdpa", original)

    @scaled_dot_product_attention.setter
    def scaled_dot_product_attention(self, fn):
        self.__dict__["_sdpa"] = fn


def test_a_second_install_scans_nothing_and_a_new_module_gets_the_hook(monkeypatch):
    hook = AttentionHook(original, replacement)
    first = CountingModule("mlx_lm.models.hook_probe_a")
    monkeypatch.setitem(sys.modules, first.__name__, first)
    hook.install()
    assert first.scaled_dot_product_attention is replacement
    reads = CountingModule.reads
    for _ in range(3):
        hook.install()
    assert CountingModule.reads == reads  # no module imported since: no scan
    later = types.ModuleType("mlx_lm.models.hook_probe_b")
    later.scaled_dot_product_attention = original
    monkeypatch.setitem(sys.modules, later.__name__, later)
    hook.install()
    assert later.scaled_dot_product_attention is replacement
    other = types.ModuleType("not_a_model.hook_probe_c")
    other.scaled_dot_product_attention = original
    monkeypatch.setitem(sys.modules, other.__name__, other)
    hook.install()
    assert other.scaled_dot_product_attention is original  # only mlx_lm.models modules
