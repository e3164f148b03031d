"""A real `tqstore serve` in a subprocess on a free loopback port, and raw HTTP helpers.

The server is started as `python -m tqstore.serve --port 0`; it prints the port it chose, and
the helper waits for /healthz before handing it to a test.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m tqstore.serve --home HOME --model MODEL --port 0 *flags`, ready to talk to;
    `source` is the source tree it runs from (another checkout, for bench/server_http.py)."""

    def __init__(self, home: Path, model: Path, *flags: str, api_key: str | None = None, source: Path = REPO):
        self.api_key = api_key
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(source), *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.pop("TQSTORE_API_KEY", None)
        if api_key is not None:
            env["TQSTORE_API_KEY"] = api_key
        self.log_path = Path(home).with_name(Path(home).name + "-server.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tqstore.serve", "--home", str(home), "--model", str(model), "--port", "0",
             *flags], cwd=source, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.port = self._read_port(timeout=60)
        self.base = f"http://127.0.0.1:{self.port}"
        self._wait_healthy(timeout=60)

    def _read_port(self, timeout: float) -> int:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if "listening on http://127.0.0.1:" not in line:
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}\n{self.log()}")
        return int(line.split("127.0.0.1:")[1].split("/")[0])

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}\n{self.log()}")
            try:
                if request(self, "GET", "/healthz", key=None)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"/healthz did not answer 200 within {timeout} s\n{self.log()}")

    def log(self) -> str:
        # stop() closes the file; a failed start still wants the server's last words.
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


_DEFAULT = object()


def request(server: ServerProcess, method: str, path: str, body: object = None, *, key: object = _DEFAULT,
            raw: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 60):
    """(status, headers, parsed JSON or text) of one request; `key` defaults to the server's."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        sent = dict(headers or {})
        key = server.api_key if key is _DEFAULT else key
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        payload = response.read()
        kind = response.getheader("Content-Type", "")
        parsed = json.loads(payload) if kind.startswith("application/json") else payload.decode()
        return response.status, response.headers, parsed
    finally:
        conn.close()


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample; asserts the exposition format on the way."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            typed.add(name)
            continue
        if line.startswith("#") or not line:
            assert not line or line.startswith("# HELP "), line
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        base = name.rsplit("_", 1)[0] if name.endswith(("_bucket", "_sum", "_count")) else name
        assert name in typed or base in typed, f"sample before its # TYPE: {line}"
        if "{" in key:
            assert key.endswith("}"), line
            for pair in key[len(name) + 1:-1].split('",'):
                label, _, quoted = pair.partition("=")
                assert label.isidentifier() and quoted.startswith('"'), line
        samples[key] = float(value)
    return samples
