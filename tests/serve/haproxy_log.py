"""Serve's HAProxy access log, kept by the serving tests so that a stream that ends badly can say what HAProxy
saw of it.

Serve's HAProxy logs each request over syslog (UDP) to ``RAY_SERVE_HAPROXY_LOG_TARGET`` (by default
127.0.0.1:514, where nothing listens). ``HAProxyLog`` listens on a free loopback port instead; the head is
started with the variable pointing there (``tests/serve/conftest.py``). A request's line names the process
(each reload starts one), the server it went to (a replica or Serve's fallback proxy), its timers, its bytes
and HAProxy's termination state (``----`` for a normal end; ``SD``: the server closed mid-data, ``CD``: the
client, ``K``: HAProxy killed it).
"""

from __future__ import annotations

import collections
import socket
import threading
import time

LOOPBACK = "127.0.0.1"


class HAProxyLog:
    """The last ``capacity`` syslog lines HAProxy sent, each with the time it arrived."""

    def __init__(self, capacity: int = 20_000) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((LOOPBACK, 0))
        self._socket.settimeout(0.5)
        self.target = f"{LOOPBACK}:{self._socket.getsockname()[1]}"
        self._lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=capacity)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="haproxy-log", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self._lines.append((time.time(), data.decode(errors="replace").strip()))

    def about(self, client_port: int, wait_s: float = 2.0) -> list[str]:
        """The lines of the requests from local port ``client_port`` (HAProxy logs one when it ends, so this waits
        up to ``wait_s`` for it), then the reloads' lines (``Proxy ... stopped``) of the last minute."""
        marker = f"{LOOPBACK}:{client_port} "
        deadline = time.monotonic() + wait_s
        while not (found := [line for _, line in list(self._lines) if marker in line]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        since = time.time() - 60
        reloads = [f"{at:.3f} {line}" for at, line in list(self._lines) if at > since and "stopped" in line]
        return found + reloads

    def close(self) -> None:
        self._closed.set()
        self._socket.close()
        self._thread.join(timeout=2)
