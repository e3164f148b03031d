"""Quality receipts: what an entry's compression costs, measured at save on its own text.

At save the last PROBE_TOKENS tokens of the context are run again through the full model twice,
after the prefill and without changing it: once against the uncompressed caches they were
computed with (the reference), and once against the entry as it is stored (its snapshot
restored); both times the caches drop those tokens first and take them again as one chunk. The mean full-vocabulary KL(p_reference || p_entry) and the top-1
agreement over those positions are the receipt, kept in the entry's metadata (so it travels
with the manifest through push and pull) and shown by `tqstore info` and `ls --json`.

An uncompressed (raw) entry measures exactly 0. What the reference is: the caches the probed
tokens were computed with, so when a stored prefix was restored rather than prefilled, its
compression is in both sides and only the newly compressed rows are measured. Entries saved
before receipts, through other paths (chat turns, the server's cache of generated turns), or of
models whose caches cannot drop tokens (recurrent layers, full sliding windows) have none:
"not measured".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # the model stack (mlx) loads only where a probe runs: `info`/`ls` never do
    import mlx.core as mx

PROBE_TOKENS = 32
KEYS = ("quality.kl", "quality.top1", "quality.tokens", "quality.seconds")


@dataclass(frozen=True)
class Receipt:
    """The probe's result: mean KL (nats per position) and top-1 agreement over `tokens`
    positions, and the seconds the probe added to the save."""

    kl: float
    top1: float
    tokens: int
    seconds: float

    def metadata(self) -> dict[str, str]:
        """The entry-metadata form (strings; KL with enough digits for 0.0001-level receipts)."""
        return dict(zip(KEYS, (f"{self.kl:.6g}", f"{self.top1:.4f}", str(self.tokens), f"{self.seconds:.3f}")))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> "Receipt | None":
        """The receipt an entry's metadata holds, or None (not measured, or unreadable)."""
        try:
            kl, top1, tokens, seconds = (metadata[k] for k in KEYS)
            return cls(float(kl), float(top1), int(tokens), float(seconds))
        except (KeyError, ValueError):
            return None

    def describe(self) -> str:
        return f"KL {self.kl:.4f}, top-1 {self.top1:.3f} over the last {self.tokens} tokens"


def user_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """An entry's metadata without the receipt's keys (shown apart, as `quality`)."""
    return {k: v for k, v in metadata.items() if k not in KEYS}


def receipt_doc(metadata: Mapping[str, str]) -> dict[str, Any]:
    """The JSON shape of an entry's receipt: {"measured": false} when it has none."""
    r = Receipt.from_metadata(metadata)
    if r is None:
        return {"measured": False}
    return {"measured": True, "kl": r.kl, "top1": r.top1, "tokens": r.tokens, "seconds": r.seconds}


def receipt_line(metadata: Mapping[str, str]) -> str:
    """The human line of an entry's receipt."""
    r = Receipt.from_metadata(metadata)
    return "not measured" if r is None else r.describe()


def probe_length(new_tokens: int, caches: list[Any], recurrent: bool) -> int:
    """How many of the newly prefilled tokens the probe re-scores (0: no receipt)."""
    if recurrent or not all(c.is_trimmable() for c in caches):
        return 0
    return min(PROBE_TOKENS, max(new_tokens - 1, 0))


def logprobs(model, caches: list[Any], tokens: Sequence[int]) -> mx.array:
    """Next-token log-probabilities [n, V] (float32) of `tokens` fed after what `caches` hold."""
    import mlx.core as mx

    logits = model(mx.array(tokens)[None], cache=caches)[0].astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def reference(model, prefilled: list[Any], tokens: Sequence[int]) -> tuple[mx.array, float]:
    """Log-probabilities of `tokens` (the context's last ones) against the uncompressed caches
    they were prefilled into (`prefilled`, a copy taken before compression that shares their
    arrays: `Context.copy`), and the seconds this took. The caches themselves are left as they
    are, so the entry is byte-identical to one saved without a receipt."""
    t0 = time.perf_counter()
    for cache in prefilled:
        cache.trim(len(tokens))
    out = logprobs(model, prefilled, tokens)
    return out, time.perf_counter() - t0


def measure(model, stored: list[Any], tokens: Sequence[int], reference: mx.array, seconds: float) -> Receipt:
    """Re-score `tokens` (the context's last ones) against `stored` (the restored entry, which
    holds them: they are trimmed off first) and compare with `reference`. `seconds` is the time
    the reference pass already added; the receipt records the total."""
    import mlx.core as mx

    t0 = time.perf_counter()
    for cache in stored:
        cache.trim(len(tokens))
    probe = logprobs(model, stored, tokens)
    kl = mx.mean(mx.sum(mx.exp(reference) * (reference - probe), axis=-1)).item()
    top1 = mx.mean(mx.argmax(reference, axis=-1) == mx.argmax(probe, axis=-1)).item()
    # float32 rounding can leave an exactly matching probe at -1e-9: a receipt is never negative.
    return Receipt(max(kl, 0.0), top1, len(tokens), seconds + time.perf_counter() - t0)
