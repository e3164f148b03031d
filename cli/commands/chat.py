"""`chat NAME`: questions from stdin, one turn each, every finished turn saved as a child entry.

Turns are named NAME.turn-1, NAME.turn-2, ...; numbering continues after the newest existing
turn of NAME, so a new conversation never overwrites an earlier one. `chat NAME.turn-4` (or
`chat NAME --resume`) continues a conversation; its turns keep NAME's numbering.
"""

from __future__ import annotations

import argparse
import re
import sys

from tqstore.names import MAX_NAME_LENGTH, validate_name

from .. import render
from ..context import Context
from .generate import add_generation_options, generation_options

TURN = re.compile(r"(.+)\.turn-(\d+)", re.ASCII)


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("chat", parents=[common], help="an interactive conversation on a stored context",
                       description="Ask questions line by line (an empty line or end of input ends the chat). "
                                   "Each finished turn is saved as entry NAME.turn-N, sharing NAME's blocks.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--resume", action="store_true", help="continue from the newest NAME.turn-N")
    add_generation_options(p)
    p.set_defaults(func=chat)


def turn_name(base: str, n: int) -> str:
    """The name of turn `n` of a conversation on `base`, shortened to fit the name rule."""
    suffix = f".turn-{n}"
    return base[:MAX_NAME_LENGTH - len(suffix)] + suffix


def newest_turn(names: list[str], base: str) -> int:
    """The highest N of the existing entries turn_name(base, N), or 0."""
    turns = [int(m.group(2)) for m in map(TURN.fullmatch, names) if m]
    return max((n for n in turns if turn_name(base, n) in names), default=0)


def conversation_base(name: str, metadata: dict[str, str]) -> str:
    """The entry a conversation's turns are numbered after (a turn continues its own base)."""
    from tqstore.engine.generation import CHAT_PARENT  # set on every saved turn

    match = TURN.fullmatch(name)
    if match and CHAT_PARENT in metadata and turn_name(match.group(1), int(match.group(2))) == name:
        return match.group(1)
    return name


def chat(ctx: Context, args: argparse.Namespace) -> int:
    name = validate_name(args.name)
    options = generation_options(args)
    engine = ctx.engine()
    store = engine.store
    base = conversation_base(name, dict(store.get(name).metadata))
    n = newest_turn([e.name for e in store.ls()], base)
    current = turn_name(base, n) if args.resume and n else name
    with ctx.out.status("loading the model"):
        engine.model_for(current, args.model)
    out = ctx.out
    prompt = sys.stdin.isatty() and not out.json_mode
    first = current
    while True:
        if prompt:
            out.stderr.write("> ")
            out.stderr.flush()
        line = sys.stdin.readline()
        question = line.strip()
        if not question:
            break
        n += 1
        child = turn_name(base, n)
        result = engine.chat_turn(current, question, child, model=args.model,
                                  on_text=out.stream, **options)
        if out.json_mode:
            out.json_line(render.answer_doc(result, name=child, parent=current))
        else:
            out.end_stream()
            out.note(render.answer_line(result, out.verbose))
        current = child
    if current != first:
        out.note(f"conversation saved up to {current}: continue it with `tqstore chat {current}`")
    return 0
