"""A kernel's texts handed to MLX as includes of files (kernels/included.py): the files hold the
texts exactly, the short body names the same shape and stride arguments, a changed kernel gets
other files (so another module name), and wherever the files cannot be written MLX gets the
texts themselves."""

import re

import pytest

from turboquant.attention.kernels import cubin_cache, host, included
from turboquant.attention.kernels.template import source

INCLUDE = re.compile(r'#include "([^"]+)"\n')


@pytest.fixture
def cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    return tmp_path


def _expanded(text: str) -> str:
    """`text` with each include of an absolute path replaced by the file's text."""
    return INCLUDE.sub(lambda m: open(m.group(1)).read(), text)


def _variants():
    return [host.pass2_variant(128, True, "bfloat16", "bfloat16", "bfloat16"),
            host.pass2_variant(64, False, "", "", "float16")]


def _mma_variant():
    from kernel_support.variants import _mma

    return _mma(("turbo", 4, 0, ""), 4, shifts=True)


@pytest.mark.parametrize("variant", [*_variants(), _mma_variant()], ids=lambda v: v.name)
def test_the_short_texts_include_files_that_hold_the_kernel(cache_folder, variant):
    header, body = source(variant, "cuda")
    names = variant.input_names()
    got = included.included(header, body, names)
    assert len(got.header) < 200 and len(got.body) < 400 < len(body)
    assert _expanded(got.header) == header
    assert _expanded(got.body).startswith(body)
    for n in names:
        for suffix in included.SUFFIXES:
            assert (n + suffix in got.body) == (n + suffix in body), n + suffix
    assert all(path.parent == cache_folder / "turboquant-src" for path, _ in got.files)


def test_a_changed_kernel_includes_other_files_and_so_names_another_module(cache_folder):
    header, body = source(_variants()[0], "cuda")
    names = _variants()[0].input_names()
    first = included.included(header, body, names)
    changed = included.included(header, body.replace("0.0f", "0.5f", 1), names)
    assert changed.body != first.body and changed.header == first.header
    as_mlx = [cubin_cache.mlx_source("k", i.header, i.body, [], [], ["out"], []) for i in (first, changed)]
    assert cubin_cache.module_name("k", as_mlx[0]) != cubin_cache.module_name("k", as_mlx[1])


def test_a_damaged_or_missing_file_is_written_again(cache_folder):
    header, body = source(_variants()[1], "cuda")
    names = _variants()[1].input_names()
    first = included.included(header, body, names)
    (body_file, _), (header_file, _) = first.files[1], first.files[0]
    body_file.write_text(body[:100])
    again = included.included(header, body, names)
    assert again == first and body_file.read_text() == body
    header_file.unlink()
    body_file.write_bytes(b"\xff" + body.encode()[1:])
    again.ensure()  # (what a kernel's first launch per dtype signature calls)
    assert header_file.read_text() == header and body_file.read_text() == body


def test_where_no_file_can_be_written_mlx_gets_the_texts(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(blocker / "ptx"))  # under a file: mkdir fails
    header, body = source(_variants()[0], "cuda")
    got = included.included(header, body, _variants()[0].input_names())
    assert (got.header, got.body, got.files) == (header, body, ())


def test_a_short_body_that_would_name_other_arguments_falls_back(cache_folder, monkeypatch):
    """MLX passes NAME_strides wherever the body's text holds it: a folder path that happens to
    hold one must not add an argument the kernel does not take."""
    odd = cache_folder / "q_strides"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(odd))
    body = "out[0] = q[0];"
    got = included.included("", body, ["q"])
    assert (got.header, got.body) == ("", body)
