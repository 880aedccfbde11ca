"""An S3 client sized for checkpoints: few small control requests, many large data requests.

Control path (HEAD, small GET/PUT, LIST, DELETE, multipart create/complete/abort) goes through a boto3
client, so credentials, regions and endpoints work the way S3 users already configure them. The bulk
path (ranged GETs into tensors, PUTs of file bytes and multipart parts) uses URLs presigned locally by
botocore and plain ``http.client`` connections (one persistent connection per thread), reading with
``readinto`` straight into the caller's memoryviews and sending straight from them: no copies, no
per-byte signing or hashing in Python. Every ranged GET carries ``If-Match`` with the ETag the checkpoint
recorded and is checked against ``Content-Range``/``Content-Length``, so a replaced object can never be
read as the checkpoint's bytes.

boto3/botocore are imported only when an object URL is actually used.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import http.client
import itertools
import logging
import os
import queue
import random
import re
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar
from urllib.parse import urlsplit

from isal import isal_zlib

from ... import exiting
from ...errors import CheckpointError, CommitConflictError, ObjectChangedError
from .url import ObjectURL, join_key, parse_url

log = logging.getLogger(__name__)

MiB = 1 << 20
GAP_BYTES = MiB  # requests at most this far apart are read by one GET (the gap into a scratch buffer)
# a GET computing CRC32s reads this much at a time (``readinto`` returns only once its view is full) and
# checksums it while it is still in cache and the next bytes are on their way: the CRC32 of a 16 MiB GET
# then ends ~1 slice after its last byte, not a pass over 16 MiB after it
_CRC_SLICE = MiB
_MIN_PART = 5 * MiB  # S3's smallest multipart part (all but the last)
_MIN_DEFAULT_PART = 8 * MiB  # smaller parts only add requests
_MAX_PART = 5 * 1024 * MiB
_MAX_PARTS = 10000
_PRESIGN_SECONDS = 3600
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_RETRY_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                          "ThrottlingException", "RequestTimeTooSkewed"})
_ERROR_BODY_LIMIT = 64 * 1024
_PAGE = 1000  # LIST page and DeleteObjects batch (S3's maximum for both)
# a bulk connection unused this long is replaced, not reused: servers close idle keep-alive connections
# (SeaweedFS within 150 s, AWS sooner), and the first request on a closed one fails (a retry, a resent part)
_IDLE_REUSE_S = 15.0
_clock = time.monotonic
KINDS = ("HEAD", "GET", "GET_RANGE", "PUT", "LIST", "DELETE", "MPU_CREATE", "MPU_PART", "MPU_COMPLETE", "MPU_ABORT",
         "MPU_LIST")

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """One object as S3 lists it; ``etag`` is kept exactly as S3 returns it (quoted)."""

    key: str
    size: int
    etag: str
    last_modified: float


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise CheckpointError(f"{name}={raw!r} is not an integer; unset it or give a number") from None
    if value < minimum:
        raise CheckpointError(f"{name}={value} is below its minimum {minimum}")
    return value


def connections() -> int:
    """Parallel connections per bulk call (``MEGASHARD_S3_CONNECTIONS``, default 16)."""
    return _env_int("MEGASHARD_S3_CONNECTIONS", 16, 1)


def get_bytes_limit() -> int:
    """Largest single ranged GET (``MEGASHARD_S3_GET_BYTES``, default 16 MiB)."""
    return _env_int("MEGASHARD_S3_GET_BYTES", 16 * MiB, 1)


def get_bytes_for(total: int, conns: int) -> int:
    """The GET size of one bulk read of ``total`` bytes on ``conns`` connections:
    ``MEGASHARD_S3_GET_BYTES`` when set; else about one round of equal GETs, one per connection,
    as a whole multiple of 16 MiB from 16 to 64 MiB (a multiple of the 16 MiB parts a save
    writes, so a GET is served from whole parts). Fewer, larger GETs cost the client and the
    server less per byte (SeaweedFS, 512 MiB on 16 connections: 33 GETs of 16 MiB took ~0.25
    client CPU-s, 9 of 64 MiB ~0.18); 16 MiB keeps every connection busy on smaller reads."""
    if os.environ.get("MEGASHARD_S3_GET_BYTES"):
        return get_bytes_limit()
    step = 16 * MiB
    share = -(-max(0, total) // max(1, conns))
    return min(4 * step, max(step, -(-share // step) * step))


def single_put_bytes() -> int:
    """Objects up to this size go up in one PUT (``MEGASHARD_S3_PART_BYTES``, default 64 MiB)."""
    return max(_MIN_PART, _env_int("MEGASHARD_S3_PART_BYTES", 64 * MiB, 1))


def _part_spans(size: int, part: int, conns: int) -> List[Tuple[int, int]]:
    """``[a, b)`` of each part of a multipart upload of ``size`` bytes in parts of ``part`` on
    ``conns`` connections. When the whole parts fill whole rounds of the connections, a shorter last
    part goes with the one before it (256 MiB + 20 KiB in 16 MiB parts on 16 connections: 16 parts,
    not 17): one request less, no connection sends more, every part still starts at a multiple of
    ``part``."""
    full, rest = divmod(size, part)
    if full and rest and full % conns == 0 and part + rest <= _MAX_PART:
        return [(i * part, (i + 1) * part) for i in range(full - 1)] + [((full - 1) * part, size)]
    return [(i * part, min(size, (i + 1) * part)) for i in range(-(-size // part))]


def _connection_bytes(size: int, part: int, conns: int) -> int:
    """The most bytes one connection sends when ``size`` goes up in parts of ``part``
    (:func:`_part_spans`) on ``conns`` connections, the last part on one with the fewest others."""
    spans = _part_spans(size, part, conns)
    others, last = len(spans) - 1, spans[-1][1] - spans[-1][0]
    return max(-(-others // conns) * part, others // conns * part + last)


def part_bytes(size: int) -> int:
    """Multipart part size for an object of ``size`` bytes: ``MEGASHARD_S3_PART_BYTES`` when set, else
    enough parts to keep every connection busy (size / connections, whole MiB) between 8 and 64 MiB,
    made 8, 16, 32 or 64 MiB where no connection then sends more than 1.1x the bytes: parts of a
    power of two MiB hold whole ranged GETs (:meth:`ObjectStore.read_many` cuts them at multiples of
    ``MEGASHARD_S3_GET_BYTES``, 16 MiB), so a GET is served from one part (S3; SeaweedFS: from whole
    4 MiB chunks), not from the ends of two (measured on SeaweedFS: ~20% less server CPU per load)."""
    conns = connections()
    default = min(64 * MiB, max(_MIN_DEFAULT_PART, -(-(-(-size // conns)) // MiB) * MiB))
    if default & (default - 1):  # not a power of two: the largest power of two MiB that costs <= 10%
        budget = 1.1 * _connection_bytes(size, default, conns)
        fits = [p for p in (64 * MiB, 32 * MiB, 16 * MiB, 8 * MiB) if _connection_bytes(size, p, conns) <= budget]
        default = fits[0] if fits else default
    part = max(_MIN_PART, _env_int("MEGASHARD_S3_PART_BYTES", default, 1))
    if -(-size // part) > _MAX_PARTS:  # S3 allows 10000 parts: grow the part, in whole MiB
        part = -(-(-(-size // _MAX_PARTS)) // MiB) * MiB
    return min(part, _MAX_PART)


def _retries() -> int:
    return _env_int("MEGASHARD_S3_RETRIES", 8, 0)


def _backoff(attempt: int) -> float:
    """Exponential backoff with jitter: base 0.05 s, cap 5 s."""
    delay = min(5.0, 0.05 * (2 ** attempt))
    return delay / 2 + random.uniform(0, delay / 2)


class ObjectTooLargeError(CheckpointError):
    """An object is larger than what megashard reads of it (refused before its body is read)."""


class _Retryable(Exception):
    """A transient failure (5xx, SlowDown, a dropped connection): the request may be sent again."""


# --------------------------------------------------------------------------------------------------- boto3

def _boto():
    """Import boto3 only when an object URL is used; a clear error when it is not installed."""
    try:
        import boto3  # noqa: F401
        import botocore.config  # noqa: F401
        import botocore.exceptions  # noqa: F401
    except ImportError as e:
        raise CheckpointError(f"s3:// checkpoints need boto3 ({e}): pip install boto3 "
                              f"(or pip install 'megashard[s3]')") from None
    return boto3, botocore


def _env_endpoint() -> Optional[str]:
    """The endpoint botocore would take from the environment (we need it to choose path-style addressing)."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


# --------------------------------------------------------------------------------------------------- process state

_STORES: Dict[Tuple[str, Optional[str], Optional[str]], "ObjectStore"] = {}
_STORES_LOCK = threading.Lock()
_LOCAL = threading.local()  # per thread: {(scheme, host, port): HTTPConnection}, scratch buffer
_POOL: Optional["_Threads"] = None
_POOL_LOCK = threading.Lock()


def _after_fork() -> None:
    """A forked child must not share sockets, threads or boto3 clients with its parent."""
    global _LOCAL, _POOL, _STORES_LOCK, _POOL_LOCK
    _STORES.clear()
    _LOCAL = threading.local()
    _POOL = None
    _STORES_LOCK = threading.Lock()
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def clear_store_cache() -> None:
    """Forget cached stores (tests switch endpoints and credentials between cases)."""
    with _STORES_LOCK:
        _STORES.clear()


class _Threads:
    """Persistent worker threads, so each keeps its connection open between calls. A call gets
    as many threads at once as it asks for: idle ones, else new ones. (``ThreadPoolExecutor``
    has a fixed size and counts idle threads loosely: a load's GETs could wait behind busy
    threads, started only as earlier GETs finished, and nested calls could deadlock.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: List["queue.SimpleQueue[Any]"] = []
        self._all: List[Tuple[threading.Thread, "queue.SimpleQueue[Any]"]] = []
        self._count = 0
        self._closed = False

    def start(self, work: Callable[[], None]) -> threading.Event:
        """Run ``work`` on a thread of its own now; the event is set when it returns."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise CheckpointError("the S3 client's threads have stopped: the interpreter is exiting")
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._count += 1
                inbox = queue.SimpleQueue()
                t = threading.Thread(target=self._serve, args=(inbox,), name=f"megashard-s3-{self._count}",
                                     daemon=True)
                self._all.append((t, inbox))
                t.start()
        inbox.put((work, done))
        return done

    def stop(self) -> None:
        """At exit: end every thread (each after its current work) and wait for them, so none is
        left inside a call during interpreter teardown."""
        with self._lock:
            self._closed = True
            threads = list(self._all)
        for _, inbox in threads:
            inbox.put(None)
        for t, _ in threads:
            t.join()

    def _serve(self, inbox: "queue.SimpleQueue[Any]") -> None:
        while True:
            item = inbox.get()
            if item is None:
                return
            work, done = item
            try:
                work()  # never raises: _run_parallel's worker keeps its own errors
            finally:
                work = None
                with self._lock:
                    self._idle.append(inbox)
                done.set()


def _threads() -> _Threads:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Threads()
        return _POOL


def _stop_threads() -> None:
    pool = _POOL
    if pool is not None:
        pool.stop()


exiting.at_exit(exiting.THREADS, _stop_threads)


def _run_parallel(tasks: Sequence[Callable[[], T]], threads: int) -> List[T]:
    """Run ``tasks`` on up to ``threads`` threads at once (the caller's one of them); the first failure
    stops the rest and is raised."""
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    n = min(threads, len(tasks))
    results: List[Any] = [None] * len(tasks)
    errors: List[BaseException] = []
    lock = threading.Lock()
    pending = iter(range(len(tasks)))

    def worker() -> None:
        while True:
            with lock:
                if errors:
                    return
                i = next(pending, None)
            if i is None:
                return
            try:
                results[i] = tasks[i]()
            except BaseException as e:  # noqa: B902 - handed to the caller below
                with lock:
                    errors.append(e)
                return

    pool = _threads()
    started = [pool.start(worker) for _ in range(n - 1)]
    worker()
    for ev in started:
        ev.wait()
    if errors:
        raise errors[0]
    return results


_SSL: Optional[ssl.SSLContext] = None


def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, trusting AWS_CA_BUNDLE when set (as botocore does)."""
    global _SSL
    if _SSL is None:
        _SSL = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
    return _SSL


def _scratch() -> memoryview:
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None:
        buf = _LOCAL.scratch = memoryview(bytearray(GAP_BYTES))
    return buf


class FileRange:
    """A read destination that is ``nbytes`` of an open file at ``offset``: a GET fills it through the
    thread's small scratch buffer and ``pwrite``. Why: scatter's ring is an anonymous memory file whose
    slots an object store's GETs fill once each; written through a mapping, every fresh shared page costs
    the reader a fault (~0.4 ms per MiB on top of the copy, measured), written with ``pwrite`` the
    kernel fills them in the page cache (a fallocated page is not even zeroed)."""

    __slots__ = ("fd", "offset", "nbytes")

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"file range {offset}+{nbytes}")
        self.fd, self.offset, self.nbytes = fd, offset, nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, s: slice) -> "FileRange":
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("a file range slices with step 1 only")
        return FileRange(self.fd, self.offset + start, max(0, stop - start))

    def write(self, pos: int, data: memoryview) -> None:
        """Write ``data`` at ``pos`` within the range (all of it)."""
        if pos < 0 or pos + data.nbytes > self.nbytes:
            raise ValueError(f"{data.nbytes} bytes at {pos} exceed the file range's {self.nbytes}")
        done = 0
        while done < data.nbytes:
            try:
                n = os.pwrite(self.fd, data[done:], self.offset + pos + done)
            except OSError as e:  # not a network error: never retried as one
                raise CheckpointError(f"cannot write downloaded bytes into the destination file (descriptor "
                                      f"{self.fd}, offset {self.offset + pos + done}): {e}") from None
            if n <= 0:
                raise CheckpointError(f"writing downloaded bytes into descriptor {self.fd} made no progress")
            done += n


def _byte_view(view: Any) -> Any:
    """A 1-D byte memoryview of ``view``, or ``view`` itself when it is a :class:`FileRange`."""
    if isinstance(view, FileRange):
        return view
    mv = view if isinstance(view, memoryview) else memoryview(view)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_XML_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(rb"<Message>([^<]{0,300})</Message>")


def _multipart_etag(part_etags: Sequence[str]) -> str:
    """The ETag S3 gives a completed multipart upload: MD5 of the parts' binary MD5s, "-" part count."""
    md5 = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        try:
            md5.update(bytes.fromhex(etag.strip('"')))
        except ValueError:  # not an MD5 (e.g. SSE-KMS): cannot tell, so never claim success
            return ""
    return f'"{md5.hexdigest()}-{len(part_etags)}"'


def _xml_field(pattern: "re.Pattern[bytes]", body: bytes) -> str:
    m = pattern.search(body)
    return m.group(1).decode("utf-8", "replace") if m else ""


# --------------------------------------------------------------------------------------------------- the store

class _CrcPart:
    """The CRC32 of ``n`` bytes at ``pos`` of request ``req`` of job ``job``, computed by the GET that
    fills them as each ``readinto`` lands (see :meth:`ObjectStore.read_many`'s ``crcs``)."""

    __slots__ = ("job", "req", "pos", "n", "crc")

    def __init__(self, job: int, req: int, pos: int, n: int) -> None:
        self.job, self.req, self.pos, self.n, self.crc = job, req, pos, n, 0


def _job_crc(parts: Sequence[_CrcPart], lengths: Sequence[int]) -> Optional[int]:
    """The CRC32 of a job's requests (``lengths`` bytes each) concatenated in order, combined from the
    CRC32s of the GET pieces that filled them; None unless the pieces tile every request exactly."""
    crc, req, pos = 0, 0, 0
    for p in sorted(parts, key=lambda p: (p.req, p.pos)):
        while req < len(lengths) and pos == lengths[req]:
            req, pos = req + 1, 0
        if p.req != req or p.pos != pos:
            return None
        crc = isal_zlib.crc32_combine(crc, p.crc, p.n)
        pos += p.n
    while req < len(lengths) and pos == lengths[req]:
        req, pos = req + 1, 0
    return crc if req == len(lengths) else None


def _owners(gets: Sequence[Tuple[int, int, Any]], jobs: Sequence[Tuple[int, Sequence[Tuple[int, Any]]]]
            ) -> List[List[int]]:
    """Per GET of one object (``(first byte, end, ...)``): the jobs ``(i, reqs)`` it holds bytes of.
    Each request finds its GETs by bisection (a job of tens of thousands of rows, a load of
    thousands of jobs: no GET x job scan)."""
    order = sorted(range(len(gets)), key=lambda k: gets[k][0])
    starts = [gets[k][0] for k in order]
    out: List[List[int]] = [[] for _ in gets]
    for i, reqs in jobs:
        seen = set()
        for off, v in reqs:
            end = off + _byte_view(v).nbytes
            k = max(0, bisect.bisect_right(starts, off) - 1)
            while k < len(order) and starts[k] < end:
                g = order[k]
                if gets[g][1] > off and end > off and g not in seen:
                    seen.add(g)
                    out[g].append(i)
                k += 1
    return out


def _balanced_limit(lengths: Sequence[int], conns: int) -> Optional[int]:
    """A smaller GET size when the GETs planned (``lengths``, each at most the GET size) are more than
    the connections and their last, partial round holds half a GET or more: those GETs would run
    alone after every other connection has finished (17 GETs of 16 MiB on 16 connections: the 17th
    doubles the load's time). Cut into as many whole rounds as the planned GETs need (34 GETs of
    8 MiB). None: keep the plan (a last round of a few KiB, such as a file's header, costs a round
    trip, not a GET's time)."""
    n = len(lengths)
    if n <= conns or n % conns == 0:
        return None
    limit = max(lengths)
    tail = sum(lengths) - (n // conns) * conns * limit  # bytes beyond the whole rounds of full GETs
    if tail * 2 < limit:
        return None
    rounds = -(-n // conns)
    return max(1, -(-sum(lengths) // (rounds * conns)))


class ObjectStore:
    """One bucket on one S3 endpoint. Thread-safe; cheap to share (``for_url`` caches one per bucket)."""

    def __init__(self, bucket: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 profile: Optional[str] = None) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url or _env_endpoint()
        self.region = region
        self.profile = profile
        self.stats: "collections.Counter[str]" = collections.Counter()
        self.retries: "collections.Counter[str]" = collections.Counter()
        self._credentials: Dict[str, str] = {}
        self._stats_lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._client_pid = 0

    def __repr__(self) -> str:
        return f"ObjectStore(s3://{self.bucket}, endpoint={self.endpoint_url or 'AWS'})"

    # ----------------------------------------------------------------------------------------- construction
    @classmethod
    def for_url(cls, url: str) -> Tuple["ObjectStore", str]:
        """The (cached) store for an ``s3://`` or ``msc://`` URL, and the key the URL names in it."""
        parsed = url if isinstance(url, ObjectURL) else parse_url(url)
        if parsed.scheme == "msc":
            return _msc_store(parsed)
        endpoint = _env_endpoint()
        profile = os.environ.get("AWS_PROFILE") or None
        cache_key = (parsed.bucket, endpoint, profile)
        with _STORES_LOCK:
            store = _STORES.get(cache_key)
            if store is None:
                store = _STORES[cache_key] = cls(parsed.bucket, endpoint_url=endpoint, profile=profile)
        return store, parsed.key

    def url(self, key: str) -> str:
        """``s3://bucket/key``, the name errors use."""
        return f"s3://{self.bucket}/{key}"

    def boto3_client(self) -> Any:
        """The boto3 S3 client of the control path (created once per process)."""
        with self._client_lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = self._make_client()
                self._client_pid = os.getpid()
            return self._client

    def _make_client(self) -> Any:
        boto3, botocore = _boto()
        try:
            session = boto3.session.Session(profile_name=self.profile, **self._credentials)
        except botocore.exceptions.BotoCoreError as e:
            raise CheckpointError(f"s3://{self.bucket}: cannot set up AWS credentials: {e}; check AWS_PROFILE "
                                  f"and ~/.aws/config") from None
        s3_opts = {"addressing_style": "path"} if self.endpoint_url else {}
        config = botocore.config.Config(
            signature_version="s3v4", s3=s3_opts, retries={"total_max_attempts": 1},  # we retry ourselves
            connect_timeout=20, read_timeout=120, max_pool_connections=max(10, connections()),
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        region = self.region or session.region_name
        if region is None and self.endpoint_url is None:
            region = self._bucket_region(session, config)
        try:
            return session.client("s3", endpoint_url=self.endpoint_url, region_name=region or "us-east-1",
                                  config=config)
        except (ValueError, botocore.exceptions.BotoCoreError) as e:
            raise CheckpointError(f"s3://{self.bucket}: cannot create an S3 client for endpoint "
                                  f"{self.endpoint_url or 'AWS'}: {e}; check AWS_ENDPOINT_URL") from None

    def _bucket_region(self, session: Any, config: Any) -> Optional[str]:
        """AWS without a configured region: ask where the bucket lives, so presigned URLs are signed for it."""
        _, botocore = _boto()
        probe = session.client("s3", region_name="us-east-1", config=config)
        try:
            meta = probe.head_bucket(Bucket=self.bucket)["ResponseMetadata"]
        except botocore.exceptions.ClientError as e:
            meta = e.response.get("ResponseMetadata", {})
        except botocore.exceptions.BotoCoreError:
            return None
        return meta.get("HTTPHeaders", {}).get("x-amz-bucket-region")

    def _count(self, kind: str, retry: bool = False) -> None:
        with self._stats_lock:
            self.stats[kind] += 1
            if retry:
                self.retries[kind] += 1

    # ----------------------------------------------------------------------------------------- control path
    def _call(self, kind: str, key: str, op: str, *, not_found: Any = ..., conflict: type = CheckpointError,
              conflict_hint: str = "; another writer changed the object first", missing_is_conflict: bool = False,
              landed: Optional[Callable[[], Any]] = None, **params: Any) -> Any:
        """One boto3 call with our retry policy; errors become CheckpointError naming s3://bucket/key.

        ``not_found``: returned on 404 instead of raising. ``conflict``: the class a 412/409-conflict raises,
        ``conflict_hint`` what it means. ``missing_is_conflict``: a write with If-Match, whose failed precondition
        on a missing key AWS answers 404 NoSuchKey and SeaweedFS 412: both are the same lost race.
        ``landed``: for a conditional write, called when a *retry* fails its precondition or finds no upload:
        the earlier attempt may have been applied before its answer was lost; a non-None result (the
        response to return) means it was.
        """
        client = self.boto3_client()
        _, botocore = _boto()
        exc = botocore.exceptions

        def attempt(n: int) -> Any:
            self._count(kind, retry=n > 0)
            try:
                return getattr(client, op)(Bucket=self.bucket, **params)
            except exc.ClientError as e:
                meta = e.response.get("ResponseMetadata", {})
                err = e.response.get("Error", {})
                status = int(meta.get("HTTPStatusCode") or 0)
                code = str(err.get("Code") or status)
                message = str(err.get("Message") or "")
                if status in _RETRY_STATUS or code in _RETRY_CODES:
                    raise _Retryable(f"HTTP {status} {code}") from None
                conflicted = status == 412 or (status == 409 and code == "ConditionalRequestConflict") or (
                    missing_is_conflict and status == 404 and code != "NoSuchBucket")
                if n > 0 and landed is not None and (conflicted or code == "NoSuchUpload"):
                    done = landed()
                    if done is not None:
                        log.info("S3 %s of %s: an earlier attempt was applied before its answer was lost",
                                 op, self.url(key))
                        return done
                if conflicted:
                    raise conflict(self._message(op, key, status, code, message) + conflict_hint) from None
                if status == 404 and not_found is not ...:
                    return not_found
                raise CheckpointError(self._message(op, key, status, code, message)) from None
            except (exc.NoCredentialsError, exc.PartialCredentialsError, exc.NoRegionError) as e:
                raise CheckpointError(f"{self.url(key)}: {e}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                                      f"AWS_PROFILE (and AWS_DEFAULT_REGION / AWS_ENDPOINT_URL)") from None
            except (exc.HTTPClientError, exc.ConnectionError) as e:
                raise _Retryable(f"connection error: {e}") from None
            except exc.BotoCoreError as e:
                raise CheckpointError(f"S3 {op} of {self.url(key)} failed: {e}") from None

        return self._retrying(kind, op, key, attempt)

    def _message(self, op: str, key: str, status: int, code: str, message: str) -> str:
        hint = self._meaning(status, code)
        if not hint and status == 404:
            hint = "; the object does not exist"
        return f"S3 {op} of {self.url(key)} failed: HTTP {status} {code} {message}".rstrip() + hint

    def _meaning(self, status: int, code: str) -> str:
        """What an answer about the bucket means, whichever store gave it: AWS answers a missing bucket 404
        NoSuchBucket, SeaweedFS (and AWS to a caller without s3:ListBucket) 403."""
        where = self.endpoint_url or "AWS"
        if code == "NoSuchBucket":
            return f"; bucket {self.bucket!r} does not exist on {where}"
        if status == 403:
            return (f"; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket policy; bucket "
                    f"{self.bucket!r} may not exist on {where} (stores answer 403 for a missing bucket too)")
        return ""

    def _retrying(self, kind: str, op: str, key: str, attempt: Callable[[int], T]) -> T:
        retries = _retries()
        n = 0
        while True:
            try:
                return attempt(n)
            except _Retryable as e:
                if n >= retries:
                    raise CheckpointError(f"S3 {op} of {self.url(key)} failed after {n + 1} attempts: {e}; the "
                                          f"endpoint is unavailable or overloaded (MEGASHARD_S3_RETRIES={retries})"
                                          ) from None
                delay = _backoff(n)
                log.debug("S3 %s of %s: %s; retry %d in %.2f s", op, self.url(key), e, n + 1, delay)
                time.sleep(delay)
                n += 1

    def head(self, key: str) -> Optional[ObjectInfo]:
        """The object's size and ETag, or None when it does not exist."""
        resp = self._call("HEAD", key, "head_object", Key=key, not_found=None)
        if resp is None:
            return None
        return ObjectInfo(key, int(resp["ContentLength"]), resp["ETag"], resp["LastModified"].timestamp())

    def get_bytes(self, key: str, limit: int, *, if_match: Optional[str] = None) -> Tuple[bytes, str]:
        """The whole object and its ETag; refuses (before reading the body) objects over ``limit`` bytes.

        A presigned GET on this thread's ``http.client`` connection, like the bulk path's, not a boto3
        call: a load's head, digest and index are three of these before its first ranged GET, and
        boto3's request pipeline cost ~1.5 ms of CPU each (measured), on the load's critical path.
        Answers are read as boto3 would: 412 on ``if_match`` is :class:`ObjectChangedError`, 5xx and
        SlowDown are retried, other errors name the object and what the status means."""
        url = self._presign("get_object", key)

        def attempt(n_try: int) -> Tuple[bytes, str]:
            self._count("GET", retry=n_try > 0)
            conn = self._send_get(url, if_match)
            return self._whole_answer(key, url, conn, limit)

        return self._retrying("GET", "get_object", key, attempt)

    def get_bytes_many(self, reqs: Sequence[Tuple[str, int, Optional[str]]]) -> List[Any]:
        """:meth:`get_bytes` of several small objects ``(key, limit, if_match)`` at once from this
        thread: every request is sent (each on a connection of its own) before any answer is read, so
        they take one round trip together without waking another thread (on a loaded machine a woken
        thread may start milliseconds late: a load's digest and index then ran one after the other).
        Returns per request ``(bytes, ETag)`` or the error :meth:`get_bytes` raises for it; a request
        whose first attempt fails transiently is sent again through :meth:`get_bytes` (its retries)."""
        out: List[Any] = [None] * len(reqs)
        sent: List[Tuple[int, str, Any]] = []
        for slot, (key, _, if_match) in enumerate(reqs):
            try:
                url = self._presign("get_object", key)
                self._count("GET")
                sent.append((slot, url, self._send_get(url, if_match, slot)))
            except _Retryable:
                pass  # sent again below
            except CheckpointError as e:
                out[slot] = e
        again = []
        for slot, url, conn in sent:
            key, limit, _ = reqs[slot]
            try:
                out[slot] = self._whole_answer(key, url, conn, limit, slot)
            except _Retryable:
                again.append(slot)
            except CheckpointError as e:
                out[slot] = e
        for slot, (key, limit, if_match) in enumerate(reqs):
            if out[slot] is None or slot in again:
                try:
                    out[slot] = self.get_bytes(key, limit, if_match=if_match)
                except CheckpointError as e:
                    out[slot] = e
        return out

    def _send_get(self, url: str, if_match: Optional[str], slot: int = 0) -> http.client.HTTPConnection:
        """Send a GET of the whole object (its answer not read yet) on this thread's connection ``slot``."""
        conn, target = self._connection(url, slot)
        try:
            conn.putrequest("GET", target, skip_accept_encoding=True)
            if if_match:
                conn.putheader("If-Match", if_match)
            conn.endheaders()
        except (OSError, http.client.HTTPException) as e:
            self._drop(url, slot)
            raise _Retryable(f"connection error: {e!r}") from None
        return conn

    def _whole_answer(self, key: str, url: str, conn: http.client.HTTPConnection, limit: int,
                      slot: int = 0) -> Tuple[bytes, str]:
        """Read the answer to :meth:`_send_get`: the object's bytes and ETag, or the error they mean."""
        where = self.url(key)
        try:
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._drop(url, slot)
            raise _Retryable(f"connection error: {e!r}") from None
        if resp.status != 200:
            code, message = self._error_response(url, resp, slot)
            code = code or str(resp.status)
            if resp.status in _RETRY_STATUS or code in _RETRY_CODES:
                raise _Retryable(f"HTTP {resp.status} {code}")
            if resp.status == 412 or (resp.status == 409 and code == "ConditionalRequestConflict"):
                raise ObjectChangedError(self._message("get_object", key, resp.status, code, message)
                                         + "; another writer changed the object first; the object changed "
                                         "since the checkpoint was written")
            raise CheckpointError(self._message("get_object", key, resp.status, code, message))
        try:
            size = int(resp.getheader("Content-Length") or "")
        except ValueError:
            self._drop(url, slot)
            raise CheckpointError(f"GET of {where}: the endpoint sent no Content-Length") from None
        if size > limit:
            self._drop(url, slot)  # its body is never read
            raise ObjectTooLargeError(f"{where} is {size} bytes, more than the {limit} bytes megashard reads "
                                      f"for this object; it is not a megashard file")
        etag = resp.getheader("ETag")
        try:
            data = resp.read(size)
        except (OSError, http.client.HTTPException) as e:
            self._drop(url, slot)
            raise _Retryable(f"connection lost reading the body: {e!r}") from None
        if len(data) != size:
            self._drop(url, slot)
            raise _Retryable(f"got {len(data)} of {size} bytes")
        if not etag:
            raise CheckpointError(f"GET of {where}: the endpoint returned no ETag")
        return data, etag

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                  if_match: Optional[str] = None) -> str:
        """Write a small object; with ``if_none_match`` it must not exist, with ``if_match`` it must have that
        ETag, else :class:`CommitConflictError`. Returns the new ETag."""
        params: Dict[str, Any] = {"Key": key, "Body": bytes(data)}
        if if_none_match:
            params["IfNoneMatch"] = "*"
        if if_match:
            params["IfMatch"] = if_match
        if if_match and if_none_match:
            raise CheckpointError(f"{self.url(key)}: if_match and if_none_match exclude each other")
        if not (if_none_match or if_match):
            return self._call("PUT", key, "put_object", **params)["ETag"]

        def landed() -> Optional[Dict[str, Any]]:
            """Does the object now hold exactly our bytes (our lost first attempt)? None when it does not;
            a CheckpointError (not a "no") when that cannot be read."""
            info = self.head(key)
            if info is None or info.size != len(params["Body"]):
                return None
            body, etag = self.get_bytes(key, info.size, if_match=info.etag)
            return {"ETag": etag} if body == params["Body"] else None

        hint = (f"; the object no longer has ETag {if_match}: another writer replaced or deleted it first" if if_match
                else "; another writer created the object first")
        resp = self._call("PUT", key, "put_object", conflict=CommitConflictError, conflict_hint=hint, landed=landed,
                          missing_is_conflict=bool(if_match), **params)
        return resp["ETag"]

    def list(self, prefix: str, delimiter: Optional[str] = None) -> Tuple[List[ObjectInfo], List[str]]:
        """Every object under ``prefix`` (and the common prefixes when ``delimiter`` is given), paginated."""
        objects: List[ObjectInfo] = []
        prefixes: List[str] = []
        params: Dict[str, Any] = {"Prefix": prefix, "MaxKeys": _PAGE}
        if delimiter:
            params["Delimiter"] = delimiter
        while True:
            resp = self._call("LIST", prefix, "list_objects_v2", **params)
            for o in resp.get("Contents", ()):
                objects.append(ObjectInfo(o["Key"], int(o["Size"]), o["ETag"], o["LastModified"].timestamp()))
            prefixes.extend(p["Prefix"] for p in resp.get("CommonPrefixes", ()))
            if not resp.get("IsTruncated"):
                return objects, prefixes
            token = resp.get("NextContinuationToken")
            if not token:
                raise CheckpointError(f"S3 list of {self.url(prefix)}: truncated listing without a continuation "
                                      f"token")
            params["ContinuationToken"] = token

    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (missing ones are fine) in batches of 1000."""
        keys = list(keys)
        for i in range(0, len(keys), _PAGE):
            batch = keys[i:i + _PAGE]
            resp = self._call("DELETE", batch[0], "delete_objects",
                              Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in resp.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                e = errors[0]
                raise CheckpointError(f"S3 delete of {self.url(e.get('Key', ''))} failed: {e.get('Code')} "
                                      f"{e.get('Message', '')} ({len(errors)} of {len(batch)} keys failed)")

    def list_uploads(self, prefix: str) -> List[Tuple[str, str, float]]:
        """Unfinished multipart uploads under ``prefix``: (key, upload id, initiated time)."""
        out: List[Tuple[str, str, float]] = []
        params: Dict[str, Any] = {"Prefix": prefix, "MaxUploads": _PAGE}
        while True:
            resp = self._call("MPU_LIST", prefix, "list_multipart_uploads", **params)
            for u in resp.get("Uploads", ()):
                out.append((u["Key"], u["UploadId"], u["Initiated"].timestamp()))
            if not resp.get("IsTruncated"):
                return out
            params["KeyMarker"] = resp.get("NextKeyMarker", "")
            params["UploadIdMarker"] = resp.get("NextUploadIdMarker", "")

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload (already gone is fine)."""
        self._call("MPU_ABORT", key, "abort_multipart_upload", Key=key, UploadId=upload_id, not_found=None)

    # ----------------------------------------------------------------------------------------- bulk path
    def _presign(self, op: str, key: str, **params: Any) -> str:
        try:
            return self.boto3_client().generate_presigned_url(
                op, Params={"Bucket": self.bucket, "Key": key, **params}, ExpiresIn=_PRESIGN_SECONDS)
        except Exception as e:  # botocore raises several unrelated types here (credentials, params)
            _, botocore = _boto()
            exc = botocore.exceptions
            hint = ("; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (and AWS_DEFAULT_REGION / "
                    "AWS_ENDPOINT_URL)" if isinstance(e, (exc.NoCredentialsError, exc.PartialCredentialsError))
                    else "")
            raise CheckpointError(f"cannot sign a request for {self.url(key)}: {e}{hint}") from None

    @staticmethod
    def _connection(url: str, slot: int = 0) -> Tuple[http.client.HTTPConnection, str]:
        """This thread's persistent connection to the URL's host, and the request target. ``slot``:
        which of the thread's connections to that host (:meth:`get_bytes_many` keeps several requests
        in flight from one thread)."""
        parts = urlsplit(url)
        target = parts.path + ("?" + parts.query if parts.query else "")
        conns = getattr(_LOCAL, "conns", None)
        if conns is None:
            conns = _LOCAL.conns = {}
            _LOCAL.used = {}
        ident = (parts.scheme, parts.hostname, parts.port) + ((slot,) if slot else ())
        conn = conns.get(ident)
        now = _clock()
        if conn is not None and now - _LOCAL.used.get(ident, now) > _IDLE_REUSE_S:
            conn.close()  # idle long enough for the server to have closed it
            conn = None
        _LOCAL.used[ident] = now
        if conn is None:
            timeout = _env_int("MEGASHARD_S3_TIMEOUT", 120, 1)
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                                   context=_ssl_context())
            else:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
            conns[ident] = conn
        return conn, target

    @staticmethod
    def _drop(url: str, slot: int = 0) -> None:
        """Close this thread's connection after an error; the next request opens a fresh one."""
        parts = urlsplit(url)
        ident = (parts.scheme, parts.hostname, parts.port) + ((slot,) if slot else ())
        conn = getattr(_LOCAL, "conns", {}).pop(ident, None)
        if conn is not None:
            conn.close()

    def _error_response(self, url: str, resp: http.client.HTTPResponse, slot: int = 0) -> Tuple[str, str]:
        """Read a small error body (S3 XML) for its code and message; drop the connection if it is large."""
        try:
            length = int(resp.getheader("Content-Length") or -1)
        except ValueError:
            length = -1
        body = b""
        if 0 <= length <= _ERROR_BODY_LIMIT:
            try:
                body = resp.read()
            except (OSError, http.client.HTTPException):
                self._drop(url, slot)
        else:
            self._drop(url, slot)
        return _xml_field(_XML_CODE, body), _xml_field(_XML_MESSAGE, body)

    def read_into(self, key: str, reqs: Sequence[Tuple[int, memoryview]], *, size: int, etag: Optional[str],
                  threads: Optional[int] = None) -> int:
        """Fill each ``(offset, view)`` with the object's bytes at ``offset``; returns the bytes fetched.

        Nearby requests share a GET (gaps up to 1 MiB go to a scratch buffer), GETs are cut to
        :func:`get_bytes_for` and run on up to ``MEGASHARD_S3_CONNECTIONS`` threads. Each GET is pinned
        to ``etag`` with If-Match and checked against ``size``; a changed object raises ObjectChangedError.
        """
        return self.read_many([(key, reqs, size, etag)], threads=threads)

    def read_many(self, jobs: Sequence[Tuple[str, Sequence[Tuple[int, memoryview]], int, Optional[str]]], *,
                  threads: Optional[int] = None, done: Optional[Callable[[int], None]] = None,
                  crcs: Optional[List[Optional[int]]] = None) -> int:
        """:meth:`read_into` of several objects ``(key, reqs, size, etag)`` at once: their GETs form one
        queue on up to ``threads`` (``MEGASHARD_S3_CONNECTIONS``) connections, so no connection idles at
        the end of an object while another's bytes remain. Jobs of one object are coalesced like one
        job's requests (adjacent ones share a GET). ``done(i)``, when given, is called (on the GET's
        thread) as soon as every byte of job ``i`` has arrived, so a caller can pass on early jobs while
        later ones are still in flight. ``crcs`` (one entry per job), when given: ``crcs[i]`` is set,
        before ``done(i)``, to the CRC32 of job ``i``'s requests' bytes concatenated in the order given,
        computed by each GET as its bytes land in the destination (while the others still download: no
        pass over the bytes after the last one; a retried GET resumes its CRC32 with its bytes), or None
        where the pieces cannot say (requests for the same bytes twice). Returns the bytes fetched."""
        by_key: Dict[str, List[int]] = {}
        for i, (key, _, _, _) in enumerate(jobs):
            by_key.setdefault(key, []).append(i)
        tasks: List[Callable[[], int]] = []
        left = [0] * len(jobs)  # per job: GETs still to finish
        owners: List[List[int]] = []  # per task: the jobs it holds bytes of
        tags: Optional[Dict[str, List[Tuple[int, int]]]] = None  # per key: (job, request) of each request
        parts: List[List[_CrcPart]] = [[] for _ in jobs]
        if crcs is not None:
            tags = {key: [(i, j) for i in idx for j in range(len(jobs[i][1]))] for key, idx in by_key.items()}

        def plan(key: str, idx: List[int], limit: Optional[int] = None) -> List[Any]:
            return self._plan_gets(key, [r for i in idx for r in jobs[i][1]], jobs[idx[0]][2], limit,
                                   None if tags is None else tags[key], parts)

        conns = threads or connections()
        size = get_bytes_for(sum(_byte_view(v).nbytes for _, reqs, _, _ in jobs for _, v in reqs), conns)
        plans = {key: plan(key, idx, size) for key, idx in by_key.items()}
        limit = _balanced_limit([g[1] - g[0] for gets in plans.values() for g in gets], conns)
        if limit is not None:
            for p in parts:
                p.clear()
            plans = {key: plan(key, idx, limit) for key, idx in by_key.items()}
        track = done is not None or crcs is not None
        for key, idx in by_key.items():
            size, etag = jobs[idx[0]][2], jobs[idx[0]][3]
            gets = plans[key]
            if not gets:
                continue
            url = self._presign("get_object", key)
            first = len(tasks)
            for g in gets:
                tasks.append(lambda key=key, url=url, g=g, size=size, etag=etag:
                             self._get_range(key, url, g[0], g[1], g[2], size, etag))
            if track:
                owners += _owners(gets, [(i, jobs[i][1]) for i in idx])
                for mine in owners[first:]:
                    for i in mine:
                        left[i] += 1
        if not track:
            return sum(_run_parallel(tasks, threads or connections())) if tasks else 0

        def finished(i: int) -> None:
            if crcs is not None:
                crcs[i] = _job_crc(parts[i], [_byte_view(v).nbytes for _, v in jobs[i][1]])
            if done is not None:
                done(i)

        for i in range(len(jobs)):
            if not left[i]:
                finished(i)  # nothing to fetch
        lock = threading.Lock()

        def tracked(t: int) -> int:
            n = tasks[t]()
            over = []
            with lock:
                for i in owners[t]:
                    left[i] -= 1
                    if not left[i]:
                        over.append(i)
            for i in over:
                finished(i)
            return n

        return sum(_run_parallel([lambda t=t: tracked(t) for t in range(len(tasks))], threads or connections()))

    def _plan_gets(self, key: str, reqs: Sequence[Tuple[int, memoryview]], size: int, limit: Optional[int] = None,
                   tags: Optional[Sequence[Tuple[int, int]]] = None, parts: Optional[List[List[_CrcPart]]] = None
                   ) -> List[Tuple[int, int, List[Tuple[Optional[memoryview], int, Optional[_CrcPart]]]]]:
        """Coalesce requests into runs and cut runs into GETs of at most ``limit`` (default
        ``MEGASHARD_S3_GET_BYTES``): (first byte, end, [(view or None=gap, n, CRC32 part or None)]).
        ``tags``: per request its (job, request) of :meth:`read_many`; each piece of a tagged request
        then gets a :class:`_CrcPart`, also appended to ``parts[job]``."""
        items = []
        for k, (offset, view) in enumerate(reqs):
            mv = _byte_view(view)
            if offset < 0 or offset + mv.nbytes > size:
                raise CheckpointError(f"{self.url(key)}: bytes [{offset}, {offset + mv.nbytes}) lie outside the "
                                      f"{size}-byte object; the checkpoint's index does not match the object")
            if mv.nbytes:
                items.append((offset, mv, None if tags is None else tags[k]))
        items.sort(key=lambda it: it[0])
        runs: List[Tuple[int, List[Tuple[Optional[memoryview], int, Optional[Tuple[int, int]]]]]] = []
        end = -1
        overlapping = []
        overlapping_tags = []
        for offset, mv, tag in items:
            if runs and offset >= end and offset - end <= GAP_BYTES:
                pieces = runs[-1][1]
                if offset > end:
                    pieces.append((None, offset - end, None))
                pieces.append((mv, mv.nbytes, tag))
                end = offset + mv.nbytes
            elif runs and offset < end:
                overlapping.append((offset, mv))  # two requests for the same bytes: read it again
                overlapping_tags.append(tag)
            else:
                runs.append((offset, [(mv, mv.nbytes, tag)]))
                end = offset + mv.nbytes
        limit = limit or get_bytes_limit()
        gets = []
        for start, pieces in runs:
            cur: List[Tuple[Optional[memoryview], int, Optional[_CrcPart]]] = []
            pos = get_start = start
            # GETs end at multiples of the limit in the object (whole parts, see part_bytes), unless that
            # takes more GETs than cutting from the run's start (a short run across a multiple)
            run_end = start + sum(n for _, n, _ in pieces)
            grid = 0 if -(-run_end // limit) - start // limit <= -(-(run_end - start) // limit) else start
            for mv, n, tag in pieces:
                done = 0
                while done < n:
                    take = min(n - done, limit - (pos - grid) % limit)
                    part = None
                    if tag is not None and parts is not None:
                        part = _CrcPart(tag[0], tag[1], done, take)
                        parts[tag[0]].append(part)
                    cur.append((mv[done:done + take] if mv is not None else None, take, part))
                    done += take
                    pos += take
                    if (pos - grid) % limit == 0:
                        gets.append((get_start, pos, cur))
                        cur, get_start = [], pos
            if cur:
                gets.append((get_start, pos, cur))
        if overlapping:
            gets.extend(self._plan_gets(key, overlapping, size, limit, None if tags is None else overlapping_tags,
                                        parts))
        return gets

    def _get_range(self, key: str, url: str, first: int, end: int,
                   pieces: List[Tuple[Optional[memoryview], int, Optional[_CrcPart]]], size: int,
                   etag: Optional[str]) -> int:
        """One ranged GET into ``pieces``; a retry asks only for the bytes not yet received. A piece with
        a CRC32 part has the CRC32 of each ``readinto``'s bytes added as they land (still in cache)."""
        got = 0
        starts = []
        acc = 0
        for _, n, _ in pieces:
            starts.append(acc)
            acc += n
        where = self.url(key)

        def attempt(n_try: int) -> int:
            nonlocal got
            a, b = first + got, end - 1
            self._count("GET_RANGE", retry=n_try > 0)
            conn, target = self._connection(url)
            try:
                conn.putrequest("GET", target, skip_accept_encoding=True)
                conn.putheader("Range", f"bytes={a}-{b}")
                if etag:
                    conn.putheader("If-Match", etag)
                conn.endheaders()
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._drop(url)
                raise _Retryable(f"connection error: {e!r}") from None
            if resp.status != 206:
                code, message = self._error_response(url, resp)
                self._raise_get_status(where, resp.status, code, message, a, b, size)
            self._check_range(url, where, resp, a, b, size, etag)
            i = bisect.bisect_right(starts, got) - 1
            scratch = _scratch()
            try:
                while got < acc:
                    mv, n, part = pieces[i]
                    off = got - starts[i]
                    if isinstance(mv, FileRange):  # through the scratch buffer into the file
                        r = resp.readinto(scratch[:min(n - off, len(scratch))])
                        if r:
                            mv.write(off, scratch[:r])
                            if part is not None:
                                part.crc = isal_zlib.crc32(scratch[:r], part.crc)
                    elif part is not None:  # a slice at a time, so its CRC32 runs while later bytes arrive
                        r = resp.readinto(mv[off:off + min(n - off, _CRC_SLICE)])
                        if r:
                            part.crc = isal_zlib.crc32(mv[off:off + r], part.crc)
                    else:  # readinto fills the whole view before it returns
                        r = resp.readinto(mv[off:] if mv is not None else scratch[:n - off])
                    if not r:
                        raise http.client.IncompleteRead(b"", acc - got)
                    got += r
                    if got - starts[i] == n:
                        i += 1
            except (OSError, http.client.HTTPException) as e:
                self._drop(url)
                raise _Retryable(f"connection lost after {got} of {acc} bytes: {e!r}") from None
            return acc

        return self._retrying("GET_RANGE", "ranged GET", key, attempt)

    def _raise_get_status(self, where: str, status: int, code: str, message: str, a: int, b: int,
                          size: int) -> None:
        if status in _RETRY_STATUS or code in _RETRY_CODES:
            raise _Retryable(f"HTTP {status} {code}")
        if status == 412:
            raise ObjectChangedError(f"{where}: the object changed since the checkpoint was written (HTTP 412 on "
                                     f"If-Match); load the checkpoint again or restore the object")
        if status == 416:
            raise ObjectChangedError(f"{where}: bytes {a}-{b} are past the object's end (HTTP 416) but the "
                                     f"checkpoint recorded {size} bytes; the object changed since it was written")
        if status == 404 and code != "NoSuchBucket":
            raise CheckpointError(f"{where}: the object does not exist (HTTP 404 {code}); the checkpoint is "
                                  f"incomplete or was deleted")
        if status in (403, 404):
            what = "access denied" if status == 403 else "no such bucket"
            raise CheckpointError(f"{where}: {what} (HTTP {status} {code} {message}){self._meaning(status, code)}")
        if status == 200:
            raise CheckpointError(f"{where}: the server ignored the Range header (HTTP 200 for bytes {a}-{b}); "
                                  f"megashard needs an endpoint that supports ranged GETs")
        raise CheckpointError(f"{where}: ranged GET of bytes {a}-{b} failed: HTTP {status} {code} {message}")

    def _check_range(self, url: str, where: str, resp: http.client.HTTPResponse, a: int, b: int, size: int,
                     etag: Optional[str]) -> None:
        """The 206 must be exactly the bytes asked for, of an object of the recorded size and ETag."""
        content_range = resp.getheader("Content-Range") or ""
        m = _CONTENT_RANGE.match(content_range.strip())
        problem = None
        if m is None:
            problem = f"Content-Range {content_range!r} is not 'bytes {a}-{b}/{size}'"
        elif int(m.group(3)) != size:
            self._drop(url)
            raise ObjectChangedError(f"{where}: the object is {m.group(3)} bytes but the checkpoint recorded {size}; "
                                     f"it changed since the checkpoint was written")
        elif (int(m.group(1)), int(m.group(2))) != (a, b):
            problem = f"Content-Range {content_range!r} answers a request for bytes {a}-{b}"
        elif resp.getheader("Content-Length") != str(b - a + 1):
            problem = f"Content-Length {resp.getheader('Content-Length')!r} is not {b - a + 1}"
        elif etag and resp.getheader("ETag") not in (None, etag):
            self._drop(url)
            raise ObjectChangedError(f"{where}: ETag {resp.getheader('ETag')} is not the checkpoint's {etag}; "
                                     f"the object changed since the checkpoint was written")
        if problem:
            self._drop(url)
            raise CheckpointError(f"{where}: bad ranged GET answer: {problem}; the endpoint or a proxy "
                                  f"mangles range requests")

    def upload(self, key: str, size: int, segments: Sequence[Tuple[int, memoryview]], *, if_none_match: bool = True,
               threads: Optional[int] = None, pending: Any = None) -> str:
        """Write an object from ``segments`` ((offset, view) tiling [0, size) in order) without copying them.

        One PUT up to :func:`single_put_bytes`, else a multipart upload (parts of :func:`part_bytes`) with parts sent in
        parallel (a part may span segments), aborted on any failure. With ``if_none_match`` the object must
        not exist yet (CommitConflictError otherwise). ``pending`` (a
        :class:`~megashard.format.writer.DeferredHashes`): bytes still being written (``ranges``);
        parts clear of them go first, and a request sends each of its views once ``pending.wait`` says
        its bytes are final (only views that meet a range wait: the body starts at once).
        Returns the ETag.
        """
        views = []
        pos = 0
        for offset, view in segments:
            mv = _byte_view(view)
            if offset != pos:
                raise CheckpointError(f"{self.url(key)}: upload segments must tile [0, {size}) in order; segment at "
                                      f"{offset} after {pos} bytes")
            if mv.nbytes:
                views.append((offset, mv))
            pos += mv.nbytes
        if pos != size:
            raise CheckpointError(f"{self.url(key)}: upload segments hold {pos} bytes, not {size}")
        if size <= single_put_bytes():
            headers = {"If-None-Match": "*"} if if_none_match else {}
            url = self._presign("put_object", key)
            return self._put_views("PUT", key, url, [mv for _, mv in views], size, headers,
                                   gate=self._gate(pending, [o for o, _ in views]))
        return self._multipart(key, size, part_bytes(size), views, if_none_match, threads or connections(), pending)

    @staticmethod
    def _gate(pending: Any, offsets: Sequence[int]) -> Optional[Callable[[int, memoryview], None]]:
        """What :meth:`_put_views` calls before sending its ``j``-th view (at object offset ``offsets[j]``):
        ``pending.wait`` for that view's bytes when they meet one of ``pending.ranges``, so a request
        sends what is final and waits, on the open connection, only where a tensor header still waits
        for its hashes (None: nothing pending)."""
        if pending is None:
            return None
        ranges = sorted(pending.ranges)
        starts, ends = [s for s, _ in ranges], [e for _, e in ranges]

        def gate(j: int, mv: memoryview) -> None:
            a, b = offsets[j], offsets[j] + mv.nbytes
            i = bisect.bisect_right(ends, a)  # the first range ending after a
            if i < len(ranges) and starts[i] < b:
                pending.wait(a, b)

        return gate

    @staticmethod
    def _slice(views: List[Tuple[int, memoryview]], starts: List[int], a: int, b: int) -> List[memoryview]:
        """The views covering bytes [a, b)."""
        out = []
        i = bisect.bisect_right(starts, a) - 1
        while a < b:
            offset, mv = views[i]
            lo = a - offset
            hi = min(mv.nbytes, b - offset)
            out.append(mv[lo:hi])
            a += hi - lo
            i += 1
        return out

    def _multipart(self, key: str, size: int, part: int, views: List[Tuple[int, memoryview]], if_none_match: bool,
                   threads: int, pending: Any = None) -> str:
        upload_id = self._call("MPU_CREATE", key, "create_multipart_upload", Key=key)["UploadId"]
        try:
            starts = [o for o, _ in views]
            spans = _part_spans(size, part, max(1, threads))
            nparts = len(spans)

            def send(i: int) -> str:
                a, b = spans[i]
                pieces = self._slice(views, starts, a, b)
                offsets = list(itertools.accumulate((mv.nbytes for mv in pieces[:-1]), initial=a))
                url = self._presign("upload_part", key, UploadId=upload_id, PartNumber=i + 1)
                return self._put_views("MPU_PART", key, url, pieces, b - a, {}, gate=self._gate(pending, offsets))

            order = list(range(nparts))
            if pending is not None:  # parts whose bytes are final first: they go while the rest is hashed
                ranges = pending.ranges

                def waits(i: int) -> bool:
                    a, b = spans[i]
                    return any(s < b and a < e for s, e in ranges)

                order.sort(key=lambda i: (waits(i), i))
            sent = _run_parallel([lambda i=i: send(i) for i in order], threads)
            etags = [""] * nparts
            for i, etag in zip(order, sent):
                etags[i] = etag
            return self._complete(key, upload_id, etags, if_none_match)
        except BaseException:
            self._abort_quietly(key, upload_id)
            raise

    def _complete(self, key: str, upload_id: str, etags: Sequence[str], if_none_match: bool) -> str:
        params: Dict[str, Any] = {
            "Key": key, "UploadId": upload_id,
            "MultipartUpload": {"Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]}}
        if if_none_match:
            params["IfNoneMatch"] = "*"
        expected = _multipart_etag(etags)

        def landed() -> Optional[Dict[str, Any]]:
            info = self.head(key)
            return {"ETag": info.etag} if info is not None and info.etag == expected else None

        return self._call("MPU_COMPLETE", key, "complete_multipart_upload", conflict=CommitConflictError,
                          landed=landed, **params)["ETag"]

    def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.abort_upload(key, upload_id)
        except Exception as e:  # the original failure matters more; cleanup() removes it later
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, self.url(key), e)

    def upload_chunks(self, key: str, size: int, chunks: Iterable[memoryview], *, if_none_match: bool = True,
                      threads: Optional[int] = None) -> str:
        """Write an object of ``size`` bytes from ``chunks`` produced while it is sent (a copy streamed
        with bounded memory): consecutive views from offset 0, each a whole number of parts
        (:func:`part_bytes` of ``size``) but the last. A chunk's parts are sent (in parallel) before the
        next chunk is asked for, so the producer may refill one buffer. One PUT up to
        :func:`single_put_bytes`, else a multipart upload, aborted on any failure. ``if_none_match`` as in :meth:`upload`.
        Returns the ETag."""
        part = part_bytes(size)
        if size <= single_put_bytes():
            whole = bytearray()
            for chunk in chunks:
                mv = _byte_view(chunk)
                if not whole and mv.nbytes == size:  # the usual case: one chunk, sent from the producer's buffer
                    return self.upload(key, size, [(0, mv)], if_none_match=if_none_match)
                whole += mv
            return self.upload(key, size, [(0, memoryview(whole))], if_none_match=if_none_match)
        upload_id = self._call("MPU_CREATE", key, "create_multipart_upload", Key=key)["UploadId"]
        try:
            etags: List[str] = []
            pos = 0
            for chunk in chunks:
                mv = _byte_view(chunk)
                if pos + mv.nbytes > size or (mv.nbytes % part and pos + mv.nbytes != size):
                    raise CheckpointError(f"{self.url(key)}: a chunk of {mv.nbytes} bytes at {pos} is not whole "
                                          f"{part}-byte parts (or runs past {size} bytes)")
                first = len(etags)

                def send(i: int, mv: memoryview = mv, first: int = first) -> str:
                    a, b = i * part, min(mv.nbytes, (i + 1) * part)
                    url = self._presign("upload_part", key, UploadId=upload_id, PartNumber=first + i + 1)
                    return self._put_views("MPU_PART", key, url, [mv[a:b]], b - a, {})

                etags += _run_parallel([lambda i=i: send(i) for i in range(-(-mv.nbytes // part))],
                                       threads or connections())
                pos += mv.nbytes
            if pos != size:
                raise CheckpointError(f"{self.url(key)}: chunks held {pos} bytes, not {size}")
            return self._complete(key, upload_id, etags, if_none_match)
        except BaseException:
            self._abort_quietly(key, upload_id)
            raise

    def _put_views(self, kind: str, key: str, url: str, views: List[memoryview], length: int,
                   headers: Dict[str, str], gate: Optional[Callable[[int, memoryview], None]] = None) -> str:
        """One PUT of ``length`` bytes sent straight from ``views``; returns the ETag. ``gate(j, view)``
        runs before the ``j``-th view is sent (:meth:`_gate`: until its bytes are final)."""
        where = self.url(key)

        def landed() -> Optional[str]:
            """A retried conditional PUT failed its precondition: was our first attempt applied?"""
            info = self.head(key)
            if info is None or info.size != length:
                return None
            md5 = hashlib.md5(usedforsecurity=False)
            for mv in views:
                md5.update(mv)
            return info.etag if info.etag == f'"{md5.hexdigest()}"' else None

        def attempt(n_try: int) -> str:
            self._count(kind, retry=n_try > 0)
            conn, target = self._connection(url)
            try:
                conn.putrequest("PUT", target, skip_accept_encoding=True)
                conn.putheader("Content-Length", str(length))
                for name, value in headers.items():
                    conn.putheader(name, value)
                conn.endheaders()
                for j, mv in enumerate(views):
                    if gate is not None:
                        gate(j, mv)
                    conn.send(mv)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._drop(url)
                raise _Retryable(f"connection error: {e!r}") from None
            except BaseException:  # e.g. the hashing failed mid-body: never reuse a half-sent request
                self._drop(url)
                raise
            if resp.status != 200:
                code, message = self._error_response(url, resp)
                if resp.status in _RETRY_STATUS or code in _RETRY_CODES:
                    raise _Retryable(f"HTTP {resp.status} {code}")
                if resp.status == 412 or (resp.status == 409 and code == "ConditionalRequestConflict"):
                    done = landed() if n_try > 0 and headers else None
                    if done is not None:
                        return done
                    raise CommitConflictError(f"PUT of {where}: HTTP {resp.status} {code}: another writer created "
                                              f"or replaced the object first")
                raise CheckpointError(f"PUT of {where} failed: HTTP {resp.status} {code} {message}"
                                      f"{self._meaning(resp.status, code)}")
            try:
                resp.read()
            except (OSError, http.client.HTTPException):
                self._drop(url)
            etag = resp.getheader("ETag")
            if not etag:
                raise CheckpointError(f"PUT of {where}: the endpoint returned no ETag")
            return etag

        return self._retrying(kind, "PUT", key, attempt)


# --------------------------------------------------------------------------------------------------- msc://

_S3_LIKE = ("s3", "s8k", "ais_s3", "gcs_s3")


def _msc_config() -> Dict[str, Any]:
    try:
        from multistorageclient import StorageClientConfig  # type: ignore[import-not-found]
    except ImportError:
        raise CheckpointError("msc:// URLs need multi-storage-client: pip install multi-storage-client "
                              "(or use s3://bucket/prefix)") from None
    try:
        found = StorageClientConfig.read_msc_config()
    except Exception as e:  # its own validation errors
        raise CheckpointError(f"cannot read the multi-storage-client config: {e}") from None
    config = found[0] if isinstance(found, tuple) else found  # newer versions also return the file path
    return config or {}


def _expand(value: Any) -> Any:
    return os.path.expandvars(value) if isinstance(value, str) else value


def _msc_store(url: ObjectURL) -> Tuple[ObjectStore, str]:
    """Resolve ``msc://profile/key`` through the profile's S3 storage provider (bucket/prefix, endpoint,
    region, static S3 credentials; otherwise the usual AWS credential chain)."""
    try:
        config = _msc_config()
    except CheckpointError as e:
        raise CheckpointError(f"{url}: {e}") from None
    profile = (config.get("profiles") or {}).get(url.profile)
    if not isinstance(profile, dict):
        raise CheckpointError(f"{url}: profile {url.profile!r} is not in the multi-storage-client config "
                              f"(MSC_CONFIG or ~/.msc_config.yaml)")
    provider = profile.get("storage_provider") or {}
    kind = provider.get("type")
    if kind not in _S3_LIKE:
        raise CheckpointError(f"{url}: profile {url.profile!r} uses storage provider {kind!r}; megashard reads "
                              f"msc:// only through S3-compatible providers ({', '.join(_S3_LIKE)})")
    options = {k: _expand(v) for k, v in (provider.get("options") or {}).items()}
    base = parse_url("s3://" + str(options.get("base_path", "")).strip("/"))
    key = join_key(base.key, url.key) if url.key else base.key
    parse_url(f"s3://{base.bucket}/{key}")  # the joined key obeys the same rules
    creds: Dict[str, str] = {}
    cred_provider = profile.get("credentials_provider") or {}
    if cred_provider.get("type") == "S3Credentials":
        o = {k: _expand(v) for k, v in (cred_provider.get("options") or {}).items()}
        creds = {"aws_access_key_id": o.get("access_key"), "aws_secret_access_key": o.get("secret_key")}
        if o.get("session_token"):
            creds["aws_session_token"] = o["session_token"]
    elif cred_provider:
        log.info("%s: credentials provider %r is not used by megashard; using the AWS credential chain",
                 url, cred_provider.get("type"))
    endpoint = options.get("endpoint_url") or _env_endpoint()
    cache_key = (base.bucket, endpoint, f"msc:{url.profile}")
    with _STORES_LOCK:
        store = _STORES.get(cache_key)
        if store is None:
            store = ObjectStore(base.bucket, endpoint_url=endpoint, region=options.get("region_name"))
            store._credentials = {k: v for k, v in creds.items() if v}
            _STORES[cache_key] = store
    return store, key
