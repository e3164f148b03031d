"""`serve`: the HTTP server. Its flags are defined once, in tqstore/serve/options.py (light to
import); the server itself (tqstore/serve/main.py) is imported only when `serve` runs."""

from __future__ import annotations

import argparse

from tqstore.serve.options import add_arguments

from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common],
                       help="OpenAI-compatible HTTP server; prompts with a stored prefix skip the prefill",
                       description="OpenAI-compatible HTTP server over the store: any prompt whose prefix is stored "
                                   "skips that prefill.")
    add_arguments(p)
    p.set_defaults(func=serve)


def serve(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.serve import main as server

    return server.run(args, ctx.config)
