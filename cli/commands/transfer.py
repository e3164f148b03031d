"""`push` and `pull`: moving entries between the local store and the bucket (s3.url)."""

from __future__ import annotations

import argparse

from tqstore.names import validate_name

from .. import render
from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("push", parents=[common], help="upload entries to the bucket",
                       description="Upload entry NAME (or every local entry with --all) to the bucket in s3.url: "
                                   "blocks the bucket holds are not sent again.")
    p.add_argument("name", metavar="NAME", nargs="?")
    p.add_argument("--all", action="store_true", help="push every local entry")
    p.set_defaults(func=push, usage=p.error)

    p = sub.add_parser("pull", parents=[common], help="download an entry from the bucket",
                       description="Download entry NAME from the bucket, verifying every block (a local entry "
                                   "of that name is replaced).")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=pull)


def push(ctx: Context, args: argparse.Namespace) -> int:
    if (args.name is None) == (not args.all):
        args.usage("push NAME, or push --all for every local entry")  # a usage error: exit 2
    name = None if args.all else validate_name(args.name)
    with ctx.out.progress("push", unit="objects") as progress:
        stats = ctx.store().push(name, progress)
    _report(ctx, "push", stats)
    return 1 if stats.conflicts else 0  # the others went up; the warnings say why these did not


def pull(ctx: Context, args: argparse.Namespace) -> int:
    name = validate_name(args.name)
    with ctx.out.progress("pull", unit="objects") as progress:
        stats = ctx.store().pull(name, progress)
    _report(ctx, "pull", stats)
    return 0


def _report(ctx: Context, verb: str, stats) -> None:
    def human() -> None:
        ctx.out.note(render.transfer_line(verb, stats))
        for name in stats.up_to_date:
            ctx.out.detail(f"{name} was already in the bucket")
        for name in stats.evicted:
            ctx.out.note(f"evicted {name} to stay within the LMDB budget")
        for warning in stats.warnings:
            ctx.out.note(f"warning: {warning}")

    ctx.out.emit(render.asdict(stats), human)
