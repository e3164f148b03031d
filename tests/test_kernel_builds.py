"""What the fused decode builds (issue 28): no kernel module depends on the context length, and
the compiled modules go to MLX's cache folder under names MLX 0.32.4 looks for.

Builds are counted by routing `fused_decode` to the CUDA backend with a factory that records
every variant asked for and returns outputs of the requested shapes (the kernels' arithmetic is
tested through the emulator elsewhere; here only which modules a step needs matters)."""

import mlx.core as mx
import pytest

from turboquant.attention import kernels
from turboquant.attention.kernels import cubin_cache, host
from turboquant.attention.kernels.cuda import translation_unit
from turboquant.attention.kernels.merge import Pass2
from kernel_support.synthetic import build_cache, stored

from kernel_backend import force_backend

LENGTHS = (1, 300, 4096, 16383, 16384, 70000)
SCHEMES = ("turbo4", "turbo8v3", "turbo0v4", "affine8")


def _longer(arrays: dict[str, mx.array], T: int) -> dict[str, mx.array]:
    """The stored rows repeated to T tokens (the kernels only need the shapes and dtypes)."""
    n = next(iter(arrays.values())).shape[2]
    return {k: mx.concatenate([a] * -(-T // n), axis=2)[:, :, :T] for k, a in arrays.items()}


def _recording(names: list[str]):
    def factory(variant):
        names.append(variant.name)

        def launch(*, output_shapes, output_dtypes, **_):
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    return factory


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_kernel_is_built_for_a_new_context_length(monkeypatch, scheme, dtype):
    """A decode step at every length, with and without a raw tail: the first length asks for
    every module the layer will ever need; no later length asks for another."""
    names: list[str] = []
    force_backend(monkeypatch, "cuda", _recording(names))
    cache = build_cache(scheme, 2, 64, dtype, 256, tail=5)
    assert (cache.stored, cache.offset) == (256, 261)
    arrays = stored(cache)
    tail = (cache._tail.arrays["keys"][:, :, :5], cache._tail.arrays["values"][:, :, :5])
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(1)).astype(dtype)

    per_length = []
    for T in LENGTHS:
        long = _longer(arrays, T)
        shifts = None if cache._shifts is None else _longer({"s": cache._shifts[None]}, -(-T // 256))["s"][0]
        for t in (None, tail):
            assert kernels.fused_decode(q, cache._key_side, cache._value_side, long, 0.125, shifts, t) is not None
        per_length.append(set(names))
    assert all(s == per_length[0] for s in per_length), [sorted(s - per_length[0]) for s in per_length]


def test_one_pass1_variant_per_layout_at_every_length():
    cache = build_cache("turbo4", 2, 64, mx.float16, 300)
    q = mx.zeros((1, 4, 1, 64), dtype=mx.float16)
    full = stored(cache)
    variants = {host.describe(q, cache._key_side, cache._value_side, _longer(full, T), None, tensor_cores=True).pass1
                for T in LENGTHS}
    assert len(variants) == 1, sorted(v.name for v in variants)


# std::hash<std::string> of libstdc++ (g++ 64-bit) for these strings, printed by a C++ program.
STD_HASHES = {"": 0x553E93901E462A6E, "a": 0x454DDEE488C1ED6B, "abcdefgh": 0x783DB3E38DB898BB,
              "abcdefghi": 0xB4EC9257851C8AAF, "custom_kernel source\n{ x = 1; }\n": 0x57A9563F0664A9E,
              "0123456789abcdef0123": 0xEC4B61C29F6A1075}


def test_std_hash_is_libstdcxx():
    for text, expected in STD_HASHES.items():
        assert cubin_cache.std_hash(text.encode()) == expected, text


def test_mlx_source_has_the_signature_mlx_builds():
    """Parameters in input order, strides after the inputs whose body names them, the outputs'
    dtypes, the body verbatim; the module name hashes the whole text."""
    body = "  out[0] = a[a_strides[0]] + b[0];"
    text = cubin_cache.mlx_source("k", "#define H 1\n", body, ["a", "b"], [mx.bfloat16, mx.uint32],
                                  ["out", "lse"], [mx.float16, mx.float32])
    assert text == (cubin_cache.DEFAULT_HEADER + "#define H 1\n" + cubin_cache.NAMESPACE_OPEN
                    + "__global__ void custom_kernel_k(\n"
                    "    const __nv_bfloat16* a,\n    const __grid_constant__ Strides a_strides,\n"
                    "    const uint32_t* b,\n    __half* out,\n    float* lse) {\n" + body + cubin_cache.CLOSING)
    name = cubin_cache.module_name("k", text)
    assert name == f"custom_kernel_k_{cubin_cache.std_hash(text.encode()):x}"
    assert cubin_cache.module_name("k", text.replace("b[0]", "b[1]")) != name


def test_translation_unit_is_the_cached_source_with_the_stand_in_header():
    variant = Pass2(d=64, rotate=True)
    unit = translation_unit(variant)
    assert cubin_cache.UTILS_HEADER not in unit and "using Strides" in unit
    assert "__global__ void custom_kernel_" + variant.name + "(\n" in unit


def test_a_cached_module_is_used_without_compiling(monkeypatch, tmp_path):
    """`ensure` finds a module another process wrote and compiles nothing (no NVRTC here)."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    source = cubin_cache.mlx_source("k", "", "  out[0] = 1;", [], [], ["out"], [mx.float32])
    written = tmp_path / (cubin_cache.module_name("k", source) + ".ptx")
    written.write_bytes(b"cubin")
    assert cubin_cache.ensure("k", source) == written
    assert cubin_cache.folder() == tmp_path


def test_the_metal_self_check_runs_once_per_kernel_variant_not_per_question_length():
    """fused_prefill gives the kernels R * L query rows per KV head: questions of 8 to 30 tokens
    share one pass-1 variant (their rows bucket), so Metal checks that variant once."""
    from turboquant.attention.kernels import metal

    cache = build_cache("turbo4", 2, 64, mx.float16, 300)
    full = stored(cache)
    calls = [host.describe(mx.zeros((1, 4 * L, 1, 64), dtype=mx.float16), cache._key_side, cache._value_side,
                           full, None) for L in (8, 15, 30)]
    assert len({c.pass1 for c in calls}) == 1 and len({c.R for c in calls}) == 3
    assert len({metal.shape_key(c) for c in calls}) == 1


def test_a_bound_kernel_makes_sure_of_the_module_its_launches_use(monkeypatch, tmp_path):
    """`CachedKernel.bound` (what a prepared decode step launches) makes sure of the module of
    exactly the source a launch with those dtypes compiles, once per signature, as a launch
    through `CachedKernel.__call__` does."""
    from turboquant.attention.kernels import cuda
    from turboquant.attention.kernels.included import included
    from turboquant.attention.kernels.template import output_names, source

    ensured = []
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cubin_cache, "enabled", lambda: True)
    monkeypatch.setattr(cubin_cache, "ensure", lambda name, text: ensured.append((name, text)))
    variant = host.pass2_variant(128, True, "bfloat16", "bfloat16", "bfloat16")
    kernel = object.__new__(cuda.CachedKernel)  # MLX's kernel object needs CUDA: a stand-in below
    kernel.name, kernel.input_names = variant.name, variant.input_names()
    kernel.included = included(*source(variant, "cuda"), kernel.input_names)
    kernel.outputs, kernel.cached = output_names(variant), set()
    kernel.kernel = lambda **launch: launch
    inputs = [mx.zeros((16,), dtype=cuda.DTYPES[t]) for t in cuda.input_types(variant).values()]
    outputs = [mx.bfloat16, mx.float32]
    assert kernel.bound([a.dtype for a in inputs], outputs) is kernel.kernel
    assert ensured == [(variant.name, kernel.source_for(inputs, outputs))]
    kernel(inputs=inputs, output_dtypes=outputs)
    assert len(ensured) == 1
    kernel.bound([a.dtype for a in inputs], [mx.float32, mx.float32])
    assert len(ensured) == 2 and ensured[1][1] == kernel.source_for(inputs, [mx.float32, mx.float32])
