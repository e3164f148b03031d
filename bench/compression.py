"""Stored bytes per token of every scheme for one real context, against fp16.

    python bench/compression.py --openblas            # writes the compression table of every scheme

The real model prefills the context once (uncompressed); each scheme compresses that prefix and
stores it in a throwaway home; the table is the entry's stored bytes (every object: blocks,
per-entry window, shared codecs) per token.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_MODEL, DEFAULT_TEXT, git_revision, load_real_model, machine_line,  # noqa: E402
                    markdown_table, replace_section, text_tokens, use_openblas)
from quality import ALL_SCHEMES  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    args = parser.parse_args(argv[1:])
    if args.openblas:
        use_openblas(argv)

    import mlx.core as mx

    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import TurboQuantKVCache, make_prompt_cache, restore_as, snapshot
    from turboquant.quality import bits_per_element, raw_prefix

    model, tokenizer = load_real_model(args.model)
    tokens = text_tokens(tokenizer, args.text, args.tokens)
    raw = raw_prefix(model, mx.array(tokens))
    root = Path(tempfile.mkdtemp(prefix="tqstore-compression-"))
    identity = ModelIdentity.from_path(args.model, root / "digests", kv_dtype="float32")
    fp16 = None
    rows = []
    try:
        store = Store.open(root / "home", config=load_config(root / "home"))
        for scheme in ALL_SCHEMES:
            caches = restore_as(raw, make_prompt_cache(model, scheme))
            for c in caches:
                if isinstance(c, TurboQuantKVCache):
                    c.compress()
            snap = snapshot(caches)
            codec = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme)
            stored = store.put(scheme, snap, tokens, model=identity, codec=codec, model_ref=str(args.model),
                               prefill_seconds=0.0).manifest.nbytes
            bits = bits_per_element(caches)
            if fp16 is None:
                fp16 = sum(2 * r.arrays["keys"].shape[1] * (r.arrays["keys"].shape[3] + r.arrays["values"].shape[3])
                           for r in raw.layers) * len(tokens)
            rows.append([scheme, f"{stored / len(tokens):.0f}", f"{fp16 / stored:.2f}", f"{bits:.2f}",
                         f"{16 / bits:.2f}"])
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    command = "python bench/compression.py " + " ".join(argv[1:])
    body = (markdown_table(["scheme", "stored B/token (this run)", "x fp16 (this run)", "bits/element at fp16",
                            "x fp16 at fp16 activations"], rows)
            + f"\n\n{len(tokens)} tokens of {args.text.name}; fp16 KV is {fp16 / len(tokens):.0f} B/token. The model "
            "runs in float32 here, so native rows (raw, the K of turbo0vN) and affine scales are float32 in the "
            "stored bytes; the last two columns count them at fp16 activations, as on a Mac (the tables of "
            f"docs/quality.md). Command: `{command}` (git {git_revision()}, {datetime.date.today()}). "
            f"Machine: {machine_line()}.")
    print(body)
    replace_section(args.out, "bench-compression-all", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
