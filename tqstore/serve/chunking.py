"""How long a prompt's prefill chunks are in `tqstore serve`.

A long prompt prefills in chunks that interleave with the running decode, so each chunk is
sized to take about CHUNK_SECONDS: a request that arrives meanwhile waits about that long for
the model. Two things the sizes must not do, both found on the H200 (docs/server.md):

- Follow the last chunk's time. A chunk whose shapes are new to the GPU pays for them (MLX's
  CUDA backend builds a cuDNN attention graph per query and key length, and its JIT kernels per
  shape), so it runs many times slower than the next one of the same shape. Sized by the last
  chunk's rate, one slow chunk shrank the next to MIN_CHUNK, whose shapes were new again: a
  16k-token prompt went through in about a thousand 16-token chunks, each paying a graph build,
  62-68 s against 0.2 s through the Engine. Sizes here follow the fastest time seen at each
  size, which a slow run never raises; on a GPU a chunk of a new shape is not measured at all.
- Take any length. Sizes come from a ladder of powers of two (MIN_CHUNK up to the engine's
  chunk) and each chunk ends at a multiple of its size, so the key lengths a chunk attends over
  are multiples of it and repeat from prompt to prompt: after the first long prompt, the
  shapes of the next ones are known (only a prompt's last, partial chunk is its own).
"""

from __future__ import annotations

CHUNK_SECONDS = 0.02
MIN_CHUNK = 16


# A chunk size must run at least this much faster per token than the next smaller one to be
# chosen over it when no size fits the time (or to be worth trying the next larger one).
GAIN = 1.5


class ChunkSizer:
    """Prefill chunk sizes for one model (one owner: the worker's thread).

    `fastest[size]` is the fewest seconds a chunk of that size of the ladder has taken (a
    partial chunk counts, scaled, for the largest size it covers): its warm time. The pick is
    the largest size that fits `seconds`, trying the next larger one once when the largest
    measured fits at the rate it ran. When none fits, the next smaller size than any measured is
    tried if it fits at the smallest one's rate; else the pick is the smallest size within GAIN
    of the best rate per token, climbing while each larger size ran at least GAIN faster per
    token: a fixed cost per chunk is then paid by as few chunks as possible, and time per token
    proportional to size keeps chunks small.

    `new_shapes_slow` (a GPU): a chunk of a shape (length, end) this sizer has not seen run is
    not measured at all, because its time is mostly the shape's one-off cost (on the H200 a
    16-token chunk took 68 ms cold and 4 ms warm, a 512-token one 59 ms and 6 ms), and until a
    warm chunk has run the pick is the largest size: a cold chunk costs about the same at any
    size, so the first long prompt pays as few of them as it can, and the next prompts run
    the same aligned shapes warm. On a CPU every chunk counts and the climb starts at the
    smallest size."""

    def __init__(self, limit: int, seconds: float = CHUNK_SECONDS, least: int = MIN_CHUNK,
                 new_shapes_slow: bool = False):
        self.seconds = seconds
        self.sizes = [least]
        while self.sizes[-1] * 2 <= limit:
            self.sizes.append(self.sizes[-1] * 2)
        self.new_shapes_slow = new_shapes_slow
        self.fastest: dict[int, float] = {}
        self._shapes: set[tuple[int, int]] = set()  # (length, end) of the chunks run so far

    def pick(self) -> int:
        """The chunk size to run next (see the class)."""
        measured = [s for s in self.sizes if s in self.fastest]
        if not measured:
            return self.sizes[-1] if self.new_shapes_slow else self.sizes[0]
        top = measured[-1]
        larger = [s for s in self.sizes if s > top]
        fits = [s for s in measured if self.fastest[s] <= self.seconds]
        if fits:
            best = fits[-1]
            if best == top and larger and self.fastest[top] * larger[0] / top <= self.seconds:
                return larger[0]
            return best
        smaller = [s for s in self.sizes if s < measured[0]]
        if smaller and self.fastest[measured[0]] * smaller[-1] / measured[0] <= self.seconds:
            return smaller[-1]  # (a GPU starts at the largest size) half of it may fit: try it
        per_token = {s: self.fastest[s] / s for s in measured}
        if larger and (len(measured) == 1 or per_token[top] * GAIN <= per_token[measured[-2]]):
            return larger[0]
        quickest = min(per_token.values())
        return next(s for s in measured if per_token[s] <= quickest * GAIN)

    def size(self, position: int) -> int:
        """The length of the chunk that starts at absolute position `position`: it ends at the
        next multiple of the picked size."""
        step = self.pick()
        return step - position % step

    def ran(self, tokens: int, seconds: float, end: int) -> None:
        """A chunk of `tokens` ending at absolute position `end` took `seconds` of model time."""
        if tokens <= 0 or seconds <= 0:
            return
        new = (tokens, end) not in self._shapes
        self._shapes.add((tokens, end))
        if new and self.new_shapes_slow:
            return
        size = max([s for s in self.sizes if s <= tokens], default=self.sizes[0])
        self.fastest[size] = min(self.fastest.get(size, float("inf")), seconds * size / tokens)
