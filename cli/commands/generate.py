"""`save` (prefill a document once and store it) and `ask` (answer from the stored context)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from tqstore.config import Config
from tqstore.names import validate_name
from tqstore.units import flag_type, parse_integer, parse_number

from .. import arguments, render
from ..context import Context
from . import documents


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("save", parents=[common], help="prefill a document once, compress it, store it as NAME",
                       description="Prefill a document with a model (only what the store lacks of it), compress "
                                   "the KV cache and store it as entry NAME.")
    p.add_argument("name", metavar="NAME", help="the entry's name: letters, digits, . _ - (up to 128)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--file", "-f", metavar="PATH", help="the document (default: stdin)")
    source.add_argument("--prompt", metavar="TEXT", help="the document as text")
    p.add_argument("--model", "-m", required=True, metavar="M", help="model folder or Hugging Face repo id")
    p.add_argument("--scheme", metavar="S", help="compression scheme (default: the config's store.default_scheme, "
                                                 f"{Config.default_scheme} unless set)")
    p.add_argument("--system", metavar="TEXT", help="system prompt placed before the document")
    p.add_argument("--adapter-path", metavar="P", help="LoRA adapter folder (joins the model identity)")
    p.add_argument("--pin", action="store_true", help="keep the entry through budget eviction and expiry")
    p.add_argument("--ttl", type=arguments.duration, metavar="DURATION", help="expire after e.g. 12h or 7d")
    p.add_argument("--meta", type=arguments.key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="user metadata kept with the entry (repeatable)")
    p.set_defaults(func=save)

    p = sub.add_parser("ask", parents=[common], help="answer a question from a stored context (no prefill)",
                       description="Restore entry NAME's KV cache, prefill only the question and stream the answer.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("question", metavar="QUESTION", nargs="?")
    add_generation_options(p)
    documents.add_document_options(p)
    p.set_defaults(func=ask, usage=p.error)


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """--max-tokens, --temp, --top-p, --seed and --model (ask and chat)."""
    p.add_argument("--max-tokens", type=flag_type(parse_integer, "--max-tokens", low=1), default=256, metavar="N",
                   help="answer length limit, 1 or more (default 256)")
    p.add_argument("--temp", type=flag_type(parse_number, "--temp"), default=0.0, metavar="T",
                   help="sampling temperature, 0 or more (default 0: greedy)")
    p.add_argument("--top-p", type=flag_type(parse_number, "--top-p", high=1.0, above=True), default=1.0, metavar="P",
                   help="nucleus sampling, above 0 up to 1 (default 1)")
    # MLX seeds are unsigned 64-bit (the engine's MAX_SEED).
    p.add_argument("--seed", type=flag_type(parse_integer, "--seed", high=(1 << 64) - 1), metavar="S",
                   help="random seed for sampling, 0 to 2**64 - 1")
    p.add_argument("--model", "-m", metavar="M", help="the model (default: the one the entry was saved with)")


def generation_options(args: argparse.Namespace) -> dict:
    """The Engine.ask options of --max-tokens, --temp, --top-p and --seed."""
    return {"max_tokens": args.max_tokens, "temp": args.temp, "top_p": args.top_p, "seed": args.seed}


def save(ctx: Context, args: argparse.Namespace) -> int:
    name = validate_name(args.name)
    scheme = arguments.scheme_name(args.scheme)
    text = arguments.document(args.file, args.prompt)
    engine = ctx.engine()
    with ctx.out.status(f"loading {args.model}"):
        engine.model(args.model, args.adapter_path)
    with ctx.out.progress("prefill", unit="tok") as progress:
        result = engine.save(name, text, model=args.model, scheme=scheme, system=args.system,
                             adapter_path=args.adapter_path, progress=progress, pin=args.pin, ttl=args.ttl,
                             metadata=dict(args.meta) or None)

    def human() -> None:
        ctx.out.note(render.save_line(result))
        for evicted in result.evicted:
            ctx.out.note(f"evicted {evicted} to stay within the LMDB budget")
        for warning in result.warnings:
            ctx.out.note(f"warning: {warning}")

    ctx.out.emit(render.save_doc(result, args.model), human)
    return 0


def ask(ctx: Context, args: argparse.Namespace) -> int:
    options = generation_options(args)
    if args.doc or args.doc_file:
        return documents.ask_documents(ctx, args, options)
    if args.question is None:
        args.usage("pass NAME and QUESTION (or --doc NAME ... QUESTION)")  # a usage error: exit 2
    name = validate_name(args.name)
    engine = ctx.engine()
    start = time.perf_counter()
    with ctx.out.status("loading the model"):
        engine.model_for(name, args.model)
    loading = time.perf_counter() - start
    result = engine.ask(name, args.question, model=args.model, on_text=ctx.out.stream, **options)
    # The engine times only its own load, which found the model loaded: report the one done here.
    result = replace(result, model_seconds=result.model_seconds + loading)
    if ctx.out.json_mode:
        ctx.out.document(render.answer_doc(result, name=name))
    else:
        ctx.out.end_stream()
        ctx.out.note(render.answer_line(result, ctx.out.verbose))
        manifest = engine.store.get(name)
        if manifest.expired(time.time()):  # else "no stored prefix" would read as a lost entry
            # Its blocks may still come from a live entry sharing them (a chat turn of it, say).
            used = "was not used" if result.cached_tokens == 0 else "came only from other entries sharing it"
            ctx.out.note(f"entry {name} expired at {time.ctime(manifest.expires)}, so its stored context {used}: "
                         "save it again (or pin it) to keep it")
    return 0
