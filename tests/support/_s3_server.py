"""A real S3-compatible server (moto's server mode) on 127.0.0.1, for tests and benchmarks.

Who uses what:

* ``S3Server`` starts moto on a free loopback port, either in a thread of the calling
  process (``mode="thread"``, starts in ~0.1 s) or as a child process
  (``mode="process"``, keeps moto's Python request handling off the caller's GIL; what
  the benchmarks use). ``create_bucket`` makes a bucket; ``spec``/``url`` name a
  location in it.
* ``ObjectStoreLocation`` is what fixtures hand to tests: a tensorstore kvstore spec
  dict that works as is, the matching ``s3://`` URL, and small helpers to look at the
  raw keys.

Facts about tensorstore 0.1.86's ``s3`` kvstore driver, checked against moto 5.2:

* The spec that works: ``{"driver": "s3", "bucket": B, "path": "prefix/",
  "endpoint": "http://127.0.0.1:PORT", "aws_region": "us-east-1"}`` with
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in the environment. Requests are
  path-style (``PUT /B/prefix/key``). Without ``aws_region`` it also works against
  an explicit endpoint; giving it saves a region lookup.
* ``aws_credentials`` accepts ``{"type": T}`` with T in default, anonymous,
  environment, imds, profile, ecs. There is no inline static key/secret.
* The URL form ``"s3://B/prefix/"`` parses to ``{"driver": "s3", "bucket": B,
  "path": "prefix/"}`` with no endpoint, and tensorstore does NOT honour
  ``AWS_ENDPOINT_URL``: it goes to ``B.s3.amazonaws.com`` and retries with backoff
  (a hang here, where there is no network). Code that accepts ``s3://`` URLs must
  add ``endpoint`` itself (this module exports ``AWS_ENDPOINT_URL`` so such code can
  find it).
* ``host_header`` may only be set together with ``endpoint``.
* Bucket names are validated locally ("Invalid S3 bucket name" for e.g. ``"b"``).
* Without AWS config files the aws-c-auth library logs ``Failed to open file ...
  /root/.aws/config`` at ERROR on stderr, several lines per open, while it looks for
  a profile (harmless). ``S3Server`` writes a config and a credentials file with a
  ``[default]`` profile and points AWS_CONFIG_FILE/AWS_SHARED_CREDENTIALS_FILE at
  them, which cuts that to two lines per open ("Profile credentials provider could
  not load a profile at ." and one about STS web identity), also harmless.
* Conditional writes (``KvStore.write(..., if_equal=<generation of a missing key>)``)
  are honoured: a second create-if-absent returns an empty generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                msg = f"nothing listening on 127.0.0.1:{port} after {timeout}s"
                raise TimeoutError(msg) from None
            time.sleep(0.05)


def unique_bucket_name(prefix: str = "fop") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclasses.dataclass(frozen=True)
class ObjectStoreLocation:
    """A prefix in a bucket on a test server, in every form the core accepts.

    ``spec`` is a complete tensorstore kvstore spec (works in any process whose
    environment includes ``env``); ``url`` is the ``s3://``/``gs://`` form, which
    needs the endpoint from the environment (see the module docstring).
    """

    scheme: str  # "s3" or "gs"
    bucket: str
    prefix: str  # no leading slash, no trailing slash
    endpoint: str
    env: dict  # environment variables a process needs to reach the server

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def spec(self) -> dict:
        path = self.prefix + "/" if self.prefix else ""
        if self.scheme == "s3":
            return {
                "driver": "s3",
                "bucket": self.bucket,
                "path": path,
                "endpoint": self.endpoint,
                "aws_region": REGION,
            }
        return {"driver": "gcs", "bucket": self.bucket, "path": path}

    def join(self, *parts: str) -> ObjectStoreLocation:
        prefix = "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))
        return dataclasses.replace(self, prefix=prefix)

    def kvstore(self):
        """An open tensorstore KvStore rooted at this prefix (keys relative to it)."""
        import tensorstore as ts

        return ts.KvStore.open(self.spec).result()

    def keys(self) -> list[str]:
        """Every raw key under this prefix, relative to it, sorted."""
        return sorted(k.decode() for k in self.kvstore().list().result())

    def read(self, key: str) -> bytes | None:
        r = self.kvstore().read(key).result()
        return r.value if r.state == "value" else None

    def delete(self, key: str) -> None:
        self.kvstore().write(key, None).result()


class S3Server:
    """moto's S3 server on 127.0.0.1.

    Call ``start()`` (or use as a context manager), then ``create_bucket()`` and
    ``location()``. ``env`` holds what a child process needs; ``apply_env()`` puts
    it into ``os.environ`` of this process and returns a function that undoes it.
    """

    def __init__(self, mode: str = "thread", port: int | None = None):
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        self.mode = mode
        self.port = port or free_port()
        self._server = None
        self._proc = None
        self._aws_dir = tempfile.mkdtemp(prefix="fop-aws-")
        with open(os.path.join(self._aws_dir, "credentials"), "w") as f:
            f.write(f"[default]\naws_access_key_id = {ACCESS_KEY}\n")
            f.write(f"aws_secret_access_key = {SECRET_KEY}\n")
        with open(os.path.join(self._aws_dir, "config"), "w") as f:
            f.write(f"[default]\nregion = {REGION}\n")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": os.path.join(self._aws_dir, "config"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self._aws_dir, "credentials"),
        }

    def start(self, timeout: float = 30.0) -> S3Server:
        if self.mode == "thread":
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, **self.env},
            )
        _wait_listening(self.port, timeout)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        shutil.rmtree(self._aws_dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def create_bucket(self, name: str | None = None) -> str:
        name = name or unique_bucket_name()
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {resp.status}")
        return name

    def location(self, bucket: str, prefix: str = "") -> ObjectStoreLocation:
        return ObjectStoreLocation("s3", bucket, prefix.strip("/"), self.endpoint, self.env)

    def apply_env(self):
        return _apply_env(self.env)


def _apply_env(env: dict):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def undo():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return undo


if __name__ == "__main__":
    # Manual use: `python tests/support/_s3_server.py` runs a server until Ctrl-C.
    with S3Server(mode="thread") as srv:
        bucket = srv.create_bucket("scratch")
        print("endpoint", srv.endpoint, "bucket", bucket, flush=True)
        print("spec", srv.location(bucket, "ckpt").spec, flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
