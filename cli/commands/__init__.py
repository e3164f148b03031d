"""The commands, grouped by job; each module's `register(subparsers, common)` adds its parsers
(`common` carries the global flags) and sets `func(ctx, args) -> exit code`. Listed in the order
`tqstore --help` shows them."""

from . import chat, demo, documents, entries, exchange, generate, models, selftest, serve, settings, transfer

COMMANDS = (generate, documents, chat, entries, transfer, exchange, settings, models, serve, demo, selftest)
