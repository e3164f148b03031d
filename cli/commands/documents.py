"""`chunk add` (store documents as reusable chunks) and `ask --doc` (answer over several
stored documents in a given order, each reused wherever it sits)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tqstore.engine.defaults import DEFAULT_RECOMPUTE
from tqstore.errors import BadInput, InvalidName, NotFound
from tqstore.names import validate_name
from tqstore.units import flag_type, parse_number

from .. import arguments
from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("chunk", parents=[common], help="store documents as chunks reusable at any place in a prompt",
                       description="Document chunks: prefilled once after the prompt's prefix, stored by content, "
                                   "and reused by `ask --doc` wherever they sit among other documents.")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    add = verbs.add_parser("add", parents=[common], help="prefill and store each FILE as a chunk",
                           description="Store each FILE as a chunk named after the file (or --name, for one file); "
                                       "a file whose chunk is stored already costs nothing.")
    add.add_argument("files", nargs="+", metavar="FILE")
    add.add_argument("--name", metavar="NAME", help="the chunk's name (one FILE only; default: the file's stem)")
    add.add_argument("--model", "-m", required=True, metavar="M", help="model folder or Hugging Face repo id")
    add.add_argument("--scheme", metavar="S", help="compression scheme (default: the config's store.default_scheme)")
    add.add_argument("--system", metavar="TEXT", help="system prompt the documents follow (part of the chunk's key)")
    add.add_argument("--pin", action="store_true", help="keep the chunks through budget eviction")
    add.set_defaults(func=chunk_add)


def add_document_options(p: argparse.ArgumentParser) -> None:
    """`ask`'s options for composed documents."""
    p.add_argument("--doc", action="append", default=[], metavar="NAME",
                   help="a stored chunk, in prompt order (repeatable; then QUESTION is the only argument)")
    p.add_argument("--doc-file", action="append", default=[], metavar="PATH",
                   help="a document from a file, after the --doc chunks (stored as a chunk on first use)")
    p.add_argument("--recompute", type=flag_type(parse_number, "--recompute", high=1.0), default=DEFAULT_RECOMPUTE,
                   metavar="F",
                   help=f"share of document tokens recomputed in context, 0 to 1 (default {DEFAULT_RECOMPUTE})")
    p.add_argument("--scheme", metavar="S", help="chunk scheme with --doc-file (default: the --doc chunks')")
    p.add_argument("--system", metavar="TEXT", help="system prompt the documents follow")


def chunk_name(path: str) -> str | None:
    """A chunk name from a file name (its stem), or None when the stem is not a valid name."""
    try:
        return validate_name(Path(path).stem)
    except InvalidName:
        return None


def chunk_add(ctx: Context, args: argparse.Namespace) -> int:
    if args.name is not None and len(args.files) != 1:
        raise BadInput("--name names one chunk: pass one FILE with it")
    scheme = arguments.scheme_name(args.scheme)
    texts = [(path, arguments.read_text(path)) for path in args.files]
    names = [validate_name(args.name) if args.name is not None else chunk_name(path) for path, _ in texts]
    _check_distinct(texts, names)
    engine = ctx.engine()
    _check_free(engine.store, [path for path, _ in texts], names)
    with ctx.out.status(f"loading {args.model}"):
        engine.model(args.model)
    added = []
    for (path, text), name in zip(texts, names):
        with ctx.out.status(f"storing {path}"):
            info = engine.add_chunk(name, text, model=args.model, scheme=scheme, system=args.system, pin=args.pin)
        added.append({"file": path, "name": info.name, "tokens": info.tokens, "stored": info.stored,
                      "pinned": info.pinned, "seconds": info.seconds})
        ctx.out.note(f"{info.name}: {info.tokens} tokens, " + (f"prefilled in {info.seconds:.2f} s" if info.stored
                                                                else "stored already")
                     + (", pinned" if info.pinned else ""))
    ctx.out.emit({"chunks": added})
    return 0


def _check_distinct(texts: list[tuple[str, str]], names: list[str | None]) -> None:
    """Refuse two different documents under one chunk name (x/doc.txt and y/doc.txt): the
    second would replace the first, which both reports would still call stored."""
    seen: dict[str, tuple[str, str]] = {}
    for (path, text), name in zip(texts, names):
        if name is None:
            continue
        first = seen.setdefault(name, (path, text))
        if first[1] != text:
            raise BadInput(f"{first[0]} and {path} would both be chunk {name}: add them one at a time with --name")


def _check_free(store, paths: list[str], names: list[str | None]) -> None:
    """Refuse a name held by an entry that is not a chunk before any file is prefilled: the
    files before it were stored, then the command failed half done."""
    from tqstore.engine.chunks import CHUNK_KEY

    for path, name in zip(paths, names):
        if name is None:
            continue
        try:
            metadata = store.get(name).metadata
        except NotFound:
            continue
        if CHUNK_KEY not in metadata:
            raise BadInput(f"entry {name!r} exists and is not a document chunk: add {path} alone with --name "
                           "and another name")


def ask_documents(ctx: Context, args: argparse.Namespace, options: dict) -> int:
    """`ask --doc ...`: QUESTION is the only positional argument."""
    if args.question is not None:  # a usage error (exit 2), as the exit-code table gives for malformed arguments
        args.usage("with --doc or --doc-file, pass only the QUESTION (the documents name the context)")
    from tqstore.engine.chunks import Document  # here: the engine's imports cost a second to `tqstore --version`

    documents = [Document(name=validate_name(n)) for n in args.doc]
    documents += [Document(text=arguments.read_text(path)) for path in args.doc_file]
    scheme = arguments.scheme_name(args.scheme)
    engine = ctx.engine()
    result = engine.ask_documents(documents, args.name, model=args.model, scheme=scheme, system=args.system,
                                  recompute=args.recompute, on_text=ctx.out.stream, **options)
    a = result.answer
    if ctx.out.json_mode:
        ctx.out.document({
            "text": a.text, "prompt_tokens": a.prompt_tokens, "documents": [c.name for c in result.chunks],
            "stored_now": [c.name for c in result.chunks if c.stored], "reused_tokens": result.reused_tokens,
            "recomputed_tokens": result.recomputed_tokens, "prefilled_tokens": result.prefilled_tokens,
            "compose_seconds": result.compose_seconds, "estimated_bytes": result.estimated_bytes,
            "prefill_seconds": a.prefill_seconds,
            "generation_tokens": len(a.tokens), "generation_seconds": a.generation_seconds,
            "finish_reason": a.finish_reason})
    else:
        ctx.out.end_stream()
        stored_now = list(dict.fromkeys(c.name for c in result.chunks if c.stored))
        ctx.out.note(f"{len(result.chunks)} documents composed in {result.compose_seconds:.2f} s: "
                     f"{result.reused_tokens} tokens reused, {result.recomputed_tokens} recomputed, "
                     f"{result.prefilled_tokens} prefilled"
                     + (f"; stored now: {', '.join(stored_now)}" if stored_now else ""))
    return 0
