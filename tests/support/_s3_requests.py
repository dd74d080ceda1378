"""Counts the HTTP requests a moto S3 server in this process answers, by kind.

``_s3_server.S3Server(mode="thread")`` serves through werkzeug, which logs one line
per answered request on the ``werkzeug`` logger (``"GET /bucket/key?x HTTP/1.1" 200
-``). :class:`S3Requests` is a logging handler on that logger: while it is entered it
counts every request line by kind: ``LIST`` (a GET of the bucket with a ``list-type``
or ``prefix`` query), ``GET``, ``HEAD``, ``PUT``, ``POST``, ``DELETE``. The line is
logged after the answer is sent, so :meth:`S3Requests.settle` waits until no new line
arrived for a moment before a count is read. Werkzeug wraps the request of any answer
but a 200 (a 206 byte-range GET, a 404) in ANSI colour escapes: they are stripped
first, so those requests count too: a 206 (a byte range) as its kind, any answer
outside 2xx as its kind and status (``"GET 404"``: a read of a missing key, which
tensorstore makes when it opens an array to write). :meth:`S3Requests.take_lines`
gives each request as (kind, key path, status).

Thread-safety: ``emit`` runs on the server's threads; counts are read under a lock.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time

_LINE = re.compile(r'"(GET|PUT|DELETE|HEAD|POST) (\S+) HTTP/[0-9.]+" (\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of non-200 answers


class S3Requests(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self._mutex = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._lines: list[tuple[str, str, int]] = []
        self._last = time.monotonic()
        self._logger = logging.getLogger("werkzeug")
        self._saved: tuple[int, bool] | None = None

    def __enter__(self) -> S3Requests:
        self._saved = (self._logger.level, self._logger.propagate)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # counted here, not printed
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        level, propagate = self._saved
        self._logger.setLevel(level)
        self._logger.propagate = propagate

    def emit(self, record: logging.LogRecord) -> None:
        m = _LINE.search(_ANSI.sub("", record.getMessage()))
        if not m:
            return
        method, target, status = m.groups()
        path, _, query = target.partition("?")
        kind = method
        if method == "GET" and re.search(r"(^|&)(list-type|prefix|delimiter)=", query):
            kind = "LIST"
        if not status.startswith("2"):
            kind = f"{kind} {status}"
        with self._mutex:
            self._counts[kind] += 1
            self._lines.append((kind, path, int(status)))
            self._last = time.monotonic()

    def settle(self, quiet_s: float = 0.1, timeout_s: float = 5.0) -> None:
        """Waits until no request was logged for ``quiet_s`` (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._mutex:
                idle = time.monotonic() - self._last
            if idle >= quiet_s:
                return
            time.sleep(quiet_s - idle)

    def take(self) -> dict[str, int]:
        """The counts since the last ``take`` (after :meth:`settle`), and a reset."""
        self.settle()
        with self._mutex:
            out = dict(self._counts)
            self._counts.clear()
            self._lines.clear()
        return out

    def take_lines(self) -> list[tuple[str, str, int]]:
        """Each request since the last take as (kind, path, status), and a reset."""
        self.settle()
        with self._mutex:
            out = list(self._lines)
            self._counts.clear()
            self._lines.clear()
        return out
