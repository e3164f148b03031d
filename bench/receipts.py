"""What a quality receipt costs at save: the probe's seconds against the whole save's.

    python bench/receipts.py --openblas                    # tiny model, and the real one if installed
    python bench/receipts.py --openblas --no-real --runs 3
    python bench/receipts.py --openblas --schemes turbo4 turbo5v4 auto3.5 --real-schemes turbo4 auto3.5

Saves one document per run into a fresh store (tiny random-weight qwen2: 1,000 tokens; the real
Qwen2.5-Coder-0.5B in float32: 2,048 tokens of the Devil's Dictionary) and reads the probe's
seconds from the entry's receipt (tqstore/engine/receipts.py), one row per model and scheme
(--real-schemes limits the real model's, whose saves take minutes). Writes the table into
docs/quality.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import DEFAULT_MODEL, DEFAULT_TEXT, LICENCE_CHARS, markdown_table, replace_section, stamp, use_openblas  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "quality.md"


def save_once(home: Path, model: str, text: str, scheme: str) -> tuple[float, float, float, int]:
    """(save seconds, probe seconds, receipt KL, tokens) of one save into a fresh store."""
    from tqstore import Store
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.engine.receipts import Receipt

    store = Store.open(home, config=load_config(home))
    try:
        engine = Engine(store)
        engine.model(model)  # loading is not part of the save
        t0 = time.perf_counter()
        result = engine.save("doc", text, model=model, scheme=scheme)
        seconds = time.perf_counter() - t0
        receipt = Receipt.from_metadata(store.get("doc").metadata)
        return seconds, receipt.seconds, receipt.kl, result.tokens
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--schemes", nargs="+", help="default: the config's default scheme")
    parser.add_argument("--real-schemes", nargs="+", help="the real model's schemes (default: --schemes)")
    parser.add_argument("--no-real", action="store_true", help="the tiny model only")
    parser.add_argument("--openblas", action="store_true", help="preload Debian's OpenBLAS (AVX-512 CPUs)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv[1:])
    if args.schemes is None:
        from dataclasses import fields

        from tqstore.config import Config

        args.schemes = [next(f.default for f in fields(Config) if f.name == "default_scheme")]
    if args.openblas:
        use_openblas(argv)
    from model_folder import CORPUS, write_model_folder

    rows = []
    with tempfile.TemporaryDirectory(prefix="tqstore-receipts-") as tmp:
        models = [("tiny qwen2 (random weights)", str(write_model_folder(Path(tmp) / "tiny", "qwen2")),
                   (CORPUS + " ") * 40, 1000, args.schemes)]
        if not args.no_real and DEFAULT_MODEL.exists():
            text = DEFAULT_TEXT.read_text(errors="replace")[LICENCE_CHARS:]
            models.append(("Qwen2.5-Coder-0.5B, float32", str(DEFAULT_MODEL), text, 2048,
                           args.real_schemes or args.schemes))
        for label, path, text, n, schemes in models:
            text = _first_tokens(path, text, n)
            for scheme in schemes:
                runs = [save_once(Path(tmp) / f"home-{label[:4]}-{scheme}-{i}", path, text, scheme)
                        for i in range(args.runs)]
                save = [r[0] for r in runs]
                probe = [r[1] for r in runs]
                share = [100 * p / s for p, s in zip(probe, save)]
                rows.append((label, scheme, runs[0][3], _span(save, "{:.2f}"), _span(probe, "{:.2f}"),
                             _span(share, "{:.1f}"), _span([r[2] for r in runs], "{:.4f}")))
                print(rows[-1], flush=True)
    table = markdown_table(["model", "scheme", "tokens", "save s", "probe s", "probe % of save", "receipt KL"], rows)
    print(table)
    if not args.no_write:
        replace_section(DOC, "quality-receipts", f"{table}\n\n{args.runs} runs each, ranges. {stamp(argv)}")
    return 0


def _first_tokens(model: str, text: str, n: int) -> str:
    """The prefix of `text` that the model's tokenizer makes about n tokens of."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer.decode(tokenizer.encode(text)[:n])


def _span(values: list[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


if __name__ == "__main__":
    sys.exit(main())
