"""Named arrays that grow along the token axis in fixed steps.

Appending writes into spare capacity; only crossing a step boundary copies (once per `step`
tokens, as mlx-lm's KVCache does), so a long generation never copies the whole cache per token.

MLX's `a[...] = b` rewrites the array object in place, and every other Python reference to
that object sees the write. Views handed out (and arrays adopted from a snapshot) are therefore
always distinct objects (a slice), so a snapshot never changes when the cache moves on.
"""

from __future__ import annotations

import mlx.core as mx

from turboquant.records import TOKEN_AXIS


class TokenBuffers:
    """A set of arrays sharing one token axis (axis 2) and one capacity."""

    def __init__(self, step: int = 256):
        self.step = step
        self.arrays: dict[str, mx.array] = {}

    @property
    def capacity(self) -> int:
        return next(iter(self.arrays.values())).shape[TOKEN_AXIS] if self.arrays else 0

    def write(self, at: int, new: dict[str, mx.array]) -> None:
        """Write `new` (same names each time) at token position `at`, growing if needed."""
        n = next(iter(new.values())).shape[TOKEN_AXIS]
        if not self.arrays or at + n > self.capacity:
            self._grow(at, at + n, new)
        for name, value in new.items():
            self.arrays[name][:, :, at:at + n] = value

    def _grow(self, keep: int, needed: int, like: dict[str, mx.array]) -> None:
        capacity = -(-needed // self.step) * self.step
        grown = {}
        for name, value in like.items():
            shape = list(value.shape)
            old = self.arrays.get(name)
            shape[TOKEN_AXIS] = capacity - (keep if old is not None else 0)
            pad = mx.zeros(shape, dtype=value.dtype)
            grown[name] = pad if old is None else mx.concatenate([old[:, :, :keep], pad], axis=TOKEN_AXIS)
        self.arrays = grown

    def view(self, n: int) -> dict[str, mx.array]:
        """The first `n` tokens of every array (new array objects, never the buffers themselves)."""
        return {name: a[:, :, :n] for name, a in self.arrays.items()}

    def adopt(self, arrays: dict[str, mx.array]) -> None:
        """Take over exactly-sized arrays (a restore) without aliasing them."""
        self.arrays = {name: detach(a) for name, a in arrays.items()}

    def clear(self) -> None:
        self.arrays = {}


def detach(a: mx.array) -> mx.array:
    """A distinct array object with the same contents (a lazy full slice, no copy until written)."""
    return a[:, :, : a.shape[TOKEN_AXIS]]
