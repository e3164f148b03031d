"""Every kernel variant of a grid that reaches each branch of the source generators, and the
sha256 of the text each one builds (dialect sources, the CUDA translation unit, the emulator's
translation unit). `source_digests.json` beside this file holds the digests of the text as it
was when the kernel bodies still lived in Python strings; a refactoring of the generators must
reproduce it byte for byte.

Regenerate (only for an intended change of the kernel text), from the repository root:
    PYTHONPATH=.:tests python -m kernel_support.variants --write
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

from kernel_support import emulate
from turboquant.attention.kernels import cuda
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.mma import MmaPass1
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.template import Pass1, source

FIXTURE = Path(__file__).with_name("source_digests.json")
DTYPES = ("float16", "bfloat16", "float32")

NATIVE = [("native", 0, 0, dt) for dt in DTYPES]
AFFINE = [("affine", b, g, dt) for b in (4, 8) for g in (32, 64, 128) for dt in DTYPES]
TURBO = [("turbo", b, 0, "") for b in (1, 2, 3, 4)]
FEW_KEYS = NATIVE + [("affine", 4, 32, "float16"), ("affine", 8, 64, "bfloat16"), ("affine", 8, 128, "float32")] + TURBO
FEW_VALUES = [("affine", 4, 32, "float16"), ("affine", 8, 64, "float32")] + TURBO


def _pass1(key, value, **kw):
    return Pass1(d=kw.pop("d", 128), key=key[0], key_bits=key[1], key_group=key[2], key_dtype=key[3], value=value[0],
                 value_bits=value[1], value_group=value[2], value_dtype=value[3], **kw)


def _mma(key, vbits, **kw):
    return MmaPass1(d=kw.pop("d", 128), key=key[0], key_bits=key[1], key_group=key[2], key_dtype=key[3],
                    value="turbo", value_bits=vbits, value_group=0, value_dtype="", rmax=kw.pop("rmax", 8), **kw)


def _grid():
    """Callables building each variant (a ValueError marks a combination the code rejects)."""
    for d, q, post, qs in itertools.product((8, 64, 96, 128, 256), DTYPES, (False, True), (False, True)):
        yield lambda d=d, q=q, post=post, qs=qs: Pass0(d=d, q_dtype=q, post=post, qs=qs)
    tails = (("", ""), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float16"), ("float16", "float32"))
    for d, rot, (tail, q), out, sinks in itertools.product((8, 64, 96, 128, 256), (False, True), tails,
                                                           ("", "float16", "bfloat16"), (False, True)):
        yield lambda d=d, rot=rot, tail=tail, q=q, out=out, sinks=sinks: Pass2(
            d=d, rotate=rot, tail_dtype=tail, q_dtype=q, out_dtype=out, sinks=sinks)
    for key, value in itertools.product(NATIVE + AFFINE + TURBO, AFFINE + TURBO):
        yield lambda key=key, value=value: _pass1(key, value, rmax=4, shifts=key[0] != "native")
    for key, value, d, rmax in itertools.product(FEW_KEYS, FEW_VALUES, (8, 24, 64, 96, 256), (1, 8)):
        yield lambda key=key, value=value, d=d, rmax=rmax: _pass1(key, value, d=d, rmax=rmax,
                                                                  shifts=key[0] != "native")
    for key, value, q, shifts, d in itertools.product(FEW_KEYS, FEW_VALUES, DTYPES, (False, True), (64, 96)):
        yield lambda key=key, value=value, q=q, shifts=shifts, d=d: _pass1(key, value, d=d, rmax=2, shifts=shifts,
                                                                           q_dtype=q)
    for key, value, ns, unroll, rmax in itertools.product(
            (TURBO[2], AFFINE[-1], NATIVE[0]), (TURBO[1], AFFINE[0]), (0, 1, 2, 4), (0, 1, 2, 3, 4), (1, 4)):
        yield lambda key=key, value=value, ns=ns, unroll=unroll, rmax=rmax: _pass1(key, value, rmax=rmax, ns=ns,
                                                                                   unroll=unroll, shifts=False)
    for key, vbits, shifts in itertools.product(AFFINE + TURBO, (1, 2, 3, 4), (False, True)):
        yield lambda key=key, vbits=vbits, shifts=shifts: _mma(key, vbits, shifts=shifts)
    mma_keys = (TURBO[0], TURBO[2], TURBO[3], ("affine", 4, 32, "float16"), ("affine", 8, 64, "float16"),
                ("affine", 8, 128, "bfloat16"), ("affine", 8, 32, "float32"))
    for key, vbits, d, prefetch in itertools.product(mma_keys, (1, 3, 4), (16, 48, 64, 96, 256), (0, 1, 2)):
        yield lambda key=key, vbits=vbits, d=d, prefetch=prefetch: _mma(key, vbits, d=d, prefetch=prefetch,
                                                                        shifts=True)
    for key, vbits, spread, q, shifts, d in itertools.product(
            (TURBO[1], TURBO[3], ("affine", 8, 64, "float16")), (2, 4), (False, True), ("", "float16", "bfloat16"),
            (False, True), (64, 128)):
        yield lambda key=key, vbits=vbits, spread=spread, q=q, shifts=shifts, d=d: _mma(
            key, vbits, d=d, spread=spread, q_dtype=q, shifts=shifts)


def _wide_and_half_norms():
    """5-bit TurboQuant keys and float16/bfloat16 row norms (turbo5vN, autoB; added after the
    fixture's first recording: the rows above keep their digests)."""
    for kbits, vbits, knorm, vnorm, rmax, q, shifts, d in itertools.product(
            (3, 5), (2, 4), ("", "float16"), ("float16", "bfloat16"), (1, 8), ("", "float16"), (False, True),
            (64, 96, 128)):
        yield lambda kbits=kbits, vbits=vbits, knorm=knorm, vnorm=vnorm, rmax=rmax, q=q, shifts=shifts, d=d: _pass1(
            ("turbo", kbits, 0, ""), ("turbo", vbits, 0, ""), d=d, rmax=rmax, shifts=shifts, q_dtype=q,
            key_norm=knorm, value_norm=vnorm)
    for key, vnorm, d in itertools.product((("affine", 8, 64, "float16"), ("affine", 8, 32, "bfloat16")),
                                           ("float16", ""), (64, 128)):
        yield lambda key=key, vnorm=vnorm, d=d: _pass1(key, ("turbo", 4, 0, ""), d=d, rmax=4, shifts=True,
                                                       value_norm=vnorm)
    for kbits, vbits, norm, prefetch, q, d in itertools.product((3, 5), (2, 3, 4), ("", "float16"), (0, 1),
                                                                 ("", "float16", "bfloat16"), (64, 96, 128, 256)):
        yield lambda kbits=kbits, vbits=vbits, norm=norm, prefetch=prefetch, q=q, d=d: _mma(
            ("turbo", kbits, 0, ""), vbits, d=d, prefetch=prefetch, q_dtype=q, shifts=True, key_norm=norm,
            value_norm=norm)
    for key, norm in itertools.product((("affine", 8, 64, "float16"), ("affine", 8, 128, "bfloat16")),
                                       ("float16", "bfloat16")):
        yield lambda key=key, norm=norm: _mma(key, 4, shifts=True, q_dtype="float16", value_norm=norm)
    # two row tiles per threadgroup (a question's rows)
    for key, vbits, d, q, shifts in itertools.product(
            (("turbo", 4, 0, ""), ("turbo", 5, 0, ""), ("turbo", 3, 0, ""), ("affine", 8, 64, "float16"),
             ("affine", 8, 128, "bfloat16")), (3, 4), (64, 96, 128), ("", "float16", "bfloat16"), (False, True)):
        yield lambda key=key, vbits=vbits, d=d, q=q, shifts=shifts: _mma(
            key, vbits, d=d, q_dtype=q, shifts=shifts, rmax=16, **({"key_norm": "float16", "value_norm": "float16"}
                                                                   if key[1] == 5 else {}))


def texts(variant) -> list[str]:
    """Every source text the code builds for `variant`."""
    dialects = ("cuda",) if isinstance(variant, MmaPass1) else ("cuda", "metal")
    out = []
    for dialect in dialects:
        out += source(variant, dialect)
    return out + [cuda.translation_unit(variant), emulate.translation_unit(variant)]


def digests() -> dict[str, str]:
    """{variant name: sha256 of its texts}; a name built twice must build the same text (MLX
    caches compiled kernels by name)."""
    result: dict[str, str] = {}
    for build in itertools.chain(_grid(), _wide_and_half_norms()):
        try:
            variant = build()
        except ValueError:
            continue
        h = hashlib.sha256()
        for text in texts(variant):
            h.update(text.encode())
            h.update(b"\0")
        digest = h.hexdigest()
        if result.setdefault(variant.name, digest) != digest:
            raise AssertionError(f"two variants named {variant.name} build different text")
    return dict(sorted(result.items()))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    FIXTURE.write_text(json.dumps(digests(), indent=0) + "\n")
