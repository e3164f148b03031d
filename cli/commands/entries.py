"""Looking after the stored entries: ls, info, rm, pin, unpin, gc, stats, verify, repair."""

from __future__ import annotations

import argparse

from tqstore.names import validate_name

from .. import render
from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ls", parents=[common], help="list the entries", description="List the local entries "
                       "(or the bucket's with --remote).")
    p.add_argument("--remote", action="store_true", help="list the bucket's entries")
    p.set_defaults(func=ls)

    p = sub.add_parser("info", parents=[common], help="show one entry", description="Show one entry's details.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--remote", action="store_true", help="the bucket's entry")
    p.set_defaults(func=info)

    p = sub.add_parser("rm", parents=[common], help="remove an entry",
                       description="Remove entry NAME and the blocks no other entry uses (--remote: the bucket's "
                                   "entry; its blocks go at the next `gc --remote`).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--remote", action="store_true", help="remove the bucket's entry")
    p.set_defaults(func=rm)

    for verb, pinned, text in (("pin", True, "keep an entry through budget eviction and expiry"),
                               ("unpin", False, "let an entry be evicted again")):
        p = sub.add_parser(verb, parents=[common], help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("name", metavar="NAME")
        p.set_defaults(func=pin, pinned=pinned)

    p = sub.add_parser("gc", parents=[common], help="remove expired entries and unused blocks",
                       description="Remove expired entries, blocks no entry uses and quarantine records.")
    p.add_argument("--remote", action="store_true", help="also in the bucket (blocks older than an hour)")
    p.add_argument("--compact", action="store_true", help="then rewrite the LMDB file to return free space")
    p.set_defaults(func=gc)

    p = sub.add_parser("stats", parents=[common], help="sizes and counts per tier",
                       description="Sizes, counts and budgets of the memory, LMDB and S3 tiers.")
    p.set_defaults(func=stats)

    p = sub.add_parser("verify", parents=[common], help="check stored blocks (exit 1 on problems)",
                       description="Check every block of entry NAME (default: every entry) and the LMDB file; "
                                   "damaged blocks are quarantined. Exit 1 when a problem is found.")
    p.add_argument("name", metavar="NAME", nargs="?")
    p.add_argument("--remote", action="store_true",
                   help="check the bucket's manifests instead (readable; in an encrypted bucket sealed for their own "
                        "bucket, prefix and name, and not rolled back)")
    p.set_defaults(func=verify)

    p = sub.add_parser("repair", parents=[common], help="fix a damaged store, keeping what is sound",
                       description="Fix or drop damaged index records and quarantine damaged blocks, keeping "
                                   "every sound entry; a data.mdb that cannot be read safely (truncated) is moved "
                                   "aside and an empty store started. Then gc. Exit 1 when problems remain.")
    p.set_defaults(func=repair)


def ls(ctx: Context, args: argparse.Namespace) -> int:
    # A damaged manifest (or, in the bucket, one sealed with another key) is named, not left out without a word.
    entries, unreadable = ctx.store().listing(remote=args.remote)

    def human() -> None:
        if entries:
            render.entry_table(ctx.out, entries)
        elif not unreadable:
            where = "the bucket" if args.remote else f"the store at {ctx.home}"
            ctx.out.note(f"no entries in {where}: `tqstore save NAME --model M --file F` makes one")
        if unreadable:
            fix = ("`tqstore verify --remote` says why; push them again from a machine that has them, or "
                   "`tqstore rm NAME --remote`" if args.remote else "`tqstore verify` says why, `tqstore repair` drops them")
            ctx.out.note(f"{len(unreadable)} more {'entry' if len(unreadable) == 1 else 'entries'} cannot be read "
                         f"({', '.join(unreadable)}): {fix}")

    ctx.out.emit({"entries": [render.entry_doc(e) for e in entries], "unreadable": unreadable}, human)
    return 0


def info(ctx: Context, args: argparse.Namespace) -> int:
    entry = ctx.store().info(validate_name(args.name), remote=args.remote)
    ctx.out.emit(render.entry_doc(entry), lambda: render.entry_lines(ctx.out, entry))
    return 0


def rm(ctx: Context, args: argparse.Namespace) -> int:
    name = args.name  # validated by the store, which also removes a damaged key `verify` listed
    ctx.store().rm(name, remote=args.remote)
    where = "s3" if args.remote else "local"
    said = f"removed {name}" + (" from the bucket" if args.remote else "")
    ctx.out.emit({"removed": name, "location": where}, lambda: ctx.out.note(said))
    return 0


def pin(ctx: Context, args: argparse.Namespace) -> int:
    name = validate_name(args.name)
    store = ctx.store()
    (store.pin if args.pinned else store.unpin)(name)
    ctx.out.emit({"name": name, "pinned": args.pinned},
                 lambda: ctx.out.note(f"{'pinned' if args.pinned else 'unpinned'} {name}"))
    return 0


def gc(ctx: Context, args: argparse.Namespace) -> int:
    result = ctx.store().gc(remote=args.remote, compact=args.compact)
    ctx.out.emit(render.asdict(result), lambda: render.gc_lines(ctx.out, result))
    return 0


def stats(ctx: Context, args: argparse.Namespace) -> int:
    result = ctx.store().stats()
    ctx.out.emit(render.stats_doc(result), lambda: render.stats_table(ctx.out, result))
    return 0


def verify(ctx: Context, args: argparse.Namespace) -> int:
    name = None if args.name is None else validate_name(args.name)
    store = ctx.store()
    problems = store.verify(name, remote=args.remote)
    checked = [name] if name else sorted([e.name for e in store.ls(remote=args.remote)] +
                                         [p.entry for p in problems if p.kind == "remote_manifest"])

    def human() -> None:
        if problems:
            rows = [(p.entry or "-", p.kind, p.key.hex()[:12] if p.key else "-", p.detail) for p in problems]
            ctx.out.table(("ENTRY", "PROBLEM", "OBJECT", "DETAIL"), rows)
            if args.remote:
                ctx.out.note(f"{len(problems)} problems in the bucket: those entries are refused by pull and left "
                             "out of lookups; push them again from a machine that has them (DETAIL says how)")
            else:
                ctx.out.note(f"{len(problems)} problems: damaged blocks are quarantined; save or pull the entries "
                             "named again (tqstore rm removes one); `tqstore repair` fixes damaged records")
        else:
            ctx.out.note(f"ok: {len(checked)} {'entry' if len(checked) == 1 else 'entries'} verified, no problems")

    ctx.out.emit({"ok": not problems, "entries": checked, "problems": [render.problem_doc(p) for p in problems]},
                 human)
    return 1 if problems else 0


def repair(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.store.repair import repair_home

    result = repair_home(ctx.config)

    def human() -> None:
        if result.moved_aside:
            ctx.out.note(f"data.mdb could not be read safely: moved the LMDB folder to {result.moved_aside}, started "
                         f"a new store and copied into it the {len(result.salvaged)} entries that could still be read "
                         "whole")
        for line in result.lost:
            ctx.out.note(f"lost {line} (pull or save it again)")
        if result.unread_pages:
            ctx.out.note(f"{result.unread_pages} pages of the old data.mdb could not be read: an entry whose manifest "
                         "was there cannot be named here (`tqstore ls --remote` shows what the bucket holds)")
        for line in result.records:
            ctx.out.note(f"fixed {line}")
        for name in result.rekeyed:
            ctx.out.note(f"stored {name} again under its own name")
        if result.quarantined:
            ctx.out.note(f"quarantined {result.quarantined} damaged objects")
        render.gc_lines(ctx.out, result.gc)
        for line in result.remaining:
            ctx.out.note(f"still: {line}")
        if result.remaining:
            return
        if result.lost:
            ctx.out.note("ok: the store works again, without the entries lost above")
        elif result.unread_pages:
            ctx.out.note("ok: the store works again; an entry whose manifest was in the unread pages is gone")
        else:
            ctx.out.note("ok: no problems left")

    ctx.out.emit(render.asdict(result), human)
    return 1 if result.remaining else 0
