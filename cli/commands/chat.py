"""`chat NAME`: questions from stdin, one turn each, every finished turn saved as a child entry.

Turns are named NAME.turn-1, NAME.turn-2, ...; a NAME too long for that within the 128-character
name rule is shortened and tagged with a hash of the whole NAME (`turn_name`), so its turns never
take those of the entry its shortened start spells. Numbering continues after the newest existing
turn of NAME, so a new conversation never overwrites an earlier one. `chat NAME.turn-4` (or
`chat NAME --resume`) continues a conversation; its turns keep NAME's numbering.

Which conversation a turn belongs to is read from the `chat.parent` metadata every turn carries
(`conversation_base`), not from its name alone: `--resume` only continues a turn of NAME's own.

Two chats on one entry at once: each turn name is claimed before its turn is answered (an flock on
HOME/chat-claims/TURN, `claim_turn`) and held until the turn is stored; a name stored or claimed
already is skipped, so each session stores into the next free number and says which it used.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tqstore.errors import BadInput, NotFound, TqstoreError
from tqstore.names import MAX_NAME_LENGTH, validate_name

from .. import render
from ..context import Context
from .generate import add_generation_options, generation_options

TURN = re.compile(r"(.+)\.turn-(\d+)", re.ASCII)
TAG_DIGITS = 8  # hex digits of sha256(NAME) in the turn names of a shortened NAME
CLAIMS = "chat-claims"  # HOME's folder of the turn names being answered (one flock'ed file each)


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("chat", parents=[common], help="an interactive conversation on a stored context",
                       description="Ask questions line by line (an empty line or end of input ends the chat). "
                                   "Each finished turn is saved as entry NAME.turn-N, sharing NAME's blocks.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--resume", action="store_true", help="continue from NAME's newest turn (NAME.turn-N)")
    add_generation_options(p)
    p.set_defaults(func=chat)


def turn_name(base: str, n: int) -> str:
    """The name of turn `n` of a conversation on `base`: `base.turn-N`, or where that is over the
    name rule's length, `base` shortened and tagged with its hash (`PREFIX-1a2b3c4d.turn-N`, exactly
    128 characters), not the turns of the entry that shortened start spells."""
    suffix = f".turn-{n}"
    if len(base) + len(suffix) <= MAX_NAME_LENGTH:
        return base + suffix
    tag = "-" + hashlib.sha256(base.encode()).hexdigest()[:TAG_DIGITS]
    return base[:MAX_NAME_LENGTH - len(suffix) - len(tag)] + tag + suffix


def turn_number(name: str) -> int | None:
    """N of a name shaped like a turn's (`….turn-N`), else None."""
    match = TURN.fullmatch(name)
    return int(match.group(2)) if match else None


def newest_turn(names: list[str], base: str) -> int:
    """The highest N of the existing entries turn_name(base, N), or 0."""
    present = set(names)
    turns = (turn_number(name) for name in present)
    return max((n for n in turns if n is not None and turn_name(base, n) in present), default=0)


def _metadata(store, name: str) -> dict[str, str] | None:
    """Entry `name`'s metadata; None where no readable entry has that name."""
    try:
        return dict(store.get(name).metadata)
    except TqstoreError:  # NotFound, a damaged manifest, a name that is no valid name
        return None


def _parents(store, name: str) -> Iterator[tuple[str, dict[str, str] | None]]:
    """The `chat.parent` chain above entry `name`, nearest first: each parent's name and metadata
    (None: no longer stored, which ends the chain, as does a parent that is no chat turn)."""
    from tqstore.engine.generation import CHAT_PARENT  # set on every saved turn

    seen = {name}
    metadata = _metadata(store, name)
    while metadata is not None and (parent := metadata.get(CHAT_PARENT)) and parent not in seen:
        seen.add(parent)
        metadata = _metadata(store, parent)
        yield parent, metadata


def conversation_base(store, name: str) -> str:
    """The entry whose turns continue entry `name`'s conversation: `name` itself unless it is a
    chat turn; for a turn, the ancestor it was named after (`turn_name(ancestor, N) == name`,
    following `chat.parent`), else the chain's first entry that is no turn. Where a removed turn
    broke the chain, an entry whose turn N is `name`, else the base its name spells."""
    from tqstore.engine.generation import CHAT_PARENT

    n = turn_number(name)
    metadata = _metadata(store, name)
    if n is None or metadata is None or CHAT_PARENT not in metadata:
        return name
    parent = None
    for parent, parent_metadata in _parents(store, name):
        if turn_name(parent, n) == name:
            return parent
        if parent_metadata is not None and CHAT_PARENT not in parent_metadata:
            return parent  # the conversation's root (a turn named by an older tqstore)
    if parent is not None and _metadata(store, parent) is not None:
        return name  # a cycle of parents: nothing to go by
    spelled = TURN.fullmatch(name).group(1)
    named = [e.name for e in store.ls() if turn_name(e.name, n) == name]
    return named[0] if named else spelled if turn_name(spelled, n) == name else name


def resumed_turn(store, names: list[str], base: str) -> str | None:
    """The newest turn of `base`'s own conversations (`--resume`): an entry named
    turn_name(base, N) that another conversation stored, or that is no chat turn, is passed over."""
    present = set(names)
    numbers = sorted({n for n in map(turn_number, present) if n is not None and turn_name(base, n) in present},
                     reverse=True)
    return next((turn_name(base, n) for n in numbers if conversation_base(store, turn_name(base, n)) == base), None)


class Claim:
    """Turn name `name`, claimed by this chat until its turn is stored: an exclusive flock on
    HOME/chat-claims/NAME (released by the kernel if the process dies), the file removed on release."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def take(cls, folder: Path, name: str) -> Claim | None:
        """The claim on `name`, or None while another chat holds it."""
        path = folder / name
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                held = os.fstat(fd)
                now = os.stat(path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    return cls(path, fd)
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file its holder removed on release: claim the path's current file

    def release(self) -> None:
        try:
            os.unlink(self.path)  # while still locked: a chat that opened it meanwhile sees it removed
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)


def _stored(store, name: str) -> bool:
    """Whether an entry (even a damaged one) has `name`: a turn never replaces one."""
    try:
        store.get(name)
    except NotFound:
        return False
    except TqstoreError:
        return True
    return True


def claim_turn(store, base: str, after: int) -> tuple[int, Claim]:
    """The first turn number of `base` above `after` and above its newest stored turn whose name
    is neither stored nor claimed by another chat, with this chat's claim on it. The name is
    checked again once claimed: a chat stores its turn before releasing the claim."""
    folder = Path(store.tiers.config.home) / CLAIMS
    folder.mkdir(exist_ok=True)
    n = max(after, newest_turn([e.name for e in store.ls()], base))
    while True:
        n += 1
        name = turn_name(base, n)
        if _stored(store, name):
            continue
        claim = Claim.take(folder, name)
        if claim is None:
            continue  # another chat is answering this turn now
        if not _stored(store, name):
            return n, claim
        claim.release()  # stored while we looked


def chat(ctx: Context, args: argparse.Namespace) -> int:
    name = validate_name(args.name)
    options = generation_options(args)
    engine = ctx.engine()
    store = engine.store
    store.get(name)  # NotFound before anything else
    if sys.stdin is None:  # a daemon or cron job started without one
        raise BadInput("no questions: chat reads them from stdin, which is closed; pipe them in, or use "
                       "`tqstore ask NAME QUESTION`")
    base = conversation_base(store, name)
    names = [e.name for e in store.ls()]
    n = newest_turn(names, base)
    current = (resumed_turn(store, names, base) or name) if args.resume else name
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
        expected = turn_name(base, n + 1)
        n, claim = claim_turn(store, base, n)
        child = claim.name
        try:
            result = engine.chat_turn(current, question, child, model=args.model,
                                      on_text=out.stream, **options)
        finally:
            claim.release()
        if out.json_mode:
            out.json_line(render.answer_doc(result, name=child, parent=current))
        else:
            out.end_stream()
            out.note(render.answer_line(result, out.verbose))
            if child != expected:
                out.note(f"{expected} was taken by another chat meanwhile: this turn is saved as {child}")
        current = child
    if current != first:
        out.note(f"conversation saved up to {current}: continue it with `tqstore chat {current}`")
    return 0
