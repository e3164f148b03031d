"""`tqstore serve` (and `python -m tqstore.serve`): its options, startup, signals and shutdown.
The HTTP layer is `http.py`; uvicorn runs it; docs/server.md describes the API."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import prometheus_client
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tqstore.config import Config, load_config, parse_duration, parse_size
from tqstore.errors import ConfigError, TqstoreError
from tqstore.serve.http import LOOPBACK_NAMES, App, Guard
from tqstore.serve.metrics import Metrics
from tqstore.serve.openai_schema import Sampling
from tqstore.serve.worker import ModelWorker, SavePolicy

log = logging.getLogger("tqstore.serve")
API_KEY_ENV = "TQSTORE_API_KEY"
BACKLOG = 64  # the listen backlog: bursts of clients connect at once
# Seconds an idle keep-alive connection is kept, and a new connection has to send its request
# head (slow clients: see _Protocol).
KEEP_ALIVE_SECONDS = 30
MAX_HEAD_BYTES = 64 << 10  # a request line and headers larger than this get 400 (h11's limit)


def _duration(raw: str) -> float:
    try:
        return parse_duration(raw, "--save-ttl", allow_zero=True)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(raw: str) -> int:
    try:
        return parse_size(raw, "--max-body-bytes")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} must be at least 1")
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
    """The flags of `tqstore serve` (the CLI adds --home)."""
    parser.add_argument("--model", required=True, help="model folder or Hugging Face repo id to serve")
    parser.add_argument("--scheme", help="cache scheme (default: the config's default_scheme, turbo4)")
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
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one, printed)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the variable, "
                             "the command line is visible to other users)")
    parser.add_argument("--max-queue", type=_positive, default=32,
                        help="requests that may wait for the model; more get 503 + Retry-After (default 32)")
    parser.add_argument("--max-running", type=_positive, default=4,
                        help="requests generated at once, taking turns on the model so that a long answer cannot "
                             "hold up short ones (default 4)")
    parser.add_argument("--max-tokens-limit", type=_positive, default=None,
                        help="the server's cap on max_tokens: longer requests stop there with finish_reason "
                             "'length' (default: the model's context length)")
    parser.add_argument("--max-connections", type=_positive, default=1024,
                        help="open connections (and requests in progress) beyond which new requests get 503 at "
                             "once (default 1024)")
    parser.add_argument("--max-body-bytes", type=_size, default=16 << 20,
                        help="largest request body, e.g. 16MiB (default); larger ones get 413")
    parser.add_argument("--max-tokens", type=_positive, default=512,
                        help="max_tokens when a request leaves it out (default 512)")
    parser.add_argument("--temp", type=float, default=0.0,
                        help="temperature when a request leaves it out (default 0: greedy, as mlx-lm)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p when a request leaves it out (default 1)")
    parser.add_argument("--save-min-tokens", type=_positive, default=256,
                        help="store prompts of at least this many tokens after their response (default 256)")
    parser.add_argument("--save-ttl", type=_duration, default=24 * 3600.0,
                        help="lifetime of stored prompts: seconds or 30m, 24h, 7d; 0 = no expiry (default 24h)")
    parser.add_argument("--no-save", action="store_true", help="never store prompts (stored ones are still reused)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log level for the access log and errors on stderr (default info)")


def run(args: argparse.Namespace, config: Config) -> int:
    """Serve until SIGINT or SIGTERM, then shut down cleanly and return 0. Raises TqstoreError
    (ConfigError for bad flags, or what loading the model raised) when it cannot serve."""
    from turboquant import parse_scheme

    from tqstore import Store
    from tqstore.engine.engine import Engine

    # The _created series prometheus_client adds beside each counter and histogram: noise for a
    # server whose counters all start with it (a process-wide switch; this process is the server).
    prometheus_client.disable_created_metrics()
    if not logging.getLogger().handlers:
        level = "WARNING" if getattr(args, "quiet", False) else args.log_level.upper()  # the CLI's -q
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        scheme = parse_scheme(config.default_scheme if args.scheme is None else args.scheme).name
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (0 <= args.temp <= 2 and 0 < args.top_p <= 1):
        raise ConfigError(f"--temp {args.temp} / --top-p {args.top_p}: use a temperature from 0 to 2 and a top_p "
                          "in (0, 1]")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host) and not args.insecure:
        raise ConfigError(f"--host {args.host} is reachable from other machines and no API key is set: set "
                          f"{API_KEY_ENV} (or --api-key), or pass --insecure to serve everyone who can reach it")
    model_id = Path(args.model).name if Path(args.model).exists() else args.model
    store = Store.open(config=config)
    try:
        worker = ModelWorker(Engine(store), args.model, scheme=scheme, adapter_path=args.adapter_path,
                             max_queue=args.max_queue, max_running=args.max_running,
                             max_tokens_limit=args.max_tokens_limit, metrics=Metrics(),
                             policy=SavePolicy(not args.no_save, args.save_min_tokens, args.save_ttl or None))
        app = App(worker, worker.metrics, model_id, tuple(dict.fromkeys((model_id, args.model))),
                  Sampling(args.max_tokens, args.temp, args.top_p, None, ()), api_key, args.max_body_bytes,
                  int(time.time()), allowed_hosts(args.host, args.allowed_host))
        return _serve(app, _listen(args.host, args.port), args, scheme)
    finally:
        store.close()


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on a new connection's first request head:
    uvicorn arms its keep-alive timer only after a response, so a client that connects and
    sends nothing, or its headers a byte at a time, would hold the connection forever. The
    timer is the keep-alive one; uvicorn stops it when a whole request head has arrived."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)


class _Server(uvicorn.Server):
    """uvicorn's server, ending with the model worker: it stops when the model cannot load,
    and its shutdown stops the worker first, so that every job waited for ends (503
    shutting_down) and the handlers waiting for them finish."""

    def __init__(self, config: uvicorn.Config, worker: ModelWorker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame) -> None:
        # SIGINT and SIGTERM are how this server is meant to stop: exit 0, where uvicorn would
        # raise the signal again after its shutdown. A second Ctrl-C stops at once.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        return self.worker.load_error is not None or await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.worker.stop)
        await super().shutdown(sockets)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that port 0 is known before serving starts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}: choose another --port "
                          "(0 picks a free one)") from None
    return sock


def _serve(app: App, sock: socket.socket, args: argparse.Namespace, scheme: str) -> int:
    host, port = sock.getsockname()[:2]
    worker = app.worker
    if app.api_key is None and not is_loopback(host):  # --insecure
        log.warning("listening on %s without an API key (--insecure): anyone who can reach it can use the model "
                    "and the store (set %s)", host, API_KEY_ENV)
    config = uvicorn.Config(Guard(app), http=_Protocol, loop="asyncio", lifespan="off", log_config=None,
                            log_level=args.log_level, server_header=False, limit_concurrency=args.max_connections,
                            backlog=BACKLOG, timeout_keep_alive=KEEP_ALIVE_SECONDS,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    server = _Server(config, worker)
    worker.start()
    url = f"http://{host}:{port}/v1"
    if getattr(args, "json", False):  # the CLI's --json: one JSON document on stdout
        print(json.dumps({"listening": url, "host": host, "port": port, "model": app.model_id,
                          "scheme": scheme}), flush=True)
    else:
        print(f"tqstore serve: listening on {url} (model {app.model_id}, scheme {scheme})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        worker.stop()  # again, in case the server never started: it returns at once otherwise
    error = worker.load_error
    if error is not None:
        if isinstance(error, TqstoreError):
            raise error
        raise TqstoreError(f"cannot load the model {args.model}: {error}") from error
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tqstore.serve --home DIR --model M ...` (what `tqstore serve` runs)."""
    parser = argparse.ArgumentParser(prog="python -m tqstore.serve", description="tqstore's OpenAI-compatible server")
    parser.add_argument("--home", help="tqstore home folder (default $TQSTORE_HOME or ~/.cache/tqstore)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args, load_config(args.home))
    except TqstoreError as e:
        print(f"tqstore serve: error: {e}", file=sys.stderr)
        return 1

