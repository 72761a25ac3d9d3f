"""An S3 server for the tests (issue 68): moto's server mode (``moto_server``, the one s3fs's own test suite uses),
started as a separate process speaking the S3 HTTP API on 127.0.0.1, and a fault proxy in front of it. Tests talk to
both only through s3fs, with the server's address as the endpoint, as a user's run talks to AWS or MinIO.

A support module (tests import it). :class:`FaultProxy` forwards each HTTP request to the server unchanged, unless a
fault is set: the next ``fail`` requests of a method answered 503 (S3's "SlowDown"/"ServiceUnavailable"), every
request answered 500 (``down``: the server gone while the process still listens), each request delayed, or the
requests for some keys held until released (an upload that takes as long as the test wants)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

#: the credentials the tests' runs read from the environment (moto accepts any unless told to check them)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "hflight-test", "AWS_SECRET_ACCESS_KEY": "hflight-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def moto_server_command() -> list[str]:
    """``moto_server`` of this environment (beside its Python), else the module."""
    beside = Path(sys.executable).with_name("moto_server")
    return [str(beside)] if beside.exists() else [shutil.which("moto_server") or "moto_server"]


@contextlib.contextmanager
def moto_server(log: Path, check_credentials: bool = False) -> Iterator[str]:
    """A ``moto_server`` process on a free port; yields its endpoint URL. ``check_credentials``: requests must carry
    credentials moto's IAM knows (``INITIAL_NO_AUTH_ACTION_COUNT=0``), so unknown ones are refused as AWS refuses
    them."""
    port = free_port()
    env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {})}
    with open(log, "wb") as out:
        server = subprocess.Popen([*moto_server_command(), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, env=env)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def reset(endpoint: str) -> None:
    """Every bucket and object of the server gone (moto's own reset call)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(request, timeout=10).close()


def filesystem(endpoint: str):
    """An s3fs filesystem on ``endpoint`` (a fresh instance: no cached listings)."""
    import s3fs

    key, secret = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True, key=key, secret=secret)


def options(endpoint: str, attempts: int | None = None) -> dict:
    """``storage_options`` for a run on ``endpoint``; ``attempts``: botocore's attempts per call (its retries)."""
    client: dict = {"endpoint_url": endpoint}
    config = {"retries": {"max_attempts": attempts, "mode": "standard"}} if attempts else {}
    return {"client_kwargs": client, **({"config_kwargs": config} if config else {}), "skip_instance_cache": True}


class FaultProxy:
    """An HTTP proxy on a free port in front of ``upstream`` (threaded; this process). Faults: :meth:`fail` (the
    next ``count`` requests of ``method`` answered ``status``), :attr:`down` (every request answered 500), and
    :attr:`delay_s` (each request waits first). :attr:`requests` counts what was forwarded, per method."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.down = False
        self.delay_s = 0.0
        self.requests: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self._fail: dict[str, list[int]] = {}
        self._held: tuple[str, str, float] | None = None
        self._released = threading.Event()
        #: requests that were held (:meth:`hold`)
        self.holding = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy._wait_if_held(self.command, self.path)
                status = proxy._fault(self.command)
                if status is not None:
                    payload = (f"<Error><Code>{'SlowDown' if status == 503 else 'InternalError'}</Code>"
                               "<Message>injected</Message></Error>").encode()  # fmt: skip
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                connection = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def hold(self, method: str, part: str, limit_s: float = 30.0) -> None:
        """Requests of ``method`` whose path contains ``part`` wait until :meth:`release` (or ``limit_s``)."""
        self._held, self._released = (method, part, limit_s), threading.Event()

    def release(self) -> None:
        self._released.set()

    def _wait_if_held(self, method: str, path: str) -> None:
        held = self._held
        if held is not None and method == held[0] and held[1] in path:
            self.holding += 1
            self._released.wait(held[2])

    def fail(self, method: str, count: int, status: int = 503) -> None:
        with self._lock:
            self._fail.setdefault(method, []).extend([status] * count)

    def _fault(self, method: str) -> int | None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            if self.down:
                self.refused[method] = self.refused.get(method, 0) + 1
                return 500
            pending = self._fail.get(method)
            if pending:
                self.refused[method] = self.refused.get(method, 0) + 1
                return pending.pop(0)
            self.requests[method] = self.requests.get(method, 0) + 1
            return None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
