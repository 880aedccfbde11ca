"""pytest fixtures for a real S3 endpoint on 127.0.0.1: a SeaweedFS server (``tests/seaweedfs.py``) behind the
logging, fault-injecting proxy of ``tests/scripts/s3_server.py`` (a subprocess).

``s3_endpoint_server`` (session) starts both once (~5 s); ``s3`` (per test) creates a bucket of its own,
points the AWS environment at the proxy (the server's test credentials, us-east-1, ``AWS_ENDPOINT_URL``) and
yields an :class:`S3Endpoint`. Register both with one line in tests/conftest.py::

    from s3_endpoint import s3, s3_endpoint_server  # noqa: F401  (S3 endpoint fixtures)

Imports only the standard library and pytest, so collecting other tests stays cheap.
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

import seaweedfs

_SERVER = Path(__file__).resolve().parent / "scripts" / "s3_server.py"
_AWS_VARS = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE", "AWS_REGION",
             "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
_counter = itertools.count()


class S3Server:
    """The endpoint: the proxy process on a free port in front of ``backend`` ("seaweedfs": a SeaweedFS server
    with its files beside ``log_path``; "moto": moto inside the proxy process, what scripts/bench_s3*.py have
    measured so far). Each process is stopped by its own pid."""

    def __init__(self, log_path: Path, backend: str = "moto") -> None:
        self.seaweedfs: Optional[seaweedfs.SeaweedFS] = None
        args = [sys.executable, str(_SERVER), "--log", str(log_path)]
        if backend == "seaweedfs":
            self.seaweedfs = seaweedfs.start(Path(log_path).parent / "seaweedfs", volumes_per_bucket=1)
            args += ["--upstream", self.seaweedfs.endpoint]
        elif backend != "moto":
            raise ValueError(f"backend {backend!r}: seaweedfs or moto")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        try:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        except BaseException:
            self.stop()
            raise
        line: List[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        if not line or not line[0].strip():
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"the S3 test endpoint did not start (exit {self.proc.returncode}): {err[-2000:]}")
        self.port = int(json.loads(line[0])["port"])
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: Optional[bytes] = None) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status >= 300:
                raise RuntimeError(f"S3 test endpoint: {method} {path} -> HTTP {resp.status}: {data[:300]!r}")
            return data
        finally:
            conn.close()

    def create_bucket(self, bucket: str) -> None:
        """A new bucket (a signed request: SeaweedFS checks signatures; moto takes the unsigned PUT)."""
        if self.seaweedfs is None:
            self.request("PUT", f"/{bucket}")
            return
        client = self.seaweedfs.client()
        try:
            client.create_bucket(Bucket=bucket)
        finally:
            client.close()

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.seaweedfs is not None:
            self.seaweedfs.stop()


class S3Endpoint:
    """What a test sees: its own bucket on the shared endpoint, the request log, failure injection."""

    def __init__(self, server: S3Server, bucket: str) -> None:
        self.server = server
        self.bucket = bucket
        self.endpoint = server.endpoint

    def url(self, prefix: str = "") -> str:
        """``s3://<this test's bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def requests(self, all_buckets: bool = False) -> List[Dict[str, Any]]:
        """The request log (this bucket's requests unless ``all_buckets``), oldest first."""
        lines = self.server.request("GET", "/__log__").decode().splitlines()
        entries = [json.loads(x) for x in lines if x.strip()]
        return entries if all_buckets else [e for e in entries if e["bucket"] == self.bucket]

    def inject(self, status: int = 503, count: int = 1, method: Optional[str] = None, match: Optional[str] = None,
               code: Optional[str] = None, truncate: Optional[int] = None, query: Optional[str] = None,
               after: bool = False, bucket: Optional[str] = None) -> None:
        """Fail the next ``count`` requests to this bucket (or ``bucket``) that match (method, path substring,
        query parameter name) with ``status`` (S3 error ``code``), or cut their answers after ``truncate`` body
        bytes. ``after``: the request is carried out first and only its answer is replaced (a lost answer)."""
        rule: Dict[str, Any] = {"status": status, "count": count, "bucket": bucket or self.bucket}
        for name, value in (("method", method), ("match", match), ("code", code), ("truncate", truncate),
                            ("query", query), ("after", after or None)):
            if value is not None:
                rule[name] = value
        self.server.request("POST", "/__inject__", json.dumps(rule).encode())

    def reset(self) -> None:
        """Clear the request log and any injections not used up."""
        self.server.request("POST", "/__reset_log__", b"")

    def boto3(self) -> Any:
        """A plain boto3 client on the endpoint (to create, inspect or tamper with objects behind megashard)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing",
                            config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="session")
def s3_endpoint_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3") / "requests.jsonl", backend="seaweedfs")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    """A fresh bucket on the test endpoint, with the AWS environment pointing at it."""
    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # never the developer's ~/.aws
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint_server.endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = f"t{next(_counter)}-{uuid.uuid4().hex[:12]}-{int(time.time()) % 100000}"
    s3_endpoint_server.create_bucket(bucket)
    _forget_stores()
    try:
        yield S3Endpoint(s3_endpoint_server, bucket)
    finally:
        _forget_stores()


def _forget_stores() -> None:
    """Stores cache boto3 clients made with the previous test's environment."""
    client = sys.modules.get("megashard.storage.s3.client")
    if client is not None:
        client.clear_store_cache()
