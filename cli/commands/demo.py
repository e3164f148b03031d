"""`demo`: the whole tour on a shipped public-domain document (the README's main command).

Installs the offline model if needed (saying first what it downloads), saves the document as
entry `demo`, asks two questions, and shows what the restore saved against the prefill.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

from .. import arguments, render
from ..context import Context
from ..output import seconds
from .models import install

DEMO_MODEL = "qwen2.5-coder-0.5b"
ENTRY = "demo"
QUESTIONS = ("According to the dictionary, what is an abstainer?",
             "How does the dictionary define an absolute monarchy?")
MAX_TOKENS = 48


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="the tour: save a shipped document, ask two questions",
                       description=f"Install {DEMO_MODEL} if needed, save a public-domain document (from The "
                                   "Devil's Dictionary) as entry 'demo', ask two questions about it, and compare the "
                                   "prefill time with the restore time.")
    # For tests and offline trials: another model folder or document instead of the shipped ones.
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--document", help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=argparse.SUPPRESS)
    p.set_defaults(func=demo)


def shipped_document() -> str:
    """The demo document shipped inside the tqstore package."""
    return resources.files("tqstore").joinpath("data/devils_dictionary.txt").read_text(encoding="utf-8")


def demo(ctx: Context, args: argparse.Namespace) -> int:
    out = ctx.out
    model = args.model
    if model is None:
        path, _ = install(out, DEMO_MODEL, ctx.home)
        model = str(path)
    text = arguments.read_text(args.document) if args.document else shipped_document()
    _blas_hint(ctx)
    engine = ctx.engine()
    with out.status(f"loading {model}"):
        loaded = engine.model(model)
    stored = _stored_demo(engine.store, loaded, text)
    if stored is not None:
        out.note(f"1. entry '{ENTRY}' already holds this document ({len(stored.tokens)} tokens, {stored.scheme})")
        tokens, scheme, prefill = len(stored.tokens), stored.scheme, stored.prefill_seconds
    else:
        out.note(f"1. saving the document as entry '{ENTRY}' (prefill once, compress, store)")
        with out.progress("prefill", unit="tok") as progress:
            saved = engine.save(ENTRY, text, model=model, progress=progress)
        out.note("   " + render.save_line(saved))
        tokens, scheme, prefill = saved.tokens, saved.scheme, saved.recorded_prefill_seconds
    answers = []
    for i, question in enumerate(QUESTIONS, start=2):
        out.note(f"{i}. tqstore ask {ENTRY} \"{question}\"")
        result = engine.ask(ENTRY, question, max_tokens=args.max_tokens, on_text=out.stream)
        if not out.json_mode:
            out.end_stream()
        out.note("   " + render.answer_line(result))
        answers.append(render.answer_doc(result, question=question))
    out.note(f"computing the context cost {seconds(prefill)} once; each question restored it instead. Next: "
             f"`tqstore ask {ENTRY} \"...\"` (restores from the SSD tier), `tqstore ls`, `tqstore push {ENTRY}`")
    out.emit({"model": model, "entry": ENTRY, "tokens": tokens, "scheme": scheme, "saved": stored is None,
              "prefill_seconds": prefill, "answers": answers, "blas": _active_blas()})
    return 0


def _stored_demo(store, loaded, text: str):
    """The `demo` entry if it already holds `text` for this model (a second run skips the save,
    and keeps the prefill time the first run recorded)."""
    from tqstore.errors import NotFound

    try:
        manifest = store.get(ENTRY)
    except NotFound:
        return None
    tokens = loaded.prompt.context_tokens(loaded.tokenizer, text)
    same = manifest.model_digest == loaded.identity.digest and list(manifest.tokens) == tokens
    return manifest if same and not manifest.expired(time.time()) else None


def _active_blas() -> str:
    from tqstore.models.blas import active_blas

    return active_blas()


def _blas_hint(ctx: Context) -> None:
    """Point at --blas openblas where it works and is not in use (CPU prefill is far faster)."""
    import mlx.core as mx

    from tqstore.errors import ConfigError
    from tqstore.models.blas import active_blas, openblas_environment

    if active_blas() == "openblas" or mx.default_device() != mx.cpu:
        return
    try:
        openblas_environment()
    except ConfigError:
        return
    ctx.out.note("tip: this machine can run the CPU matmuls on OpenBLAS, several times faster: "
                 "tqstore demo --blas openblas")
