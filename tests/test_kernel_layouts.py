"""The fused kernels read the layouts of the newer schemes: 5-bit TurboQuant keys and float16
row norms (turbo5vN), and every per-layer key layout an autoB allocation can leave a layer
with (3-, 4- and 5-bit TurboQuant keys, 8-bit affine keys, the guard's protected layout), all
with float16 norms on their TurboQuant sides. Before, such layers attended through plain MLX
ops on every GPU.

The kernels run on the CPU through the emulator against the float64 attention over the rows as
stored (the norms at their stored float16 width): the CUDA-core pass 1 at 1e-5 of the largest
output (float32 arithmetic throughout), the tensor-core pass 1 at 2e-3 (fp16 products, each
factor rounded at most 2^-11, float32 sums), as for turbo4."""

import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention.kernels import KernelTuning, host
from turboquant.attention.kernels.mma import MmaPass1
from kernel_support.synthetic import PROTECTED, build_cache, stored
from turboquant.attention.kernels.template import Pass1
from turboquant.codec.plan import plan_layer
from turboquant.codec.schemes import parse_scheme

from kernel_support import emulate, on_demand
from kernel_support.reference import reference

NEW_SCHEMES = ("turbo5v4", "turbo5v3", "turbo5v2", "auto3.5", "auto3.75", "auto6")
ANY_LENGTH = KernelTuning(mma_min_tokens=0)


def layouts():
    """(scheme, key option) for every layer layout the new schemes produce."""
    out = []
    for scheme in NEW_SCHEMES:
        plan = plan_layer(parse_scheme(scheme), 2, 64, 64, mx.float16)
        out += [(scheme, keys) for keys in (*plan.key_options(), PROTECTED)]
    return out


@pytest.mark.parametrize("scheme,keys", layouts())
def test_every_layer_layout_of_the_new_schemes_has_a_kernel(scheme, keys):
    cache = build_cache(scheme, 2, 64, mx.float16, 100, keys=keys)
    q = mx.zeros((1, 4, 1, 64), dtype=mx.float16)
    args = (q, cache._key_side, cache._value_side, stored(cache), cache._shifts)
    simt = host.describe(*args, tuning=ANY_LENGTH)
    mma = host.describe(*args, tensor_cores=True, tuning=ANY_LENGTH)
    assert type(simt.pass1) is Pass1 and mma is not None
    for p1 in (simt.pass1, mma.pass1):
        # the norms' width is part of the source and the name (MLX caches modules by name)
        assert (p1.value_norm == "float16") == ("_vnf16" in p1.name) == (p1.value == "turbo")
        assert (p1.key_norm == "float16") == ("_knf16" in p1.name) == (p1.key == "turbo")
    assert simt.pass1.key_bits == cache._key_side.codec.bits
    # every layout but the protected affine8 K and V of the auto schemes runs on the tensor cores
    assert isinstance(mma.pass1, MmaPass1) == (simt.pass1.value == "turbo")


def test_norm_widths_are_checked():
    base = dict(d=64, key="turbo", key_bits=5, key_group=0, key_dtype="", value="turbo", value_bits=4,
                value_group=0, value_dtype="", rmax=4, shifts=True)
    Pass1(**base, key_norm="float16", value_norm="bfloat16")
    for bad in ({"key_norm": "float32"}, {"value_norm": "int8"},
                {"key": "affine", "key_bits": 8, "key_group": 64, "key_dtype": "float16", "key_norm": "float16"}):
        with pytest.raises(ValueError):
            Pass1(**{**base, **bad})


# (scheme, key option, H, R, D, T, dtype, tensor cores): each new side width and norm width, both
# pass 1 kinds, one and several row groups, head dims 64-256, unaligned token counts
EMULATED = [
    ("turbo5v4", "base", 2, 4, 64, 70, mx.float16, False),
    ("turbo5v4", "base", 2, 4, 128, 100, mx.float16, True),
    ("auto3.5", "base", 1, 2, 96, 65, mx.float32, False),
    ("auto3.75", "keys5", 2, 9, 64, 130, mx.bfloat16, True),
    ("auto6", "keys8", 1, 4, 128, 65, mx.float16, True),
    ("turbo5v4", PROTECTED, 2, 1, 64, 40, mx.bfloat16, False),
    ("turbo5v2", "base", 1, 3, 256, 33, mx.float32, False),
    ("auto3.5", "keys4", 1, 7, 128, 300, mx.bfloat16, False),
]


@pytest.mark.skipif(not emulate.available(), reason="needs a C++20 compiler for the emulator")
@pytest.mark.parametrize("case", on_demand(EMULATED, {0, 1}),
                         ids=lambda c: f"{c[0]}-{c[1]}-H{c[2]}R{c[3]}d{c[4]}T{c[5]}-{'mma' if c[7] else 'simt'}")
def test_emulated_kernels_over_the_new_layouts_match_f64(case):
    scheme, keys, H, R, D, T, dtype, tensor_cores = case
    cache = build_cache(scheme, H, D, dtype, T, seed=T + D, keys=keys)
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(D + R)).astype(dtype)
    call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts,
                         tensor_cores=tensor_cores, tuning=ANY_LENGTH)
    assert isinstance(call.pass1, MmaPass1) == tensor_cores
    args = (call, q, cache._key_side, cache._value_side, stored(cache), 1 / math.sqrt(D), cache._shifts)
    out, lse, po, pm, pl = host.launch(emulate.kernel, *args, init_value=float("nan"), partials=True,
                                       tuning=ANY_LENGTH)
    assert not any(mx.any(mx.isnan(a)).item() for a in (po, pm, pl))  # every output written
    ref_out, ref_lse = reference(cache, q, 1 / math.sqrt(D), with_tail=False)
    rtol = 2e-3 if tensor_cores else 1e-5
    out = np.array(out).astype(np.float64)
    assert np.abs(out - ref_out).max() <= rtol * np.abs(ref_out).max()
    assert np.abs(np.array(lse) - ref_lse).max() <= rtol * max(1.0, np.abs(ref_lse).max())
