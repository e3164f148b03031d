"""`export` and `import`: one entry as a single file (a portable bundle, or mlx-lm's format)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tqstore.errors import BadInput, NotFound
from tqstore.names import validate_name

from .. import arguments, render
from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("export", parents=[common], help="write an entry to one file",
                       description="Write entry NAME to FILE: a portable tqstore bundle (the manifest and every "
                                   "block; `tqstore import` reads it anywhere), or with --mlx-lm an mlx-lm "
                                   "prompt-cache file (.safetensors; entries of scheme raw or affine8 only).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--mlx-lm", action="store_true", help="write mlx-lm's prompt-cache format")
    p.set_defaults(func=export)

    p = sub.add_parser("import", parents=[common], help="store an entry from a bundle or an mlx-lm cache file",
                       description="Store FILE as entry NAME: a tqstore bundle (verified in full, stored as it is), "
                                   "or an mlx-lm prompt-cache file (needs --model; --scheme compresses it).")
    p.add_argument("file", metavar="FILE")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--model", "-m", metavar="M", help="the model an mlx-lm file was made with")
    p.add_argument("--scheme", metavar="S", help="compress an mlx-lm file's raw caches to this scheme")
    p.add_argument("--adapter-path", metavar="P", help="the LoRA adapter an mlx-lm file was made with "
                                                       "(mlx_lm.cache_prompt --adapter-path)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", metavar="TEXT", help="the text an mlx-lm file was made from (mlx-lm files do not "
                                                       "record token ids; files tqstore exported do)")
    text.add_argument("--prompt-file", metavar="PATH", help="the same, from a file")
    p.add_argument("--system", metavar="TEXT", help="the system prompt the text was framed with, if any")
    p.set_defaults(func=import_)


def export(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.exchange import portable

    name = validate_name(args.name)
    if Path(args.file).is_dir():
        raise BadInput(f"{args.file} is a folder: pass the file to write")
    if args.mlx_lm:
        result = portable.export_mlx_lm(ctx.store(), name, args.file)
    else:
        result = portable.export_bundle(ctx.store(), name, args.file)
    ctx.out.emit(render.asdict(result), lambda: ctx.out.note(
        f"exported {name} ({result.tokens} tokens) to {result.path} ({render.size(result.bytes)}, {result.format})"))
    return 0


def import_(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.exchange import portable

    name = validate_name(args.name)
    if not Path(args.file).is_file():
        raise NotFound(f"no such file: {args.file}")
    if portable.is_bundle(args.file):
        if args.model or args.scheme or args.prompt is not None or args.prompt_file or args.system is not None:
            raise BadInput("a bundle is imported as it is: --model, --scheme, --prompt and --system are for mlx-lm "
                           "files")
        result = portable.import_bundle(ctx.store(), args.file, name)
    elif Path(args.file).suffix == portable.MLX_LM_SUFFIX:
        if not args.model:
            raise BadInput("importing an mlx-lm prompt-cache file needs the model it was made with: --model M")
        text = args.prompt if args.prompt is not None else (
            arguments.read_text(args.prompt_file) if args.prompt_file else None)
        scheme = arguments.scheme_name(args.scheme)
        result = portable.import_mlx_lm(ctx.engine(), args.file, name, model=args.model, scheme=scheme, text=text,
                                        system=args.system, adapter_path=args.adapter_path)
    else:
        raise BadInput(f"{args.file} is neither a tqstore bundle nor an mlx-lm prompt-cache file "
                       f"({portable.MLX_LM_SUFFIX})")

    def human() -> None:
        ctx.out.note(f"imported {result.name}: {result.tokens} tokens, {result.scheme}, {result.new_blocks} of "
                     f"{result.blocks} blocks new")
        for warning in result.warnings:
            ctx.out.note(f"warning: {warning}")

    ctx.out.emit(render.asdict(result), human)
    return 0
