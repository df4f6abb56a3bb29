#!/usr/bin/env python3
"""A fault-injecting HTTP proxy for S3, to prove that clients survive S3 faults.

It sits on loopback between the clients (AWS CLI, boto3, s5cmd) and an S3 endpoint (moto in
tests). Point AWS_ENDPOINT_URL at it: each request is forwarded to the upstream unchanged (the
Host header too, since SigV4 signs it) and the upstream's answer comes back, except where the
proxy injects a fault instead:

    error    answer 500 InternalError or 503 SlowDown without forwarding (only requests whose
             target contains error_match, when it is set: e.g. "?delete" fails DeleteObjects alone);
    reset    drop the client connection with a TCP RST, without answering: right after the
             request headers ("before_body"), after reading the whole request ("after_body"), or,
             when asked for, after the upstream has acted on it ("after_upstream"); or cut the
             upstream's answer short ("mid_body": the head and the first half of the body arrive,
             then the connection closes, as when a network drops a download midway; closed, not
             reset, so the client surely gets that half: a reset discards what it has not read);
    slow     wait slow_seconds, then answer normally (only requests whose target contains
             slow_match, when it is set: e.g. "partNumber=" slows multipart parts alone);
    outage   every request gets a fault (503 by default, or 500, or reset) until it is turned
             off or, for a timed outage, until outage_seconds have passed.

With ignore_conditional_writes, the proxy plays a store that ignores conditional writes (some
S3-compatible stores): it strips If-None-Match and If-Match from PUT, POST and DELETE requests
before forwarding them, so a write that S3 must refuse with 412 lands. (moto checks no
signatures; a real S3 would refuse the stripped, signed headers.) Stats count them in
conditions_ignored. With refuse_conditional_writes it plays a store that answers such writes with
501 NotImplemented instead (counted in conditions_refused).

With duplicate_date, every answer relayed from the upstream carries its Date header twice, the
second a second later, as some endpoints and proxies send it (HTTP clients join the two into one
value, "Tue, 25 Nov ... GMT, Tue, 25 Nov ... GMT"); counted in dates_duplicated.

body_seconds_per_mb plays a slow uplink: every request body is read from the client at that pace
(1 MB per body_seconds_per_mb seconds, in pieces of up to 1 MB), so an upload takes as long as it
would over a slow network while its client keeps sending.

error_rate, reset_rate and slow_rate are per-request probabilities, drawn from
random.Random(seed) so that a run can be replayed; a request gets at most one fault, and error is
checked before reset, reset before slow. Stats count requests by method and by outcome (forwarded,
error, reset, slow, outage) and keep (monotonic time, method, path, outcome) for the last requests,
so a test can tell a backing-off client from a hot loop.

From Python (tests):

    from s3_fault_proxy import FaultProxy
    with FaultProxy(upstream="http://127.0.0.1:5000", error_rate=0.1, seed=1) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.url)
        proxy.configure(outage=True)          # or outage_seconds=5, or error_rate=0
        proxy.stats()["by_outcome"]

From a shell:

    python lab/s3_fault_proxy.py --upstream http://127.0.0.1:5000 --error-rate 0.2 \\
        --port 0 --port-file /tmp/proxy.port --verbose
    curl http://127.0.0.1:PORT/__faults__/stats
    curl -X POST -d '{"outage": true}' http://127.0.0.1:PORT/__faults__/config

It prints the URL it listens on, and stops on SIGTERM or SIGINT. Control requests live under
/__faults__/ (no bucket can be named that: S3 bucket names have no underscores); they are never
faulted nor counted. The control endpoints: GET /__faults__/stats, GET /__faults__/config,
POST /__faults__/config (JSON with any settings), POST /__faults__/reset-stats.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import email.utils
import http.client
import http.server
import ipaddress
import json
import math
import os
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Iterator

CONTROL_PREFIX = "/__faults__/"
COPY_CHUNK = 1024 * 1024
MAX_CONTROL_BODY = 64 * 1024
UPSTREAM_TIMEOUT = 300.0
# How long to keep reading after answering early, so that the kernel does not answer the
# client's in-flight body with an RST that could destroy the answer we just sent.
LINGER_SECONDS = 2.0
# An idle keep-alive connection holds a thread; let it go after this long.
CLIENT_IDLE_TIMEOUT = 300.0

S3_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
# What a store without conditional writes may answer them with; never drawn as a fault.
NOT_IMPLEMENTED = {
    501: ("NotImplemented", "A header you provided implies functionality that is not implemented."),
}
RESET_POINTS = ("before_body", "after_body", "after_upstream", "mid_body")
OUTAGE_FAULTS = ("503", "500", "reset")
OUTCOMES = ("forwarded", "error", "reset", "slow", "outage")
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "transfer-encoding", "upgrade",
}
# Query parameters whose names look secret (presigned URLs' signatures and credentials, tokens): the
# rule job/redact.sed applies to the pod's output.
SECRET_QUERY_NAME = re.compile(r"token|key|secret|sig|pass|pwd|cred|auth|^x-amz-", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class FaultSettings:
    error_rate: float = 0.0
    reset_rate: float = 0.0
    slow_rate: float = 0.0
    slow_seconds: float = 1.0
    error_statuses: tuple[int, ...] = (503, 500)
    reset_points: tuple[str, ...] = ("before_body", "after_body")
    outage_fault: str = "503"
    slow_match: str = ""
    error_match: str = ""
    ignore_conditional_writes: bool = False
    refuse_conditional_writes: bool = False
    body_seconds_per_mb: float = 0.0
    duplicate_date: bool = False
    verbose: bool = False

    def validated(self) -> FaultSettings:
        for name in ("error_rate", "reset_rate", "slow_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {rate}")
        for name in ("slow_seconds", "body_seconds_per_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.error_statuses or not set(self.error_statuses) <= set(S3_ERRORS):
            raise ValueError(f"error_statuses must be some of {sorted(S3_ERRORS)}")
        if not self.reset_points or not set(self.reset_points) <= set(RESET_POINTS):
            raise ValueError(f"reset_points must be some of {RESET_POINTS}")
        if self.outage_fault not in OUTAGE_FAULTS:
            raise ValueError(f"outage_fault must be one of {OUTAGE_FAULTS}")
        return self


SETTING_TYPES = {
    "error_rate": float, "reset_rate": float, "slow_rate": float, "slow_seconds": float,
    "error_statuses": lambda v: tuple(int(s) for s in v),
    "reset_points": lambda v: tuple(str(p) for p in v),
    "outage_fault": str, "slow_match": str, "error_match": str, "ignore_conditional_writes": bool,
    "refuse_conditional_writes": bool, "body_seconds_per_mb": float, "duplicate_date": bool, "verbose": bool,
}
CONDITIONAL_HEADERS = {"if-none-match", "if-match"}
WRITE_METHODS = {"PUT", "POST", "DELETE"}


@dataclasses.dataclass(frozen=True)
class Fault:
    outcome: str          # what the stats call it
    action: str           # forward, error, reset or slow
    status: int = 0       # for error
    reset_point: str = ""  # for reset


FORWARD = Fault("forwarded", "forward")


class UpstreamError(Exception):
    """The upstream S3 could not be reached or hung up; the client gets a 502."""


class FaultProxy:
    """The proxy, run on a background thread; see the module docstring."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, seed: int = 0,
                 history: int = 1000, outage: bool = False, outage_seconds: float | None = None,
                 **settings):
        self.upstream = urllib.parse.urlsplit(upstream)
        if self.upstream.scheme != "http" or not self.upstream.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self._lock = threading.Lock()
        self._settings = FaultSettings(**_typed_settings(settings)).validated()
        self._rng = random.Random(seed)
        self._seed = seed
        self._outage_until: float | None = None
        self._set_outage(outage, outage_seconds)
        self._history = history
        self._reset_stats_locked()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server = _ProxyServer((host, port), _ProxyHandler, self)
        self._thread: threading.Thread | None = None

    # Lifecycle

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> FaultProxy:
        # A short poll keeps stop() quick.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        self._drop_open_connections()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # Settings

    def configure(self, *, seed: int | None = None, outage: bool | None = None,
                  outage_seconds: float | None = None, **settings) -> dict:
        """Change any settings at once; outage=False also ends a timed outage."""
        with self._lock:
            changed = dataclasses.replace(self._settings, **_typed_settings(settings)).validated()
            self._settings = changed
            if seed is not None:
                self._seed = int(seed)
                self._rng.seed(self._seed)
            if outage is not None or outage_seconds is not None:
                self._set_outage(outage, outage_seconds)
            return self._config_locked()

    def config(self) -> dict:
        with self._lock:
            return self._config_locked()

    def _config_locked(self) -> dict:
        config = dataclasses.asdict(self._settings)
        config["error_statuses"] = list(self._settings.error_statuses)
        config["reset_points"] = list(self._settings.reset_points)
        config["seed"] = self._seed
        config["upstream"] = self.upstream.geturl()
        remaining = self._outage_remaining(time.monotonic())
        config["outage"] = remaining > 0
        config["outage_seconds_left"] = remaining if math.isfinite(remaining) else None
        return config

    def _set_outage(self, outage: bool | None, outage_seconds: float | None) -> None:
        if outage_seconds is not None and outage is not False:
            self._outage_until = time.monotonic() + float(outage_seconds)
        elif outage:
            self._outage_until = math.inf
        else:
            self._outage_until = None

    def _outage_remaining(self, now: float) -> float:
        if self._outage_until is None:
            return 0.0
        return max(0.0, self._outage_until - now)

    # Stats

    def stats(self) -> dict:
        """Counts since start (or reset_stats) and the last requests, oldest first."""
        with self._lock:
            return {
                "total": self._total,
                "by_method": dict(self._by_method),
                "by_outcome": dict(self._by_outcome),
                "upstream_failures": self._upstream_failures,
                "conditions_ignored": self._conditions_ignored,
                "conditions_refused": self._conditions_refused,
                "dates_duplicated": self._dates_duplicated,
                "recent": list(self._recent),
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._reset_stats_locked()

    def _reset_stats_locked(self) -> None:
        self._total = 0
        self._by_method: collections.Counter[str] = collections.Counter()
        self._by_outcome: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self._upstream_failures = 0
        self._conditions_ignored = 0
        self._conditions_refused = 0
        self._dates_duplicated = 0
        self._recent: collections.deque[tuple[float, str, str, str]] = collections.deque(
            maxlen=self._history)

    def _count_upstream_failure(self) -> None:
        with self._lock:
            self._upstream_failures += 1

    def refuses(self, method: str, headers) -> bool:
        """True for a conditional write when playing a store that answers them with 501."""
        if method not in WRITE_METHODS or not CONDITIONAL_HEADERS & {name.lower() for name in headers}:
            return False
        with self._lock:
            if not self._settings.refuse_conditional_writes:
                return False
            self._conditions_refused += 1
            return True

    def answer_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The upstream's answer headers as the client gets them: with duplicate_date, a second
        Date header (a second later) after the first."""
        with self._lock:
            if not self._settings.duplicate_date:
                return headers
            self._dates_duplicated += 1
        extra = []
        for name, value in headers:
            if name.lower() == "date":
                try:
                    later = email.utils.parsedate_to_datetime(value) + datetime.timedelta(seconds=1)
                    extra.append((name, email.utils.format_datetime(later, usegmt=True)))
                except (TypeError, ValueError):
                    extra.append((name, value))
        return headers + extra

    def forwards_header(self, method: str, name: str) -> bool:
        """False for a conditional write's condition when playing a store that ignores them."""
        if name.lower() not in CONDITIONAL_HEADERS or method not in WRITE_METHODS:
            return True
        with self._lock:
            if not self._settings.ignore_conditional_writes:
                return True
            self._conditions_ignored += 1
            return False

    # Faults

    def choose_fault(self, method: str, path: str) -> Fault:
        """Draws this request's fate and counts it (at arrival, so gaps show client backoff)."""
        with self._lock:
            now = time.monotonic()
            fault = self._draw_fault(now, path)
            self._total += 1
            self._by_method[method] += 1
            self._by_outcome[fault.outcome] += 1
            self._recent.append((now, method, path, fault.outcome))
            verbose = self._settings.verbose
        if verbose and fault.action != "forward":
            _log(f"{fault.outcome}: {_describe(fault)} for {method} {path}")
        return fault

    def slow_seconds(self) -> float:
        with self._lock:
            return self._settings.slow_seconds

    def pace_body(self, size: int) -> None:
        """Wait as a slow uplink would before the next `size` bytes of a request body."""
        with self._lock:
            seconds = self._settings.body_seconds_per_mb * size / COPY_CHUNK
        if seconds:
            self._stopping.wait(seconds)

    def _draw_fault(self, now: float, path: str) -> Fault:
        if self._outage_remaining(now) > 0:
            return self._outage_fault()
        settings = self._settings
        # One draw against stacked bands: each rate is exactly its probability, and the rng
        # advances the same way whatever the rates, so a seeded run replays.
        draw = self._rng.random()
        if draw < settings.error_rate:
            if settings.error_match not in path:
                return FORWARD
            return Fault("error", "error", status=self._rng.choice(settings.error_statuses))
        draw -= settings.error_rate
        if draw < settings.reset_rate:
            return Fault("reset", "reset", reset_point=self._rng.choice(settings.reset_points))
        draw -= settings.reset_rate
        if draw < settings.slow_rate and settings.slow_match in path:
            return Fault("slow", "slow")
        return FORWARD

    def _outage_fault(self) -> Fault:
        if self._settings.outage_fault == "reset":
            return Fault("outage", "reset", reset_point="before_body")
        return Fault("outage", "error", status=int(self._settings.outage_fault))

    # Connections, so that stop() leaves no client talking to a stopped proxy

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def _drop_open_connections(self) -> None:
        with self._lock:
            open_connections = list(self._connections)
        for conn in open_connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(address, handler)

    def handle_error(self, request, client_address):
        # A client or upstream that hangs up mid-answer is business as usual for this proxy.
        if isinstance(sys.exc_info()[1], (OSError, http.client.HTTPException)):
            return
        super().handle_error(request, client_address)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_IDLE_TIMEOUT
    server: _ProxyServer

    def setup(self):
        super().setup()
        self.server.proxy._track(self.connection)

    def finish(self):
        self.server.proxy._untrack(self.connection)
        super().finish()

    def log_message(self, format, *args):
        # Per-request logs would drown the per-fault lines; faults are logged in choose_fault.
        pass

    def handle_expect_100(self):
        # Defer the 100 Continue: a faulted request is answered with its error instead.
        return True

    def proxy_request(self):
        self._body_read = False
        if self._is_control_request():
            _serve_control(self)
            return
        proxy = self.server.proxy
        fault = proxy.choose_fault(self.command, _redacted(self.path))
        if fault.action == "error":
            self._answer_s3_error(fault.status)
        elif fault.action == "reset":
            self._reset_at(fault.reset_point)
        elif proxy.refuses(self.command, self.headers.keys()):
            self._answer_s3_error(501)
        else:
            self._forward(slow_seconds=proxy.slow_seconds() if fault.action == "slow" else 0.0)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = proxy_request

    # Request body

    def _expects_continue(self) -> bool:
        return (self.headers.get("Expect", "").lower() == "100-continue"
                and self.request_version >= "HTTP/1.1")

    def _send_continue_if_expected(self) -> None:
        if self._expects_continue():
            self.send_response_only(http.HTTPStatus.CONTINUE)
            self.end_headers()

    def _iter_raw_body(self) -> Iterator[bytes]:
        """The request body exactly as sent (chunk framing included), a piece at a time."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            yield from self._iter_chunked_body()
        else:
            yield from self._iter_sized_body(int(self.headers.get("Content-Length") or 0))
        self._body_read = True

    def _iter_sized_body(self, remaining: int) -> Iterator[bytes]:
        while remaining > 0:
            piece = self.rfile.read(min(COPY_CHUNK, remaining))
            if not piece:
                raise ConnectionError("client closed the connection mid-body")
            remaining -= len(piece)
            yield piece

    def _iter_chunked_body(self) -> Iterator[bytes]:
        while True:
            size_line = self._read_line()
            yield size_line
            size = _chunk_size(size_line)
            if size == 0:
                break
            yield from self._iter_sized_body(size + 2)  # the data, then its CRLF
        while True:  # trailers, up to the blank line
            line = self._read_line()
            yield line
            if line in (b"\r\n", b"\n"):
                return

    def _read_line(self) -> bytes:
        line = self.rfile.readline(65537)
        if not line.endswith(b"\n"):
            raise ConnectionError("bad or truncated chunked body")
        return line

    def _has_body(self) -> bool:
        return ("chunked" in self.headers.get("Transfer-Encoding", "").lower()
                or int(self.headers.get("Content-Length") or 0) > 0)

    def _discard_body(self) -> None:
        for _ in self._iter_raw_body():
            pass

    # Faults

    def _answer_s3_error(self, status: int) -> None:
        if self._has_body() and not self._expects_continue():
            # Reading it keeps the connection usable, as S3 itself does for small bodies.
            self._discard_body()
        code, message = S3_ERRORS.get(status) or NOT_IMPLEMENTED[status]
        request_id = os.urandom(8).hex().upper()
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>{request_id}</RequestId></Error>").encode()
        headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)]
        self._send_whole_answer(status, headers, body)

    def _reset_at(self, point: str) -> None:
        if point == "after_body":
            self._send_continue_if_expected()
            self._discard_body()
        elif point == "after_upstream":
            self._send_continue_if_expected()
            try:
                response, upstream = self._send_upstream()
                response.read()
                upstream.close()
            except UpstreamError:
                self.server.proxy._count_upstream_failure()
        elif point == "mid_body":
            self._send_continue_if_expected()
            try:
                response, upstream = self._send_upstream()
            except UpstreamError:
                self.server.proxy._count_upstream_failure()
            else:
                with contextlib.closing(upstream):
                    self._relay(response, cut_after=int(response.getheader("Content-Length") or 0) // 2)
                self.close_connection = True
                return
        self._reset_connection()

    def _reset_connection(self) -> None:
        # SO_LINGER 0 makes close() send an RST instead of a FIN; rfile must go first or it
        # would keep the socket open.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.connection.close()
        self.close_connection = True

    # Forwarding

    def _forward(self, slow_seconds: float) -> None:
        self._send_continue_if_expected()
        try:
            response, upstream = self._send_upstream()
        except UpstreamError:
            self.server.proxy._count_upstream_failure()
            self._answer_bad_gateway()
            return
        try:
            if slow_seconds:
                self.server.proxy._stopping.wait(slow_seconds)
            self._relay(response)
        finally:
            upstream.close()

    def _send_upstream(self) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        """Sends the request on a fresh upstream connection; client errors pass through."""
        target = self.server.proxy.upstream
        upstream = http.client.HTTPConnection(target.hostname, target.port or 80,
                                              timeout=UPSTREAM_TIMEOUT)
        try:
            with _upstream_errors():
                upstream.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                proxy = self.server.proxy
                for name, value in self.headers.items():
                    # The client's Expect was answered here; the upstream gets the body at once.
                    if name.lower() != "expect" and proxy.forwards_header(self.command, name):
                        upstream.putheader(name, value)
                upstream.endheaders()
            for piece in self._iter_raw_body():
                self.server.proxy.pace_body(len(piece))
                with _upstream_errors():
                    upstream.send(piece)
            with _upstream_errors():
                return upstream.getresponse(), upstream
        except BaseException:
            upstream.close()
            raise

    def _relay(self, response: http.client.HTTPResponse, cut_after: int | None = None) -> None:
        """The upstream's answer to the client; with `cut_after`, only that many bytes of its body."""
        headers = self.server.proxy.answer_headers([(name, value) for name, value in response.getheaders()
                                                    if name.lower() not in HOP_BY_HOP])
        has_no_body = (self.command == "HEAD" or response.status in (204, 304)
                       or 100 <= response.status < 200)
        chunked = False
        if not has_no_body and response.getheader("Content-Length") is None:
            if response.chunked:
                chunked = True
                headers.append(("Transfer-Encoding", "chunked"))
            else:
                self.close_connection = True  # the body ends where the connection does
        self._send_head(response.status, response.reason, headers)
        if has_no_body:
            return
        left = cut_after
        while piece := response.read(COPY_CHUNK if left is None else min(COPY_CHUNK, left)):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if left is not None:
                left -= len(piece)
        if chunked and cut_after is None:
            self.wfile.write(b"0\r\n\r\n")

    def _answer_bad_gateway(self) -> None:
        body = b"upstream S3 unreachable\n"
        self._send_whole_answer(502, [("Content-Type", "text/plain")], body)

    # Answers

    def _send_whole_answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        unread_body = self._has_body() and not self._body_read
        if unread_body:
            self.close_connection = True
        self._send_head(status, None, headers + [("Content-Length", str(len(body)))])
        if self.command != "HEAD":
            self.wfile.write(body)
        if unread_body:
            self._linger_close()

    def _send_head(self, status: int, reason: str | None, headers: list[tuple[str, str]]) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def _linger_close(self) -> None:
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_SECONDS)
            while self.connection.recv(COPY_CHUNK):
                pass
        except OSError:
            pass

    # Control

    def _is_control_request(self) -> bool:
        if not self.path.startswith(CONTROL_PREFIX):
            return False
        # A virtual-hosted request (bucket.host) for key "__faults__/..." is S3's, not ours.
        host = urllib.parse.urlsplit("//" + self.headers.get("Host", "")).hostname or ""
        return host == "localhost" or _is_ip_address(host) or not host


def _serve_control(handler: _ProxyHandler) -> None:
    try:
        status, answer = _control_answer(handler)
    except (ValueError, TypeError) as error:
        status, answer = 400, {"error": str(error)}
    _send_json(handler, status, answer)


def _control_answer(handler: _ProxyHandler) -> tuple[int, dict]:
    proxy = handler.server.proxy
    route = (handler.command, urllib.parse.urlsplit(handler.path).path[len(CONTROL_PREFIX):])
    request = _read_control_json(handler)
    if route == ("GET", "stats"):
        return 200, proxy.stats()
    if route == ("GET", "config"):
        return 200, proxy.config()
    if route == ("POST", "config"):
        return 200, proxy.configure(**request)
    if route == ("POST", "reset-stats"):
        proxy.reset_stats()
        return 200, proxy.stats()
    return 404, {"error": f"no control endpoint {route[0]} {CONTROL_PREFIX}{route[1]}"}


def _read_control_json(handler: _ProxyHandler) -> dict:
    length = int(handler.headers.get("Content-Length") or 0)
    if length > MAX_CONTROL_BODY:
        raise ValueError("control request too large")
    handler._send_continue_if_expected()
    raw = b"".join(handler._iter_raw_body())
    request = json.loads(raw) if raw.strip() else {}
    if not isinstance(request, dict):
        raise ValueError("control request must be a JSON object")
    return request


def _send_json(handler: _ProxyHandler, status: int, answer: dict) -> None:
    body = json.dumps(answer, indent=1).encode() + b"\n"
    handler._send_whole_answer(status, [("Content-Type", "application/json")], body)


# Helpers


@contextlib.contextmanager
def _upstream_errors() -> Iterator[None]:
    try:
        yield
    except (OSError, http.client.HTTPException) as error:
        raise UpstreamError(str(error)) from error


def _chunk_size(size_line: bytes) -> int:
    try:
        return int(size_line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise ConnectionError("bad chunk size in a chunked body") from None


def _typed_settings(settings: dict) -> dict:
    unknown = set(settings) - set(SETTING_TYPES)
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    return {name: SETTING_TYPES[name](value) for name, value in settings.items()}


def _redacted(target: str) -> str:
    """The request target with presigned-URL signatures and credentials blanked out."""
    path, _, query = target.partition("?")
    if not query:
        return target
    return f"{path}?{'&'.join(_redacted_parameter(part) for part in query.split('&'))}"


def _redacted_parameter(part: str) -> str:
    raw_key = part.partition("=")[0]
    if SECRET_QUERY_NAME.search(urllib.parse.unquote_plus(raw_key)):
        return f"{raw_key}=REDACTED"
    return part


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _describe(fault: Fault) -> str:
    if fault.action == "error":
        return str(fault.status)
    if fault.action == "reset":
        return f"reset {fault.reset_point.replace('_', ' ')}"
    return fault.action


def _log(line: str) -> None:
    print(f"s3-fault-proxy: {line}", file=sys.stderr, flush=True)


# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True,
                        help="S3 endpoint URL, e.g. http://127.0.0.1:5000")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 picks a free one")
    parser.add_argument("--port-file", type=Path, help="write the chosen port to this file")
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--reset-rate", type=float, default=0.0)
    parser.add_argument("--slow-rate", type=float, default=0.0)
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--error-statuses", default="503,500",
                        help="comma-separated statuses an error fault picks from (500, 503)")
    parser.add_argument("--reset-points", default="before_body,after_body",
                        help=f"comma-separated points a reset fault picks from {RESET_POINTS}")
    parser.add_argument("--error-match", default="",
                        help="fail only requests whose target contains this, e.g. ?delete")
    parser.add_argument("--slow-match", default="",
                        help="slow only requests whose target contains this, e.g. partNumber=")
    parser.add_argument("--ignore-conditional-writes", action="store_true",
                        help="strip If-None-Match and If-Match from writes (a store without them)")
    parser.add_argument("--refuse-conditional-writes", action="store_true",
                        help="answer writes with If-None-Match or If-Match with 501 NotImplemented")
    parser.add_argument("--body-seconds-per-mb", type=float, default=0.0,
                        help="read request bodies at this pace: a slow uplink")
    parser.add_argument("--duplicate-date", action="store_true",
                        help="every relayed answer carries its Date header twice")
    parser.add_argument("--outage-fault", choices=OUTAGE_FAULTS, default="503")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="log each injected fault to stderr")
    return parser.parse_args(argv)


def write_port_file(path: Path, port: int) -> None:
    # Write then rename, so that a reader polling for the file never sees it half written.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{port}\n")
    partial.replace(path)


def _raise_system_exit(signum, frame):
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        proxy = FaultProxy(
            upstream=args.upstream, host=args.host, port=args.port, seed=args.seed,
            error_rate=args.error_rate, reset_rate=args.reset_rate, slow_rate=args.slow_rate,
            slow_seconds=args.slow_seconds, error_statuses=args.error_statuses.split(","),
            reset_points=args.reset_points.split(","), outage_fault=args.outage_fault,
            slow_match=args.slow_match, error_match=args.error_match, ignore_conditional_writes=args.ignore_conditional_writes,
            refuse_conditional_writes=args.refuse_conditional_writes,
            body_seconds_per_mb=args.body_seconds_per_mb, duplicate_date=args.duplicate_date,
            verbose=args.verbose)
    except ValueError as error:
        print(f"s3_fault_proxy: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, _raise_system_exit)
    proxy.start()
    try:
        if args.port_file:
            write_port_file(args.port_file, proxy.port)
        print(proxy.url, flush=True)
        while True:
            signal.pause()
    finally:
        proxy.stop()


if __name__ == "__main__":
    sys.exit(main())
