"""Batched decoding: several generations' next tokens from one forward pass of the model.

Each generation keeps its own per-layer caches (raw KVCache or TurboQuantKVCache, restored
from any tier, prefilled on their own). A `DecodeBatch` step stacks the generations' next
tokens into one [B, 1] input and runs the model once: embeddings, projections, MLPs, norms and
the output head run batched. Attention runs in one of two forms per row:

- Raw rows shorter than GROUP_TOKENS (1024) attend together, the group: the batch keeps their
  keys and values in one buffer pair per layer, [rows, KV heads, capacity, head dim], each row's
  at [0, its length) and zeros after; a step writes every row's new token with one scatter and
  runs one attention call over the rows' longest length, a mask hiding each row's padding. A
  row's rows are copied in when it joins and its new rows handed back to its own caches
  (`update_and_fetch`) when it leaves unfinished (parked, or grown to GROUP_TOKENS), so its own
  caches hold its prompt throughout and every token again once it leaves.
- TurboQuant rows join the group too while every layer's step attends with dense SDPA over
  rows it holds as arrays and encodes nothing (`TurboQuantKVCache.dense_step`): before the
  cache compresses (a context under a block decodes raw until one fills, on every backend),
  and on CUDA while it attends over its decoded mirror (turboquant's `DecodedMirror`: the
  stored rows decoded and the raw tail) and its update encodes no block. The group's rows are
  then the very rows the layer reads alone, and its caches are untouched, as a raw member's,
  until the row leaves, before the step whose update compresses or encodes a block. Otherwise
  (the CPU and Metal past the first block, longer contexts) they stay out: dense attention over
  their decoded rows answered otherwise than `ask` (attention over the compressed storage) for
  the same prompt.
- Other TurboQuant rows of at most GROUP_TOKENS tokens whose layer shares a stored layout with
  others' (`stack_key`) attend together, one call per layer, as they attend alone: on the
  plain-ops path (the CPU) over their compressed storage (turboquant's `RowStack`, each row's
  arithmetic its own), on CUDA over their decoded mirrors (turboquant's `DecodedStack`, one
  kernel over each row's own length). Both keep their rows stacked across steps and add each
  step's new rows themselves: while no row changed otherwise, one scatter into the stack is
  the rows' only write and their caches only count the row (`TurboQuantKVCache.lend`); a
  cache takes its rows back when anything reads its tail.
- Longer rows, and TurboQuant rows with no other of their layout, attend one at a time over
  their own caches, through TurboQuant's dispatch.

With MLX's bundled BLAS a row's arithmetic is its own either way (the padded positions add
exact zeros): a greedy answer does not depend on what else is in the batch
(tests/test_server_batch.py, tests/test_attention_rows.py). Greedy rows draw with one argmax
over the batch; sampled rows each draw from their own random sequence.

Steps run one ahead of the tokens handed out (`DecodeBatch`): the device computes a step while
the host reads the last one and builds the next.

`batched_generation` is `Engine.generation` with its decode handed to the caller: it yields
`None` after each prefill chunk (as `Engine.generation`) and a `Row` whenever it needs its
next token, which the caller fills by running `DecodeBatch.step` over every waiting row (and
resumes the generations of the rows it served).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from turboquant import (AttentionHook, DecodedStack, RowStack, TurboQuantKVCache, compressed_sdpa,
                        install_attention_dispatch, mirror_tokens, ragged_decode, stack_key, start_decoding)

from tqstore.engine.engine import Engine
from tqstore.engine.generation import AskResult, own_randomness
from tqstore.engine.prefill import PrefillRow, Started
from tqstore.engine.shared_prefill import ROW_CACHES, ChunkKeys
from tqstore.models.loading import LoadedModel

# Model families whose attention layers use their cache only through `offset`,
# `update_and_fetch` and mlx-lm's `scaled_dot_product_attention` (and build their mask through
# `create_attention_mask`), so that per-row attention is theirs exactly; each is tested
# (tests/test_server_batch.py; mistral runs mlx-lm's llama module). Others decode alone.
BATCHED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def batchable(loaded: LoadedModel, caches: Sequence[Any]) -> bool:
    """Whether generations on these caches may share decode steps: a family in
    BATCHED_FAMILIES whose every layer is a plain (raw or TurboQuant) attention cache (no
    sliding windows, no recurrent states)."""
    family = getattr(getattr(loaded.model, "args", None), "model_type", None)
    return family in BATCHED_FAMILIES and all(type(c) in ROW_CACHES for c in caches)


# Rows this long or longer attend over their own caches: padding others to them would cost more
# than the calls it saves, and compressed rows keep their memory saving where it matters.
GROUP_TOKENS = 1024
_CAPACITY_STEP = 256  # the shared buffers grow by this many positions
# Rows a new request's compression encodes per step over all its layers: a long prompt's encoding
# runs as steps between the other requests' decode steps, each well under the scheduler's 20 ms
# chunk. Encoded in one evaluation, a 16k-token prompt's 8 layers kept a short request beside it
# waiting 159-171 ms for its first token on the H200 (9-13 ms idle).
COMPRESS_ROWS = 8192


def _groups(row: "Row", length: int, group_tokens: int, mirror: int) -> bool:
    """Whether the row's next step, at `length` rows, runs in the group: shorter than
    `group_tokens`, and every layer a raw cache or a TurboQuant cache whose step attends with
    dense SDPA over rows held as arrays and encodes nothing (`dense_step`: its raw rows before
    it compresses, or its decoded mirror): the group's rows are then the rows it reads alone.
    TurboQuant attention over the compressed storage itself (the CPU, Metal, longer contexts)
    answers otherwise than dense attention over the same rows decoded. `mirror`: `mirror_tokens()`."""
    return length < group_tokens and all(
        type(c) is KVCache or isinstance(c, TurboQuantKVCache) and c.dense_step(length, mirror) for c in row.caches)


def _held_rows(cache: Any) -> tuple[mx.array, mx.array]:
    """The keys and values a group member's cache holds, [1, H, offset, D]: a raw cache's own
    arrays; a TurboQuant cache's raw rows before it compresses, else its decoded mirror (the
    rows its attention reads, kept current for the rows given back when the member leaves)."""
    if isinstance(cache, TurboQuantKVCache):
        return cache.mirrored_rows() if cache.compressed else (cache.raw_keys(), cache.raw_values())
    return cache.keys_and_values()


class StepKeys:
    """What a step's layer returns as its keys (and values): the group's padded buffers and
    mask, each other row's own (keys, values, cache, stack key: None attends alone), the step's
    new keys and values of every row, and the layer's stacks (`RowStack` or `DecodedStack`) by stack key."""

    def __init__(self, group: tuple[mx.array, mx.array, Any, Any] | None, others: list[tuple[Any, Any, Any, Any]],
                 new: tuple[mx.array, mx.array], stacks: dict[Any, RowStack | DecodedStack]):
        self.group = group
        self.others = others
        self.new = new
        self.stacks = stacks


class StepLayer:
    """One layer's caches in a decode step, as the model sees one cache: per-row offsets (RoPE
    takes an array); the group's new rows go into the batch's buffers with one scatter, each
    other row's into its own cache."""

    def __init__(self, batch: "DecodeBatch", layer: int, others: list[Any], offset: mx.array,
                 positions: mx.array | None, width: int | None, mask: mx.array | None, lengths: mx.array | None,
                 stack_tokens: int):
        self.batch, self.layer, self.others = batch, layer, others
        self.offset, self.positions, self.width = offset, positions, width
        self.mask, self.lengths = mask, lengths  # the group's, under the mask: each row's keys, the new one included
        self.stack_tokens = stack_tokens  # compressed rows this long or shorter stack (0: none)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[StepKeys, StepKeys]:
        g = len(self.batch.members)
        group = None
        if g:
            k, v = self.batch.write(self.layer, keys[:g] if self.others else keys,
                                    values[:g] if self.others else values, self.positions, self.width)
            group = (k, v, self.mask, self.lengths)
        others = []
        for i, cache in enumerate(self.others, start=g):
            key = stack_key(cache) if isinstance(cache, TurboQuantKVCache) and \
                cache.offset < self.stack_tokens else None
            if key is None:
                k, v = cache.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            else:  # its row goes in with its stack's (rows_sdpa: the stack, or the cache if alone)
                k = v = None
            others.append((k, v, cache, key))
        fetched = StepKeys(group, others, (keys, values), self.batch.stacks[self.layer])
        return fetched, fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1:
            raise ValueError("a decode batch runs one token per row")
        return None  # the group's mask travels with its keys (StepKeys)


def rows_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's scaled_dot_product_attention (through TurboQuant's dispatch); in a decode step,
    one masked call over the group's buffers, one call per `RowStack` of compressed rows that
    share a stored layout, and one call per other row; in a shared prefill, one call per row
    (shared_prefill.py)."""
    if isinstance(keys, ChunkKeys):
        return keys.attend(queries, scale, sinks)
    if not isinstance(keys, StepKeys):
        return compressed_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    outs, order, g = [], [], 0
    if keys.group is not None:
        k, v, group_mask, lengths = keys.group
        g = k.shape[0]
        q = queries[:g] if keys.others else queries
        # Rows of unequal length: MLX's CUDA SDPA has no fused one-token kernel under an array
        # mask (ragged.py), so there one kernel reads each row's own keys (None elsewhere).
        out = ragged_decode(q, k, v, lengths, scale) if group_mask is not None and sinks is None else None
        outs.append(out if out is not None else
                    compressed_sdpa(q, k, v, cache=None, scale=scale, mask=group_mask, sinks=sinks))
        order += range(g)
    stacked: dict[Any, list[int]] = {}
    for i, (_, _, _, key) in enumerate(keys.others, start=g):
        if key is not None and sinks is None:
            stacked.setdefault(key, []).append(i)
    stacked = {key: rows for key, rows in stacked.items() if len(rows) > 1}
    shared = {i for rows in stacked.values() for i in rows}
    for i, (k, v, c, _) in enumerate(keys.others, start=g):
        if i not in shared:
            if k is None:  # a row that would have stacked, alone this step
                k, v = c.update_and_fetch(keys.new[0][i:i + 1], keys.new[1][i:i + 1])
            outs.append(compressed_sdpa(queries[i:i + 1], k, v, cache=c, scale=scale, mask=mask, sinks=sinks))
            order.append(i)
    kind = RowStack if RowStack.applies() else DecodedStack
    kept = {key: keys.stacks.get(key) if isinstance(keys.stacks.get(key), kind) else kind() for key in stacked}
    for key, rows in stacked.items():
        index = _index(rows)
        outs.append(kept[key].attend([keys.others[i - g][2] for i in rows], keys.new[0][index],
                                     keys.new[1][index], queries[index], scale))
        order += rows
    keys.stacks.clear()  # stacks no rows used this step go, and their copies with them
    keys.stacks.update(kept)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if order != sorted(order):  # back to the batch's row order
        where = [0] * len(order)
        for at, i in enumerate(order):
            where[i] = at
        out = out[mx.array(where)]
    return out


def _index(rows: list[int]) -> slice | mx.array:
    """What picks the step's `rows` (ascending) out of its arrays: a slice when they are
    consecutive (every row of a batch of one scheme: no gather to launch), else their indices."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return mx.array(rows)


_ROWS_HOOK = AttentionHook(compressed_sdpa, rows_sdpa)


def install_rows_dispatch() -> None:
    """Point every loaded mlx_lm.models module's attention at `rows_sdpa` (idempotent; after
    TurboQuant's dispatch, which `rows_sdpa` calls)."""
    install_attention_dispatch()
    _ROWS_HOOK.install()


@dataclass(eq=False)
class Row:
    """One generation's place in a decode step: the token to run and, after the step, the
    token drawn and (the first step's) log-probabilities. `sample` None: greedy."""

    caches: list[Any]
    token: int  # the input of the next step
    sample: Callable[[mx.array], mx.array] | None
    drawn: int | None = None
    logprobs: mx.array | None = field(default=None, repr=False)
    finished: bool = False  # its generation ended: nothing reads its caches' new rows


@dataclass(eq=False)
class _Launched:
    """A step whose graph is built and evaluating: its rows in step order and, still lazy, each
    row's drawn token and log-probabilities."""

    rows: list[Row]
    tokens: mx.array  # [rows] int32
    logprobs: mx.array  # [rows, vocabulary]


class DecodeBatch:
    """Decode steps over changing sets of rows (one owner: the thread that steps them).

    Rows shorter than `group_tokens` whose layers are raw or attend over rows held as arrays
    (`_groups`) form the group: their keys and values live in one buffer pair per layer
    ([group, KV heads, capacity, head dim], row j's at [0, lengths[j]), zeros after) while they
    stay; the rest attend over their own caches.

    Steps run one ahead, as mlx-lm's `generate_step` does: a step hands out the tokens of the
    step launched before it, after launching the next one over the same rows (fed those tokens
    while they are still being computed), so the device computes a step while the host reads
    the last one and builds the next. A row's caches therefore hold one token more than it was
    handed, as after `Engine.generate`. A row that sits out the next step unfinished (parked)
    has that token taken back; a row that joins waits one step, in the launch, unless no
    launched row is stepped (then its step runs at once)."""

    def __init__(self, group_tokens: int = GROUP_TOKENS):
        self.group_tokens = group_tokens
        self.members: list[Row] = []
        self.lengths: list[int] = []
        self.keys: list[mx.array | None] = []
        self.values: list[mx.array | None] = []
        self.seconds = 0.0  # the last step's
        self.stacks: list[dict[Any, RowStack | DecodedStack]] = []  # per layer: compressed rows stacked across steps
        self._launched: _Launched | None = None

    def step(self, model: Any, rows: Sequence[Row], keep: Callable[[Row], bool] | None = None) -> list[Row]:
        """Hand out the next token (`Row.drawn`) of rows in `rows`: those of the step launched
        before, or of all of them when none of those is among them; launch the next step over
        `rows` (those `keep` says will step again). Returns the rows served; the seconds taken
        are in `seconds`. The rows come from `batched_generation`, which installed the
        dispatch. A failed step drops the group's buffers (their rows' answers so far with
        them) and the launched step, and raises."""
        t0 = time.perf_counter()
        try:
            served = self._step(model, rows, keep)
        except BaseException:
            self.__init__(self.group_tokens)
            raise
        self.seconds = time.perf_counter() - t0
        return served

    def _step(self, model: Any, rows: Sequence[Row], keep: Callable[[Row], bool] | None) -> list[Row]:
        launched, self._launched = self._launched, None
        present = {id(r) for r in rows}
        at: dict[int, int] = {}
        if launched is not None:
            self._take_back([r for r in launched.rows if id(r) not in present and not r.finished])
            at = {id(r): i for i, r in enumerate(launched.rows) if id(r) in present}
        if not at:  # nothing launched for these rows: their step runs now
            launched = self._launch(model, list(rows), None, {})
            at = {id(r): i for i, r in enumerate(launched.rows)}
        following = [r for r in rows if keep is None or keep(r)]
        if following:
            self._launched = self._launch(model, following, launched.tokens, at)
        tokens = launched.tokens.tolist()  # waits for the launched step only
        served = [r for r in rows if id(r) in at]
        for r in served:
            i = at[id(r)]
            r.drawn = tokens[i]
            if r.logprobs is None:  # the first token's, for the result; later steps' are not kept
                r.logprobs = launched.logprobs[i]
        return served

    def settle(self) -> None:
        """With no row to step: take back the launched step of rows that did not finish and
        hand members' rows back to their caches, so the batch keeps no finished row's caches."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._take_back([r for r in launched.rows if not r.finished])
        self._regroup([])
        self.stacks = []

    def _take_back(self, rows: list[Row]) -> None:
        """Undo the launched step's token of rows that sit out the next step unfinished: the
        group's length, or the row's own caches, one token back; its draw taken back."""
        member = {id(r): j for j, r in enumerate(self.members)}
        for row in rows:
            if id(row) in member:
                self.lengths[member[id(row)]] -= 1
            else:
                for cache in row.caches:
                    cache.trim(1)
            rewind = getattr(row.sample, "rewind", None)
            if rewind is not None:
                rewind()

    def _launch(self, model: Any, rows: list[Row], drawn: mx.array | None, at: dict[int, int]) -> _Launched:
        """Build one step over `rows` and start evaluating it. A row's input is its `token`, or,
        for a row in `at`, entry at[id(row)] of `drawn` (a launched step's still lazy tokens)."""
        member = {id(r): j for j, r in enumerate(self.members)}

        def length(row: Row) -> int:
            return self.lengths[member[id(row)]] if id(row) in member else row.caches[0].offset

        mirror = mirror_tokens()  # (once a step: it reads the environment)
        self._regroup([r for r in rows if _groups(r, length(r), self.group_tokens, mirror)])
        grouped = {id(r) for r in self.members}
        others = [r for r in rows if id(r) not in grouped]
        # TurboQuant rows whose step compresses them (a block held): all in lockstep, before the
        # step, rather than each layer on its own inside it
        start_decoding([c for r in others for c in r.caches if isinstance(c, TurboQuantKVCache) and not c.compressed])
        ordered = self.members + others
        lengths = self.lengths + [r.caches[0].offset for r in others]
        offset = mx.array(lengths)
        positions = width = mask = lengths = None
        if self.members:
            width = max(self.lengths) + 1
            if min(self.lengths) + 1 < width:  # rows of unequal length: hide each row's padding
                positions = offset[:len(self.members)] if others else offset
                mask = (mx.arange(width)[None, :] <= positions[:, None])[:, None, None, :]
                lengths = positions + 1
        depth = len(rows[0].caches)
        self.stacks += [{} for _ in range(depth - len(self.stacks))]
        # (a DecodedStack's rows are the ones with mirrors: 0 where there are none)
        stack_tokens = self.group_tokens if RowStack.applies() else min(self.group_tokens, mirror)
        layers = [StepLayer(self, layer, [r.caches[layer] for r in others], offset, positions, width, mask, lengths,
                            stack_tokens) for layer in range(depth)]
        logits = model(_inputs(ordered, drawn, at), cache=layers)[:, -1, :]
        self.lengths = [n + 1 for n in self.lengths]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # greedy rows' draws
        sampled = [i for i, r in enumerate(ordered) if r.sample is not None]
        if sampled:
            draws = [ordered[i].sample(logprobs[i:i + 1]).reshape(1).astype(mx.int32) for i in sampled]
            tokens[mx.array(sampled)] = mx.concatenate(draws)
        launched = _Launched(ordered, tokens, logprobs)
        mx.async_eval(launched.tokens, launched.logprobs)
        return launched

    def write(self, layer: int, keys: mx.array, values: mx.array, positions: mx.array | None,
              width: int) -> tuple[mx.array, mx.array]:
        """Put the group's new rows (one per member, at `positions`; None: all at `width` - 1)
        into the layer's buffers; the buffers up to `width`."""
        if self.keys[layer] is None or self.keys[layer].shape[2] < width:
            self.keys[layer] = self._grown(self.keys[layer], keys, width)
            self.values[layer] = self._grown(self.values[layer], values, width)
        if positions is None:  # rows of one length: a slice update (cheaper than a scatter on the CPU)
            self.keys[layer][:, :, width - 1:width] = keys
            self.values[layer][:, :, width - 1:width] = values
        else:
            rows = mx.arange(keys.shape[0])
            self.keys[layer][rows, :, positions] = keys[:, :, 0, :]
            self.values[layer][rows, :, positions] = values[:, :, 0, :]
        return self.keys[layer][:, :, :width], self.values[layer][:, :, :width]

    @staticmethod
    def _grown(buffer: mx.array | None, like: mx.array, width: int) -> mx.array:
        capacity = -(-width // _CAPACITY_STEP) * _CAPACITY_STEP
        B, H, _, D = like.shape
        if buffer is None:
            return mx.zeros((B, H, capacity, D), like.dtype)
        return mx.pad(buffer, [(0, 0), (0, 0), (0, capacity - buffer.shape[2]), (0, 0)])

    def _regroup(self, group: list[Row]) -> None:
        """Make `group` the members: rows that leave unfinished get their new rows back in
        their own caches; rows that join are copied in from theirs."""
        if [id(r) for r in group] == [id(r) for r in self.members]:
            return
        staying = {id(r) for r in group}
        old = {id(r): j for j, r in enumerate(self.members)}
        for j, row in enumerate(self.members):
            if id(row) not in staying and not row.finished:
                self._give_back(j, row)
        lengths = [self.lengths[old[id(r)]] if id(r) in old else r.caches[0].offset for r in group]
        width = max(lengths, default=0) + 1
        capacity = -(-width // _CAPACITY_STEP) * _CAPACITY_STEP
        layers = len(group[0].caches) if group else 0
        keys, values = [], []
        for layer in range(layers):
            pieces_k, pieces_v = [], []
            for r, n in zip(group, lengths):
                if id(r) in old:
                    j = old[id(r)]
                    k, v = self.keys[layer][j:j + 1, :, :n], self.values[layer][j:j + 1, :, :n]
                else:
                    k, v = _held_rows(r.caches[layer]) if n else (None, None)
                pieces_k.append(k)
                pieces_v.append(v)
            keys.append(_stacked(pieces_k, capacity))
            values.append(_stacked(pieces_v, capacity))
        self.members, self.lengths, self.keys, self.values = list(group), lengths, keys, values

    def _give_back(self, j: int, row: Row) -> None:
        """Append the rows a member decoded in the group to its own caches."""
        for layer, cache in enumerate(row.caches):
            start, end = cache.offset, self.lengths[j]
            if end > start:
                cache.update_and_fetch(self.keys[layer][j:j + 1, :, start:end],
                                       self.values[layer][j:j + 1, :, start:end])


def _inputs(rows: list[Row], drawn: mx.array | None, at: dict[int, int]) -> mx.array:
    """The step's [rows, 1] input tokens: entry at[id(row)] of `drawn` for a row in `at`, else
    the row's `token`."""
    fresh = [r.token for r in rows if id(r) not in at]
    if drawn is None or len(fresh) == len(rows):
        return mx.array([[r.token] for r in rows], dtype=mx.int32)
    source = mx.concatenate([drawn, mx.array(fresh, dtype=mx.int32)]) if fresh else drawn
    appended = iter(range(drawn.size, drawn.size + len(fresh)))
    index = [at[id(r)] if id(r) in at else next(appended) for r in rows]
    return source[mx.array(index)][:, None]


def _stacked(pieces: list[mx.array | None], capacity: int) -> mx.array | None:
    """Rows [1, H, n, D] (None: empty) as one [rows, H, capacity, D] buffer, zero-padded; None
    when every row is empty (the first write allocates it)."""
    like = next((p for p in pieces if p is not None), None)
    if like is None:
        return None
    _, H, _, D = like.shape
    return mx.concatenate([mx.zeros((1, H, capacity, D), like.dtype) if p is None else
                           mx.pad(p, [(0, 0), (0, 0), (0, capacity - p.shape[2]), (0, 0)]) for p in pieces])


def _sampler(temp: float, top_p: float, seed: int | None) -> Callable[[mx.array], mx.array] | None:
    """mlx-lm's sampler, drawing from this generation's own random sequence; None for greedy."""
    from mlx_lm.sample_utils import make_sampler

    if temp == 0:
        return None  # greedy: DecodeBatch draws every greedy row with one argmax
    return own_randomness(make_sampler(temp=temp, top_p=top_p), seed)


def batched_generation(engine: Engine, loaded: LoadedModel, scheme: str, prompt: Sequence[int], *,
                       max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                       stop: Callable[[str], bool] | None = None, on_start: Callable[[Started], None] | None = None,
                       started: Started | None = None, step_seconds: Callable[[], float] | None = None,
                       chunk: Callable[[int], int] | None = None, share: int = 0
                       ) -> Generator[Row | PrefillRow | None, None, tuple[AskResult, list[Any]]]:
    """`Engine.generation` whose tokens come from shared decode steps: it yields None after each
    prefill chunk and each step of the prompt's compression (COMPRESS_ROWS), and its `Row`
    whenever it needs a token (the caller runs `DecodeBatch.step` over the
    waiting rows, then resumes it). Stops, token cap, EOS and text are mlx-lm's
    `stream_generate`'s. `step_seconds()` says how long the last step took (the generation's
    decode time counts the steps it took part in); `chunk(position)` sizes each prefill chunk. A
    prefill of at most `share` tokens is yielded as a `PrefillRow` instead, for the caller to run
    with other rows' (`prefill_rows`)."""
    install_rows_dispatch()  # model modules imported since the last request get it too
    started, remainder, prefill, halted = yield from engine.prompt_steps(loaded, scheme, prompt, seed=seed, stop=stop,
                                                                         on_start=on_start, started=started,
                                                                         chunk=chunk, share=share)
    pieces, tokens, finish, generating, first_token, first_logprobs = [], [], None, 0.0, 0.0, None
    if halted():
        finish = "stop"
    else:
        tokenizer = loaded.tokenizer
        detokenizer = tokenizer.detokenizer
        yield from started.context.starting(COMPRESS_ROWS)  # all layers in lockstep, in steps of their own
        row = Row(started.caches, remainder[-1], _sampler(temp, top_p, seed))
        while True:
            yield row
            generating += step_seconds() if step_seconds is not None else 0.0
            token = row.drawn
            if not tokens:
                first_token = started.restore_seconds + prefill + generating
                first_logprobs = row.logprobs
            tokens.append(token)
            ended = token in tokenizer.eos_token_ids
            if not ended:
                detokenizer.add_token(token)
            if ended or len(tokens) == max_tokens:
                detokenizer.finalize()
                pieces.append(detokenizer.last_segment)
                finish = "stop" if ended else "length"
                if stop is not None and stop("".join(pieces)):
                    finish = "stop"
                break
            pieces.append(detokenizer.last_segment)
            if stop is not None and stop("".join(pieces)):
                finish = "stop"
                break
            row.token = token
        row.finished = True
    result = AskResult("".join(pieces), tokens, len(prompt), started.matched, started.tier, started.restore_seconds,
                       prefill, 0.0, generating, finish, first_token, first_logprobs=first_logprobs)
    return result, started.caches
