"""Several rows' compressed caches attended in one call (turboquant/cache/rows.py) give each row
what it gets alone, bit for bit on this CPU: rows of unequal lengths, tails and block means,
each with its own calibration; and a stack kept across steps stays each row's own."""

import mlx.core as mx
import pytest

from turboquant import parse_scheme
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.cache.rows import RowStack, stack_key
from turboquant.codec.plan import plan_layer

H, R, D = 2, 4, 32


def _row(scheme: str, prompt: int, steps: int, seed: int, dtype=mx.float32, **plan) -> TurboQuantKVCache:
    """A cache prefilled with `prompt` rows, compressed by its first decode step, then `steps`
    more single rows (some crossing a block boundary): its own data, so its own calibration."""
    cache = TurboQuantKVCache(plan_layer(parse_scheme(scheme), H, D, D, dtype, **plan))
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    # Channel gains and biases of its own make each row's fitted calibration its own.
    gain = mx.exp(mx.random.normal((1, H, 1, D), key=k3))
    bias = 4.0 * mx.random.normal((1, H, 1, D), key=k2)
    keys = (mx.random.normal((1, H, prompt + steps, D), key=k1) * gain + bias).astype(dtype)
    values = mx.random.normal((1, H, prompt + steps, D), key=k2).astype(dtype)
    cache.update_and_fetch(keys[:, :, :prompt], values[:, :, :prompt])
    queries = mx.random.normal((1, H * R, prompt, D), key=k3).astype(dtype)
    cache.observe_queries(queries, 0.5)
    for t in range(prompt, prompt + steps):
        cache.update_and_fetch(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    if not steps:
        cache.compress()  # what a restored, saved entry holds: every row compressed
    return cache


def _alone_and_together(twins: list[TurboQuantKVCache], caches: list[TurboQuantKVCache], dtype=mx.float32,
                        stack: RowStack | None = None, new: tuple[mx.array, mx.array] | None = None,
                        seed: int = 99) -> tuple[mx.array, mx.array]:
    """Each row's attention after it takes this step's row (`new`, random by default): alone, each
    twin cache taking its row and attending on its own; together, one stack's call over
    `caches` (the twins' equals), which adds their rows itself."""
    if new is None:
        k1, k2 = mx.random.split(mx.random.key(seed + 1000))
        new = tuple(mx.random.normal((len(caches), H, 1, D), key=k).astype(dtype) for k in (k1, k2))
    queries = mx.random.normal((len(caches), H * R, 1, D), key=mx.random.key(seed)).astype(dtype)
    alone = []
    for g, c in enumerate(twins):
        c.update_and_fetch(new[0][g:g + 1], new[1][g:g + 1])
        alone.append(c.attention(queries[g:g + 1], D ** -0.5))
    together = (stack or RowStack()).attend(caches, *new, queries, D ** -0.5)
    return mx.concatenate(alone), together


def _same_records(twins: list[TurboQuantKVCache], caches: list[TurboQuantKVCache]) -> bool:
    """Whether each cache holds what its twin does (offsets and every record array, bit for bit):
    rows a stack held for a cache reach its record exactly."""
    for a, b in zip(twins, caches):
        ra, rb = a.to_record(), b.to_record()
        if (ra.offset, sorted(ra.arrays)) != (rb.offset, sorted(rb.arrays)) or not all(
                mx.array_equal(ra.arrays[n], rb.arrays[n]).item() for n in ra.arrays):
            return False
    return True


@pytest.mark.exact_blas
@pytest.mark.parametrize("scheme", ["turbo4", "turbo5v4", "turbo8v3", "turbo0v4", "turbo3"])
def test_rows_attended_together_match_each_alone_bit_for_bit(scheme):
    # lengths: a short prompt, one with a tail, one crossing a block, one two blocks long
    shapes = [(16, 1), (40, 9), (250, 12), (300, 3), (520, 1)]
    caches = [_row(scheme, prompt, steps, seed) for seed, (prompt, steps) in enumerate(shapes)]
    twins = [_row(scheme, prompt, steps, seed) for seed, (prompt, steps) in enumerate(shapes)]
    assert len({stack_key(c) for c in caches}) == 1
    if parse_scheme(scheme).calibrated:
        assert caches[0].calibration is None  # 16 rows: too few to fit one (MIN_ROWS)
        scales = [c.calibration.scale for c in caches[1:]]
        assert all(s is not None for s in scales) and not mx.array_equal(scales[0], scales[1]).item()
    alone, together = _alone_and_together(twins, caches)
    assert together.shape == alone.shape and together.dtype == alone.dtype
    assert mx.array_equal(alone, together).item()
    assert _same_records(twins, caches)


def test_rows_with_and_without_a_tail_or_a_calibration_match_alone():
    # 16 prompt rows are too few to fit a calibration (MIN_ROWS); rows compressed whole (as
    # saved) have no tail; a step past a block's end encodes the block it left open
    shapes = [(16, 0, 0), (300, 0, 1), (255, 1, 2), (200, 57, 3), (40, 2, 4)]
    caches, twins = ([_row("turbo4", *shape) for shape in shapes] for _ in range(2))
    assert caches[0].calibration is None and caches[1].calibration is not None
    assert caches[0].offset == caches[0].stored and caches[1].offset == caches[1].stored
    assert (caches[3].stored, caches[3].offset) == (256, 257)
    alone, together = _alone_and_together(twins, caches)
    assert mx.array_equal(alone, together).item()
    assert _same_records(twins, caches)


def test_bfloat16_rows_keep_their_dtype_and_match_alone():
    caches, twins = ([_row("turbo4", n, 3, seed, mx.bfloat16) for seed, n in enumerate((20, 70, 130))]
                     for _ in range(2))
    alone, together = _alone_and_together(twins, caches, mx.bfloat16)
    assert together.dtype == mx.bfloat16
    assert mx.array_equal(alone, together).item()


def test_rows_that_cannot_share_a_call_have_different_keys():
    plain, protected = _row("turbo4", 64, 1, 0), _row("turbo4", 64, 1, 1, protected=True)
    assert stack_key(plain) != stack_key(protected)
    assert stack_key(plain) != stack_key(_row("turbo5v4", 64, 1, 0))
    fresh = TurboQuantKVCache(plan_layer(parse_scheme("turbo4"), H, D, D, mx.float32))
    fresh.update_and_fetch(mx.zeros((1, H, 8, D)), mx.zeros((1, H, 8, D)))
    assert stack_key(fresh) is None  # still in prefill: attends alone


def test_a_cache_trimmed_to_nothing_and_refilled_with_two_rows_stacks_no_more():
    """stack_key remembers a cache's batch; a trim to zero starts the cache over, and the same
    cache refilled with a batch of two rows attends alone."""
    cache = _row("turbo4", 64, 1, 0)
    assert stack_key(cache) is not None
    cache.trim(cache.offset)
    rows = mx.random.normal((2, H, 300, D))
    cache.update_and_fetch(rows, rows)
    cache.compress()
    assert cache.batch == 2 and cache.stored
    assert stack_key(cache) is None


@pytest.mark.exact_blas  # rows together against alone: OpenBLAS's AMD kernels round by batch size
def test_a_stack_kept_across_steps_holds_its_rows_and_rebuilds_when_one_changes(monkeypatch):
    """Steps that add one row to each cache are written into the stacked tails alone (no
    rebuild; the caches only count them), and each row still gets its own answer; a block
    encoded (a row's tail reaching 256), a step taken back (trim) and a row leaving rebuild the
    stack from the caches, which then hold every row they were lent, bit for bit."""
    builds = []
    build = RowStack._build
    monkeypatch.setattr(RowStack, "_build", lambda self, caches: builds.append(len(caches)) or build(self, caches))
    caches, twins = ([_row("turbo4", n, 1, seed) for seed, n in enumerate((20, 250, 60))] for _ in range(2))
    stack = RowStack()
    keys = mx.random.normal((3, H, 12, D), key=mx.random.key(7))
    values = mx.random.normal((3, H, 12, D), key=mx.random.key(8))
    for step in range(12):
        if step == 9:
            for c in caches + twins:
                c.trim(1)  # the step before taken back (every row), then stepped again
        new = (keys[:, :, step:step + 1], values[:, :, step:step + 1])
        alone, together = _alone_and_together(twins, caches, stack=stack, new=new, seed=step)
        assert mx.array_equal(alone, together).item(), step
        if step in (3, 8):
            assert all(c._lent for c in caches) and _same_records(twins, caches)
    # built at the first step, when the 250-token row encoded its block (offset 256 -> 257:
    # step 5) and after the trim
    assert builds == [3, 3, 3]
    assert caches[1].stored == 256
    alone, together = _alone_and_together(twins[::2], caches[::2], stack=stack)
    assert mx.array_equal(alone, together).item() and builds == [3, 3, 3, 2]
    assert _same_records(twins, caches)
