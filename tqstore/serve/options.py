"""The options of `tqstore serve`: one definition, which both `tqstore serve` (the CLI's
subcommand parser) and `python -m tqstore.serve` (parse_args) use, and what they mean for
binding. Light on imports: the CLI builds its parser from here at every start.
"""

from __future__ import annotations

import argparse
import ipaddress

from tqstore.units import flag_type, parse_duration, parse_number, parse_size

API_KEY_ENV = "TQSTORE_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def positive_int(raw: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} must be at least 1")
    return value


MIN_BODY_BYTES = 1024  # below this no generation request fits: every POST would be a 413


def body_limit(raw: str) -> int:
    """argparse type: --max-body-bytes, a size of at least MIN_BODY_BYTES."""
    value = flag_type(parse_size, "--max-body-bytes")(raw)
    if value < MIN_BODY_BYTES:
        raise argparse.ArgumentTypeError(f"--max-body-bytes={raw!r} is below 1KiB: every request body would be "
                                         "refused with 413")
    return value


def port_number(raw: str) -> int:
    """argparse type: a TCP port, 0 to 65535 (0: any free one)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number: use 0 to 65535 (0 picks a free one)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw} is not a port number: use 0 to 65535 (0 picks a free one)")
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` (a --host value) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def allowed_hosts(host: str, extra: list[str]) -> frozenset[str] | None:
    """The names the Host header may use: loopback names, the bound host and --allowed-host;
    None (any) for a wildcard bind without --allowed-host, as its clients' names are unknown."""
    bound = host.strip("[]").lower()
    wildcard = bound in ("", "0.0.0.0", "::")
    if wildcard and not extra:
        return None
    names = set(LOOPBACK_NAMES) | {name.strip("[]").lower() for name in extra}
    if not wildcard:
        names.add(bound)
    return frozenset(names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tqstore serve`, on the CLI's subcommand parser or on parse_args's (each adds
    --home)."""
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo id to serve")
    parser.add_argument("--scheme", help="cache scheme (default: the config's default_scheme, turbo5v4)")
    parser.add_argument("--adapter-path", help="LoRA adapter folder for the model")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only); any other address needs an "
                             "API key, or --insecure")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --host without an API key: anyone who can reach it can use the "
                             "model and read, write and delete the store")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="another name clients may send in the Host header (a DNS name or a proxy's), besides "
                             "localhost, 127.0.0.1, ::1 and --host; repeatable")
    parser.add_argument("--port", type=port_number, default=8080,
                        help="port, 0 to 65535 (default 8080; 0 picks a free one, printed)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the variable, "
                             "the command line is visible to other users)")
    parser.add_argument("--max-queue", type=positive_int, default=32,
                        help="requests that may wait for the model; more get 503 + Retry-After (default 32)")
    parser.add_argument("--max-running", type=positive_int, default=8,
                        help="requests generated at once: they decode together in batched steps (one at a time, in "
                             "turns, for families that cannot batch) (default 8)")
    parser.add_argument("--max-tokens-limit", type=positive_int, default=None,
                        help="the server's cap on max_tokens: longer requests stop there with finish_reason "
                             "'length' (default: the model's context length)")
    parser.add_argument("--max-connections", type=positive_int, default=1024,
                        help="open connections (and requests in progress) beyond which new requests get 503 at "
                             "once (default 1024)")
    parser.add_argument("--keep-alive", type=flag_type(parse_duration, "--keep-alive"), default=30.0,
                        help="how long an idle connection is kept open, and the longest a client may stay silent "
                             "while sending a request (headers or body) before it is dropped: seconds or 1m, ... "
                             "(default 30s)")
    parser.add_argument("--max-body-bytes", type=body_limit, default=16 << 20,
                        help="largest request body, e.g. 16MiB (default); larger ones get 413")
    parser.add_argument("--max-tokens", type=positive_int, default=512,
                        help="max_tokens when a request leaves it out (default 512)")
    parser.add_argument("--temp", type=flag_type(parse_number, "--temp", high=2.0), default=0.0,
                        help="temperature when a request leaves it out (default 0: greedy, as mlx-lm)")
    parser.add_argument("--top-p", type=flag_type(parse_number, "--top-p", high=1.0, above=True), default=1.0,
                        help="top_p when a request leaves it out (default 1)")
    parser.add_argument("--save-min-tokens", type=positive_int, default=256,
                        help="store prompts of at least this many tokens after their response (default 256)")
    parser.add_argument("--save-ttl", type=flag_type(parse_duration, "--save-ttl", allow_zero=True), default=24 * 3600.0,
                        help="lifetime of stored prompts: seconds or 30m, 24h, 7d; 0 = no expiry (default 24h)")
    parser.add_argument("--no-save", action="store_true", help="never store prompts (stored ones are still reused)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log level for the access log and errors on stderr (default info)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m tqstore.serve`'s command line: --home and the flags of add_arguments."""
    parser = argparse.ArgumentParser(prog="python -m tqstore.serve", description="tqstore's OpenAI-compatible server")
    parser.add_argument("--home", help="tqstore home folder (default $TQSTORE_HOME or ~/.cache/tqstore)")
    add_arguments(parser)
    return parser.parse_args(argv)
