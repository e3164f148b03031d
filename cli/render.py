"""The JSON documents and human lines of the commands' results (docs/cli.md shows each shape).

Every `*_doc` function (and `asdict`, for results printed as they are) returns plain data that
`Output` writes as JSON (bytes as hex); the human renderers print through Output. Keeping both
here means a JSON shape and its docs change in one place.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from tqstore.engine.receipts import receipt_doc, receipt_line, user_metadata

from .output import Output, ago, seconds, size

# --- entries -------------------------------------------------------------------------------------


def entry_doc(info) -> dict[str, Any]:
    """One entry (tqstore.store.store.EntryInfo)."""
    doc = asdict(info)
    doc["metadata"] = user_metadata(info.metadata)
    doc["quality"] = receipt_doc(info.metadata)  # the save's quality receipt (tqstore/engine/receipts.py)
    return doc


def entry_table(out: Output, entries: list) -> None:
    """`ls`: one row per entry."""
    rows = []
    for e in entries:
        flags = ",".join(f for f, on in (("pinned", e.pinned), ("expired", e.expired), ("sliding", e.sliding)) if on)
        rows.append((e.name, e.tokens, size(e.bytes), e.scheme, _model(e), ago(e.last_used), flags))
    out.table(("NAME", "TOKENS", "SIZE", "SCHEME", "MODEL", "USED", "FLAGS"), rows, align="_rr")


def entry_lines(out: Output, e) -> None:
    """`info`: one field a line."""
    fields = [
        ("name", e.name), ("location", e.location), ("tokens", e.tokens), ("blocks", e.blocks),
        ("size", size(e.bytes)), ("scheme", e.scheme), ("model", e.model_ref),
        ("model source", e.model_source or "-"), ("model digest", e.model_digest[:16]),
        ("created", f"{_when(e.created)} ({ago(e.created)})"), ("last used", ago(e.last_used)),
        ("prefill", seconds(e.prefill_seconds)), ("pinned", "yes" if e.pinned else "no"),
        ("expires", "never" if e.expires is None else _when(e.expires) + (" (expired)" if e.expired else "")),
        ("quality", receipt_line(e.metadata)),
    ]
    if e.sliding:
        fields.append(("sliding window", "yes: reused as a whole entry only"))
    fields += [(f"meta {k}", v) for k, v in sorted(user_metadata(e.metadata).items())]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        out.line(f"{key + ':':<{width + 1}} {value}")


def _when(timestamp: float) -> str:
    """A local date, or the raw timestamp past what the platform's clock can show (an entry
    saved by a version that took any --ttl: 1e23 s overflowed time_t and `info` crashed)."""
    try:
        return time.ctime(timestamp)
    except (OverflowError, ValueError, OSError):
        return f"{timestamp:.0f} s after 1970"


def _model(e) -> str:
    return e.model_source or e.model_ref  # the source is the folder's name or the repo id: short enough for a table


# --- save and ask ----------------------------------------------------------------------------------


def save_doc(result, model: str) -> dict[str, Any]:
    """`save` (tqstore.engine.engine.SaveResult plus the model it used)."""
    return asdict(result) | {"model": model}


def save_line(result) -> str:
    """`save`'s summary."""
    reused = f", {result.reused_tokens} restored from the store" if result.reused_tokens else ""
    return (f"saved {result.name}: {result.tokens} tokens{reused}, {result.scheme}, {result.new_blocks} new blocks "
            f"({size(result.bytes_written)}), prefill {seconds(result.prefill_seconds)}")


def answer_doc(result, **extra: Any) -> dict[str, Any]:
    """`ask` (and each chat turn): tqstore.engine.engine.AskResult without the token ids."""
    doc = {
        "text": result.text, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
        "tier": result.tier, "restore_seconds": result.restore_seconds, "prefill_seconds": result.prefill_seconds,
        "recorded_prefill_seconds": result.recorded_prefill_seconds, "generation_tokens": len(result.tokens),
        "generation_seconds": result.generation_seconds, "finish_reason": result.finish_reason,
        "first_token_seconds": result.first_token_seconds, "model_seconds": result.model_seconds,
    }
    return extra | doc


def answer_line(result, verbose: bool = False) -> str:
    """What the user waited for: time to the first token against what computing the context
    cost, and where the time went (model load, restore, question prefill, generation)."""
    r = result
    if r.cached_tokens == 0:
        line = f"no stored prefix: prefilled all {r.prompt_tokens} prompt tokens in {seconds(r.prefill_seconds)}"
    else:
        line = f"{r.cached_tokens} of {r.prompt_tokens} prompt tokens from {r.tier}"
        if r.tokens:
            line += f": first token after {seconds(r.first_token_seconds)}"
        if r.recorded_prefill_seconds > 0:  # 0: imported, the prefill was never timed here
            line += f" (prefill of the context: {seconds(r.recorded_prefill_seconds)})"
        line += (f"; restore {seconds(r.restore_seconds)}, question prefill {seconds(r.prefill_seconds)}")
    if r.tokens:
        rate = len(r.tokens) / r.generation_seconds if r.generation_seconds > 0 else 0.0
        line += f"; {len(r.tokens)} tokens in {seconds(r.generation_seconds)} ({rate:.1f} tok/s)"
    if r.model_seconds >= 0.05 or (verbose and r.model_seconds > 0):
        line += f"; model load {seconds(r.model_seconds)}"
    return line


# --- transfers and maintenance ---------------------------------------------------------------------


def transfer_line(verb: str, stats) -> str:
    """`push` / `pull`'s summary (tqstore.store.store.TransferStats)."""
    names = ", ".join(stats.entries) if len(stats.entries) <= 3 else f"{len(stats.entries)} entries"
    if not stats.entries:
        return f"nothing to {verb}"
    return (f"{verb}ed {names}: {stats.transferred} of {stats.objects} objects ({size(stats.bytes)}) in "
            f"{seconds(stats.seconds)}, {stats.skipped} already there")


def gc_lines(out: Output, stats) -> None:
    """`gc`'s summary (tqstore.store.store.GcStats)."""
    parts = [f"{len(stats.expired)} expired entries", f"{stats.orphans} unused objects ({size(stats.orphan_bytes)})"]
    if stats.quarantine_cleared:
        parts.append(f"{stats.quarantine_cleared} quarantine records")
    out.note("removed " + ", ".join(parts))
    if stats.remote_expired or stats.remote_orphans or stats.remote_maps:
        out.note(f"bucket: removed {len(stats.remote_expired)} expired entries, {stats.remote_orphans} unused objects "
                 f"({size(stats.remote_orphan_bytes)}), {stats.remote_maps} unused maps "
                 f"({size(stats.remote_map_bytes)})")
    if stats.compact is not None:
        out.note(f"compacted LMDB: {size(stats.compact.bytes_before)} -> {size(stats.compact.bytes_after)}")
    for note in stats.notes:
        out.note(f"note: {note}")


def stats_doc(stats) -> dict[str, Any]:
    """`stats` (tqstore.store.store.StoreStats)."""
    doc = asdict(stats)
    doc["tiers"] = {name: asdict(tier) for name, tier in stats.tiers.items()}
    return doc


def stats_table(out: Output, stats) -> None:
    """`stats`: one row per tier, then the LMDB file."""
    rows = [(name, size(t.bytes), "-" if t.objects is None else t.objects, "-" if t.entries is None else t.entries,
             size(t.budget)) for name, t in stats.tiers.items()]
    out.table(("TIER", "BYTES", "OBJECTS", "ENTRIES", "BUDGET"), rows, align="_rrrr")
    lm = stats.lmdb
    out.line(f"LMDB file: {size(lm.file_bytes)} ({size(lm.used_bytes)} in use, map {size(lm.map_bytes)}), "
             f"{lm.quarantine_count} quarantined objects")
    if stats.remote_error:
        out.line(f"bucket: {stats.remote_error}")


def problem_doc(problem) -> dict[str, Any]:
    """One `verify` finding (tqstore.store.store.Problem)."""
    return asdict(problem)
