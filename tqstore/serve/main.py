"""`tqstore serve` (and `python -m tqstore.serve`): startup, signals and shutdown (options.py holds its flags).
The HTTP layer is `http.py`; uvicorn runs it; docs/server.md describes the API."""

from __future__ import annotations

import argparse
import asyncio
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

from tqstore.config import Config, load_config
from tqstore.errors import ConfigError, TqstoreError
from tqstore.serve.http import AUTHORIZED, MAX_HEAD_BYTES, App, Guard
from tqstore.serve.options import API_KEY_ENV, allowed_hosts, is_loopback, parse_args
from tqstore.serve.metrics import Metrics
from tqstore.serve.openai_schema import Sampling
from tqstore.serve.autosave import SavePolicy
from tqstore.serve.worker import ModelWorker

log = logging.getLogger("tqstore.serve")
BACKLOG = 1024  # the listen backlog: a burst of clients connecting at once waits here, not in SYN retries
# On SIGTERM, once the model worker has stopped (every job ended), responses still being written
# get this long; then their tasks are cancelled (a client stalling mid-body would hold shutdown).
SHUTDOWN_GRACE_SECONDS = 5
# How long a connection must have been idle before a new one may close it to make room: a
# client sends its request head as soon as it connects, and under a burst of real clients the
# server may not have read it yet (those get 503, not a reset).
IDLE_GRACE_SECONDS = 1.0


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
        level = _log_level(args).upper()
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        scheme = parse_scheme(config.default_scheme if args.scheme is None else args.scheme).name
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
                  int(time.time()), allowed_hosts(args.host, args.allowed_host), args.keep_alive)
        return _serve(app, _listen(args.host, args.port), args, scheme)
    finally:
        store.close()


def _log_level(args: argparse.Namespace) -> str:
    """--log-level, or warning under the CLI's -q (uvicorn's access log included)."""
    return "warning" if getattr(args, "quiet", False) else args.log_level


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request head. uvicorn's keep-alive
    timer starts only after a response and stops at any byte received, so a client that
    connects and sends nothing, sends its headers a byte at a time, or trickles a refused body
    would hold its connection forever. Here a connection has --keep-alive seconds, from its
    start and from each response, to deliver a whole request head; while a request is being
    answered the deadline does not apply (Guard times out a stalled body).

    Idle connections also give way: uvicorn answers 503 to any request once --max-connections
    connections are open, idle ones included, so a thousand silent sockets would lock everyone
    out. A new connection past the limit closes idle ones (waiting for a request head for more
    than IDLE_GRACE_SECONDS), those that never sent an authorized request first, then the
    longest idle; connections with requests in progress are never closed for room."""

    _deadline: asyncio.TimerHandle | None = None
    _idle_since = 0.0
    _authorized = False  # whether a request on this connection passed the API key check

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self._make_room()

    def on_response_complete(self) -> None:
        self._authorized = self._authorized or bool(self.cycle.scope.get(AUTHORIZED))
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._idle_since = self.loop.time()
        self._deadline = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _idle(self) -> bool:
        """Waiting for the client (a request head), not answering it."""
        return self.cycle is None or self.cycle.response_complete

    def _expire(self) -> None:
        if self._idle():
            self.transport.close()

    def _make_room(self) -> None:
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        since = self.loop.time() - IDLE_GRACE_SECONDS
        idle = sorted((c for c in self.connections if c is not self and isinstance(c, _Protocol) and c._idle()
                       and c._idle_since <= since and not c.transport.is_closing()),
                      key=lambda c: (c._authorized, c._idle_since))
        for victim in idle[:len(self.connections) - limit + 1]:
            victim.transport.close()
            # Not counted from now on: uvicorn forgets it only when the loop reports it lost,
            # after this connection's first request may already have been counted.
            self.connections.discard(victim)


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
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
    # so, and with Nagle a response written as head then body waits for the client's delayed
    # ACK (40 ms per request on a kept-alive connection).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
                            log_level=_log_level(args), server_header=False, limit_concurrency=args.max_connections,
                            backlog=BACKLOG, timeout_keep_alive=args.keep_alive,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    server = _Server(config, worker)
    # Stopping works from the moment the port is announced: uvicorn installs its own handlers
    # only once it runs, and a SIGTERM in between would kill the process (exit -15).
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, server.handle_exit)
        except ValueError:  # not the main thread (run embedded): the caller stops the process
            pass
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = worker.load_error
    if error is not None:
        if isinstance(error, TqstoreError):
            raise error
        raise TqstoreError(f"cannot load the model {args.model}: {error}") from error
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tqstore.serve --home DIR --model M ...` (what `tqstore serve` runs)."""
    args = parse_args(argv)
    try:
        return run(args, load_config(args.home))
    except TqstoreError as e:
        print(f"tqstore serve: error: {e}", file=sys.stderr)
        return 1
