"""`serve`: the HTTP server (tqstore/serve/main.py owns its options and its work).

The server module is imported only when `serve` runs, and it adds its own options: this parser
passes every argument it does not know (and --help) on to a parser the server fills in.
"""

from __future__ import annotations

import argparse

from ..context import Context


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common], add_help=False,
                       help="OpenAI-compatible HTTP server; prompts with a stored prefix skip the prefill",
                       description="Run the HTTP server (tqstore serve --help lists its options).")
    p.set_defaults(func=serve, takes_extra=True)


def serve(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.serve import main as server

    from ..main import Parser, global_options

    parser = Parser(prog="tqstore serve", parents=[global_options(True)],
                    description="OpenAI-compatible HTTP server over the store: any prompt whose prefix is stored "
                                "skips that prefill.")
    server.add_arguments(parser)
    served = parser.parse_args(args.extra, namespace=argparse.Namespace(**vars(args)))
    ctx.out.json_mode, ctx.out.quiet, ctx.out.verbose = served.json, served.quiet, served.verbose
    return server.run(served, ctx.config)
