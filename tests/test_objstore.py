"""megashard.storage.s3 against a real S3 endpoint on 127.0.0.1 (SeaweedFS behind a proxy, tests/s3_endpoint.py).

Asserts the bytes (bit-exact), the requests the endpoint saw (ranges, If-Match, retries), and the exact
error types and the s3:// names in their messages.
"""
from __future__ import annotations

import http.client
import os
import sys
import types
from typing import List, Tuple

import pytest

from megashard.errors import CheckpointError, CommitConflictError, ObjectChangedError
from megashard.storage.s3 import ObjectStore, check_object_name, child, parse_url
from megashard.storage.s3 import client as objclient

MiB = 1 << 20


def _data(n: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n] if seed == 0 else os.urandom(n)


def _store(s3) -> ObjectStore:
    store, key = ObjectStore.for_url(s3.url())
    assert key == ""
    return store


def _ranged_gets(s3, key: str) -> List[dict]:
    return [e for e in s3.requests() if e["method"] == "GET" and e["key"] == key and e["range"]]


# ----------------------------------------------------------------------------------------------- URLs

@pytest.mark.parametrize("url, bucket, key", [
    ("s3://bkt/a/b", "bkt", "a/b"),
    ("s3://bkt/a/b/", "bkt", "a/b"),
    ("S3://my.bucket-1/run/iter_0000100", "my.bucket-1", "run/iter_0000100"),
    ("s3://bkt", "bkt", ""),
    ("s3://bkt/", "bkt", ""),
])
def test_parse_url_accepts(url: str, bucket: str, key: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.bucket, parsed.key, parsed.profile) == ("s3", bucket, key, None)


def test_parse_url_msc_keeps_the_profile() -> None:
    parsed = parse_url("msc://train-ckpt/run/iter_1/")
    assert (parsed.scheme, parsed.bucket, parsed.key, parsed.profile) == ("msc", "", "run/iter_1", "train-ckpt")


@pytest.mark.parametrize("url", [
    "s3://bkt/../etc", "s3://bkt/a/../../b", "s3://bkt/a/./b", "s3://bkt/a//b", "s3://bkt//", "s3://bkt//a",
    "s3://bkt/a\\b", "s3://bkt/a\x00b", "s3://bkt/a\nb", "s3://bkt/a?versionId=1", "s3://bkt/a#frag",
    "s3:///key", "s3://b/key", "s3://BUCKET/key", "s3://user@bkt/key", "s3://bkt:9000/key", "s3://bk..t/key",
    "s3:/bkt/key", "s3//bkt/key", "/local/dir", "http://bkt/key", "gs://bkt/key", "",
    "s3://bkt/" + "k" * 901, "s3://bkt/" + "\u00e9" * 451, "msc:///key", "msc://bad profile/key",
])
def test_parse_url_rejects_hostile(url: str) -> None:
    with pytest.raises(CheckpointError) as err:
        parse_url(url)
    assert repr(url[:40])[1:-1][:20] in str(err.value)


def test_child_and_object_names() -> None:
    assert child("s3://bkt/run/iter_1/", "manifest.json") == "s3://bkt/run/iter_1/manifest.json"
    assert child("s3://bkt", "latest_checkpointed_iteration.txt") == "s3://bkt/latest_checkpointed_iteration.txt"
    assert check_object_name(".megashard-save-" + "a" * 32, "here") == ".megashard-save-" + "a" * 32
    for bad in ("", ".", "..", "a/b", "a\\b", "a\x00", "x" * 256):
        with pytest.raises(CheckpointError, match="s3://bkt/run: .* is not a plain object name"):
            child("s3://bkt/run", bad)
    with pytest.raises(CheckpointError, match="longer than 900 bytes"):
        child("s3://bkt/" + "k" * 890, "manifest.json")


# ----------------------------------------------------------------------------------------------- control path

def test_round_trip_put_get_head_list_delete(s3) -> None:
    store = _store(s3)
    assert store.head("run/manifest.json") is None
    etag = store.put_bytes("run/manifest.json", b'{"a": 1}')
    store.put_bytes("run/.megashard-save-x/data_0.tensors", b"x" * 100)
    store.put_bytes("run/.megashard-save-x/data_1.tensors", b"y" * 10)
    info = store.head("run/manifest.json")
    assert (info.key, info.size, info.etag) == ("run/manifest.json", 8, etag) and etag.startswith('"')
    assert info.last_modified > 1e9
    assert store.get_bytes("run/manifest.json", 100) == (b'{"a": 1}', etag)
    assert store.get_bytes("run/manifest.json", 100, if_match=etag)[0] == b'{"a": 1}'
    objects, prefixes = store.list("run/", delimiter="/")
    assert [o.key for o in objects] == ["run/manifest.json"] and prefixes == ["run/.megashard-save-x/"]
    objects, prefixes = store.list("run/.megashard-save-x/")
    assert [(o.key, o.size) for o in objects] == [("run/.megashard-save-x/data_0.tensors", 100),
                                                   ("run/.megashard-save-x/data_1.tensors", 10)]
    assert prefixes == []
    store.delete([o.key for o in objects] + ["run/not-there"])
    assert store.list("run/")[0] == [info] or [o.key for o in store.list("run/")[0]] == ["run/manifest.json"]
    assert store.stats["PUT"] == 3 and store.stats["HEAD"] == 2 and store.stats["GET"] == 2
    assert store.stats["LIST"] == 3 and store.stats["DELETE"] == 1
    assert sum(store.retries.values()) == 0


def test_store_cache_and_url(s3) -> None:
    store, key = ObjectStore.for_url(s3.url("run/iter_0000100/"))
    assert key == "run/iter_0000100" and store.endpoint_url == s3.endpoint
    assert ObjectStore.for_url(s3.url("other"))[0] is store
    assert store.url("run/x") == f"s3://{s3.bucket}/run/x"


def test_conditional_put_conflicts(s3) -> None:
    store = _store(s3)
    first = store.put_bytes("p/manifest.json", b"one", if_none_match=True)
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/p/manifest.json"):
        store.put_bytes("p/manifest.json", b"two", if_none_match=True)
    second = store.put_bytes("p/manifest.json", b"two", if_match=first)
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/p/manifest.json.*no longer has ETag "
                       f"{first}: another writer replaced or deleted it first"):
        store.put_bytes("p/manifest.json", b"three", if_match=first)  # stale: someone else re-saved
    assert store.get_bytes("p/manifest.json", 10) == (b"two", second)
    conditions = [(e["if_none_match"], e["if_match"], e["status"]) for e in s3.requests()
                  if e["method"] == "PUT" and e["key"] == "p/manifest.json"]
    assert conditions == [("*", None, 200), ("*", None, 412), (None, first, 200), (None, first, 412)]
    # the bulk path's single PUT and multipart complete are conditional too
    with pytest.raises(CommitConflictError, match="p/manifest.json"):
        store.upload("p/manifest.json", 3, [(0, memoryview(b"new"))])
    assert store.get_bytes("p/manifest.json", 10)[0] == b"two"


def test_multipart_complete_if_none_match_conflict(s3, monkeypatch) -> None:
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    store = _store(s3)
    store.put_bytes("p/big", b"old")
    data = _data(6 * MiB)
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/p/big"):
        store.upload("p/big", len(data), [(0, memoryview(data))])
    assert store.get_bytes("p/big", 10)[0] == b"old"
    assert store.list_uploads("p/") == []  # aborted
    assert store.stats["MPU_COMPLETE"] == 1 and store.stats["MPU_ABORT"] == 1


def test_get_bytes_limit_and_if_match(s3) -> None:
    store = _store(s3)
    etag = store.put_bytes("k/index", b"z" * 1000)
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/k/index is 1000 bytes, more than the 999"):
        store.get_bytes("k/index", 999)
    store.put_bytes("k/index", b"w" * 1000)
    with pytest.raises(ObjectChangedError, match=f"s3://{s3.bucket}/k/index.*changed since the checkpoint"):
        store.get_bytes("k/index", 1000, if_match=etag)
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/k/missing.*404.*does not exist"):
        store.get_bytes("k/missing", 1000)


def test_get_bytes_is_a_presigned_get_read_as_boto3_would(s3, monkeypatch) -> None:
    """A load's head, digest and index are whole-object GETs before its first ranged GET: sent on the
    thread's own connection (presigned, like the bulk path), never through boto3's request pipeline,
    answered as before: bytes and ETag; If-Match; a 503 and a body cut short retried; a missing
    object, an answer over the limit (refused before its body is read), a missing bucket named."""
    store = _store(s3)
    etag = store.put_bytes("g/head", b"x" * 700)
    client = store.boto3_client()
    monkeypatch.setattr(client, "get_object", lambda **kw: pytest.fail("get_bytes went through boto3"))
    s3.reset()
    s3.inject(503, code="SlowDown", count=1, method="GET", match="g/head")
    s3.inject(truncate=100, count=1, method="GET", match="g/head")
    assert store.get_bytes("g/head", 1000, if_match=etag) == (b"x" * 700, etag)
    assert [e["status"] for e in s3.requests() if e["method"] == "GET"] == [503, 200, 200]
    assert all(e["if_match"] == etag for e in s3.requests() if e["method"] == "GET")
    assert store.retries["GET"] == 2
    with pytest.raises(ObjectChangedError, match=f"s3://{s3.bucket}/g/head.*412.*changed since the checkpoint"):
        store.get_bytes("g/head", 1000, if_match='"0123456789abcdef0123456789abcdef"')
    with pytest.raises(objclient.ObjectTooLargeError, match=f"s3://{s3.bucket}/g/head is 700 bytes, more than the 699"):
        store.get_bytes("g/head", 699)
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/g/missing.*404.*does not exist"):
        store.get_bytes("g/missing", 1000)
    assert store.get_bytes("g/head", 700) == (b"x" * 700, etag)  # the connection is still good after them
    other, _ = ObjectStore.for_url("s3://no-such-bucket-megashard/x")
    with pytest.raises(CheckpointError, match="no-such-bucket-megashard.*(does not exist|may not exist)"):
        other.get_bytes("x/y", 10)


def test_missing_credentials_are_named_on_the_first_get(s3, monkeypatch, tmp_path) -> None:
    """A load's first request (the head's GET, presigned since it left boto3's pipeline) without any
    credentials says which settings to give, as boto3's calls do."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    objclient.clear_store_cache()
    store, _ = ObjectStore.for_url(s3.url("x"))
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/x/manifest.json.*AWS_ACCESS_KEY_ID"):
        store.get_bytes("x/manifest.json", 100)


def test_get_bytes_many_sends_every_request_before_reading_an_answer(s3) -> None:
    """Several whole-object GETs from one thread, each on its own connection, all sent before any answer
    is read: per request its bytes and ETag, or the error get_bytes raises for it (412 on If-Match,
    404, over its limit), a transient failure (503) sent again with get_bytes' retries; the thread's
    connections are good for the next requests."""
    store = _store(s3)
    ea = store.put_bytes("gm/a", b"a" * 10)
    eb = store.put_bytes("gm/b", b"b" * 20)
    s3.reset()
    s3.inject(503, code="SlowDown", count=1, method="GET", match="gm/b")
    got = store.get_bytes_many([("gm/a", 100, ea), ("gm/b", 100, None), ("gm/a", 100, eb), ("gm/none", 100, None),
                                ("gm/b", 19, None)])
    assert got[:2] == [(b"a" * 10, ea), (b"b" * 20, eb)]
    assert isinstance(got[2], ObjectChangedError) and "gm/a" in str(got[2])
    assert isinstance(got[3], CheckpointError) and "does not exist" in str(got[3])
    assert isinstance(got[4], objclient.ObjectTooLargeError) and "gm/b is 20 bytes" in str(got[4])
    # five sent at once (the 20-byte answer over its limit of 19 is refused unread), the 503 once more
    assert sorted(e["status"] for e in s3.requests() if e["method"] == "GET") == [200, 200, 200, 404, 412, 503]
    assert store.get_bytes_many([("gm/a", 100, None), ("gm/b", 100, None)]) == [(b"a" * 10, ea), (b"b" * 20, eb)]


# Stores answer the same situation differently; megashard goes by what the answer means. The server's own
# answer is one case, the other vendor's is injected by the proxy (the object or bucket is really missing).
_VENDOR_ANSWERS = {"server": None, "AWS 404 NoSuchKey": (404, "NoSuchKey"),
                   "SeaweedFS 412 PreconditionFailed": (412, "PreconditionFailed")}


@pytest.mark.parametrize("answer", list(_VENDOR_ANSWERS))
def test_if_match_put_on_a_deleted_object_is_a_lost_race(s3, answer) -> None:
    """AWS answers a PUT with If-Match on a missing key 404, SeaweedFS 412: both mean another writer deleted it."""
    store = _store(s3)
    etag = store.put_bytes("p/gone", b"one")
    store.delete(["p/gone"])
    if _VENDOR_ANSWERS[answer]:
        status, code = _VENDOR_ANSWERS[answer]
        s3.inject(status, code=code, count=1, method="PUT", match="p/gone")
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/p/gone.*no longer has ETag {etag}: another "
                                                  f"writer replaced or deleted it first"):
        store.put_bytes("p/gone", b"x", if_match=etag)
    assert store.head("p/gone") is None
    assert [e["status"] for e in s3.requests() if e["method"] == "PUT" and e["if_match"]] in ([404], [412])


@pytest.mark.parametrize("answer", ["server", "AWS 404 NoSuchBucket", "403 AccessDenied"])
def test_missing_bucket_is_named(s3, answer) -> None:
    """A missing bucket: AWS says 404 NoSuchBucket; SeaweedFS (and AWS without s3:ListBucket) say 403. Either way
    the error names the bucket and what to check, on the control path and on the bulk path."""
    bucket = "no-such-bucket-megashard"
    if answer != "server":
        status, code = (404, "NoSuchBucket") if "404" in answer else (403, "AccessDenied")
        s3.inject(status, code=code, count=2, bucket=bucket)
    store, _ = ObjectStore.for_url(f"s3://{bucket}/x")
    meaning = f"bucket '{bucket}' (does not exist|may not exist) on {s3.endpoint}"
    with pytest.raises(CheckpointError, match=f"s3://{bucket}/x/y.*{meaning}"):
        store.put_bytes("x/y", b"1")
    with pytest.raises(CheckpointError, match=f"s3://{bucket}/x/z.*{meaning}"):
        store.read_into("x/z", [(0, memoryview(bytearray(4)))], size=4, etag=None)


# ----------------------------------------------------------------------------------------------- ranged reads

def _scattered(size: int) -> List[Tuple[int, int]]:
    """(offset, length) requests: adjacent ones, small gaps (coalesced), a 2 MiB gap (split), a long run."""
    return [(0, 100), (100, 50), (200, 1000),            # run A: gap 50 bytes
            (300 * 1024, 4096), (1300 * 1024, 10),       # still run A: gaps < 1 MiB
            (4 * MiB, 1),                                # run B: gap > 1 MiB from run A
            (4 * MiB + 17, 9 * MiB),                     # run B: 9 MiB long -> split by GET_BYTES
            (size - 3, 3)]                               # run C: the last bytes


def test_read_into_scattered_ranges_bit_exact(s3, monkeypatch) -> None:
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(4 * MiB))
    store = _store(s3)
    data = os.urandom(16 * MiB)
    etag = store.upload("d/data_0.tensors", len(data), [(0, memoryview(data))], if_none_match=True)
    s3.reset()
    reqs = _scattered(len(data))
    bufs = [bytearray(n) for _, n in reqs]
    fetched = store.read_into("d/data_0.tensors", [(o, memoryview(b)) for (o, _), b in zip(reqs, bufs)],
                              size=len(data), etag=etag)
    for (o, n), b in zip(reqs, bufs):
        assert bytes(b) == data[o:o + n]
    run_a = 1300 * 1024 + 10
    run_b = 17 + 9 * MiB
    assert fetched == run_a + run_b + 3
    gets = _ranged_gets(s3, "d/data_0.tensors")
    b0 = 4 * MiB
    assert sorted(e["range"] for e in gets) == sorted([
        f"bytes=0-{run_a - 1}",
        f"bytes={b0}-{b0 + 4 * MiB - 1}", f"bytes={b0 + 4 * MiB}-{b0 + 8 * MiB - 1}",
        f"bytes={b0 + 8 * MiB}-{b0 + run_b - 1}",
        f"bytes={len(data) - 3}-{len(data) - 1}"])
    assert all(e["if_match"] == etag and e["status"] == 206 for e in gets)
    assert store.stats["GET_RANGE"] == 5


def test_read_many_reports_each_job_as_soon_as_its_bytes_are_in(s3, monkeypatch) -> None:
    """Jobs of one object share GETs where adjacent (two 1 MiB jobs: one GET), and ``done(i)`` comes as
    soon as job i's GETs have finished: on one connection, before the next GET is even sent (scatter
    publishes a ring extent the moment it is in). A job with nothing to read is done at once."""
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(2 * MiB))
    store = _store(s3)
    data = os.urandom(6 * MiB)
    etag = store.upload("m/x", len(data), [(0, memoryview(data))], if_none_match=True)
    s3.reset()
    bufs = [bytearray(MiB), bytearray(MiB), bytearray(2 * MiB), bytearray(0)]
    offsets = [0, MiB, 4 * MiB, 0]
    seen: List[Tuple[int, List[bool]]] = []  # (job, which buffers were filled when it was reported)

    def done(i: int) -> None:
        seen.append((i, [bytes(b) == data[o:o + len(b)] for o, b in zip(offsets, bufs)]))

    jobs = [("m/x", [(o, memoryview(b))], len(data), etag) for o, b in zip(offsets, bufs)]
    assert store.read_many(jobs, threads=1, done=done) == 4 * MiB
    assert [bytes(b) for b in bufs] == [data[o:o + len(b)] for o, b in zip(offsets, bufs)]
    assert sorted(e["range"] for e in _ranged_gets(s3, "m/x")) == [f"bytes=0-{2 * MiB - 1}",
                                                                    f"bytes={4 * MiB}-{6 * MiB - 1}"]
    assert seen[0] == (3, [False, False, False, True])  # nothing to fetch: reported before any GET
    assert sorted(seen[1:3]) == [(0, [True, True, False, True]), (1, [True, True, False, True])]
    assert seen[3] == (2, [True, True, True, True])


def test_read_many_computes_each_jobs_crc32_as_its_bytes_land(s3, monkeypatch) -> None:
    """``crcs``: each job's CRC32 (its requests' bytes concatenated in the order given) is computed by
    the GETs as they fill the destinations and set before ``done(i)``, equal to zlib's over the
    delivered bytes: a job cut over several GETs (at the GET size), a job of two requests (rows) shared
    with another job's GET (gap skipped), a request for bytes another job also asks for (read again),
    a destination that is a file range, a job with nothing to read, and a GET dropped mid-body and
    resumed (its CRC32 resumes with it)."""
    import zlib

    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(2 * MiB))
    store = _store(s3)
    data = os.urandom(7 * MiB + 123)
    etag = store.upload("c/x", len(data), [(0, memoryview(data))], if_none_match=True)
    fd = os.memfd_create("test-crc-filerange")
    try:
        os.ftruncate(fd, MiB)
        spans = [[(5, 5 * MiB)],  # over three GETs
                 [(5 * MiB + 100, 1000), (5 * MiB + 1100, 3000)],  # two requests back to back
                 [(5 * MiB + 200, 50)],  # bytes job 1 also reads
                 [(7 * MiB, 123)],
                 []]
        bufs = [[bytearray(n) for _, n in reqs] for reqs in spans]
        jobs = [("c/x", [(o, memoryview(b)) for (o, _), b in zip(reqs, bb)], len(data), etag)
                for reqs, bb in zip(spans, bufs)]
        jobs.append(("c/x", [(6 * MiB, objclient.FileRange(fd, 0, MiB))], len(data), etag))
        want = [zlib.crc32(b"".join(data[o:o + n] for o, n in reqs)) for reqs in spans]
        want.append(zlib.crc32(data[6 * MiB:7 * MiB]))
        seen: List[Tuple[int, object]] = []
        crcs: List[object] = [None] * len(jobs)
        s3.reset()
        s3.inject(truncate=300000, count=1, method="GET")
        store.read_many(jobs, threads=2, done=lambda i: seen.append((i, crcs[i])), crcs=crcs)
        assert crcs == want
        assert sorted(seen) == sorted(enumerate(want))  # each set before its done()
        assert [b"".join(bytes(b) for b in bb) for bb in bufs] == [b"".join(data[o:o + n] for o, n in reqs)
                                                                  for reqs in spans]
        assert os.pread(fd, MiB, 0) == data[6 * MiB:7 * MiB]
        assert store.retries["GET_RANGE"] == 1  # the dropped GET was resumed
    finally:
        os.close(fd)


def test_read_many_fills_byte_ranges_of_a_file(s3, monkeypatch) -> None:
    """A destination may be a byte range of an open file (``FileRange``: what scatter's ring slots are for
    an object store, written with pwrite from a small reused buffer instead of faulting in fresh shared
    pages): filled bit-exact next to a memoryview destination, coalesced into the same GETs (gap
    skipped), cut at the GET size, a dropped GET resumed; bytes outside the ranges untouched."""
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(2 * MiB))
    store = _store(s3)
    data = os.urandom(5 * MiB)
    etag = store.upload("f/x", len(data), [(0, memoryview(data))], if_none_match=True)
    fd = os.memfd_create("test-filerange")
    try:
        os.ftruncate(fd, 8 * MiB)
        os.pwrite(fd, b"\xee" * (8 * MiB), 0)
        mem = bytearray(1000)
        # file bytes [100, 100 + 3 MiB) <- object [10, 10 + 3 MiB); memoryview <- object [3 MiB + 500 KiB, +1000);
        # file bytes [6 MiB, 6 MiB + 1 MiB) <- object [4 MiB, 5 MiB)
        jobs = [("f/x", [(10, objclient.FileRange(fd, 100, 3 * MiB))], len(data), etag),
                ("f/x", [(3 * MiB + 500 * 1024, memoryview(mem))], len(data), etag),
                ("f/x", [(4 * MiB, objclient.FileRange(fd, 6 * MiB, MiB))], len(data), etag)]
        s3.reset()
        s3.inject(truncate=300000, count=1, method="GET")
        assert store.read_many(jobs, threads=1) == 5 * MiB - 10
        got = os.pread(fd, 8 * MiB, 0)
        assert got[:100] == b"\xee" * 100
        assert got[100:100 + 3 * MiB] == data[10:10 + 3 * MiB]
        assert got[100 + 3 * MiB:6 * MiB] == b"\xee" * (6 * MiB - 100 - 3 * MiB)
        assert got[6 * MiB:7 * MiB] == data[4 * MiB:5 * MiB] and got[7 * MiB:] == b"\xee" * MiB
        assert bytes(mem) == data[3 * MiB + 500 * 1024:3 * MiB + 500 * 1024 + 1000]
        gets = _ranged_gets(s3, "f/x")
        assert len(gets) == 4 and all(e["if_match"] == etag for e in gets), gets  # 3 GETs + 1 resumed
        assert store.stats["GET_RANGE"] == 4
    finally:
        os.close(fd)


def test_read_into_overlapping_requests_and_typed_views(s3) -> None:
    store = _store(s3)
    data = os.urandom(3 * MiB)
    etag = store.put_bytes("o/x", data)
    import array
    words = array.array("i", bytes(4 * 1000))  # a non-byte view: filled by bytes all the same
    a, b = bytearray(1000), bytearray(500)
    store.read_into("o/x", [(10, memoryview(words)), (20, memoryview(a)), (700, memoryview(b))],
                    size=len(data), etag=etag, threads=1)
    assert words.tobytes() == data[10:4010] and bytes(a) == data[20:1020] and bytes(b) == data[700:1200]


def test_read_into_object_replaced(s3) -> None:
    store = _store(s3)
    store.put_bytes("c/data_0.tensors", b"a" * 5000)
    info = store.head("c/data_0.tensors")
    s3.boto3().put_object(Bucket=s3.bucket, Key="c/data_0.tensors", Body=b"b" * 5000)  # replaced behind our back
    buf = bytearray(10)
    with pytest.raises(ObjectChangedError, match=f"s3://{s3.bucket}/c/data_0.tensors: the object changed since"):
        store.read_into("c/data_0.tensors", [(100, memoryview(buf))], size=info.size, etag=info.etag)
    assert bytes(buf) == bytes(10)
    assert [(e["if_match"], e["status"]) for e in _ranged_gets(s3, "c/data_0.tensors")] == [(info.etag, 412)]


def test_read_into_wrong_size_is_detected(s3) -> None:
    store = _store(s3)
    store.put_bytes("c/f", b"q" * 5000)
    with pytest.raises(ObjectChangedError, match="is 5000 bytes but the checkpoint recorded 6000"):
        store.read_into("c/f", [(0, memoryview(bytearray(10)))], size=6000, etag=None)
    with pytest.raises(ObjectChangedError, match="past the object's end .*416"):
        store.read_into("c/f", [(5500, memoryview(bytearray(10)))], size=6000, etag=None)
    with pytest.raises(CheckpointError, match=r"s3://.*/c/f: bytes \[4995, 5005\) lie outside the 5000-byte"):
        store.read_into("c/f", [(4995, memoryview(bytearray(10)))], size=5000, etag=None)


class _FakeResponse:
    def __init__(self, headers: dict) -> None:
        self.headers = headers

    def getheader(self, name: str, default=None):
        return self.headers.get(name, default)


@pytest.mark.parametrize("headers, error, message", [
    ({"Content-Range": "bytes 0-99/1000", "Content-Length": "100"}, None, None),
    ({"Content-Range": "bytes 1-100/1000", "Content-Length": "100"}, CheckpointError, "answers a request for"),
    ({"Content-Range": "bytes 0-99/1001", "Content-Length": "100"}, ObjectChangedError, "is 1001 bytes"),
    ({"Content-Range": "bytes 0-99/*", "Content-Length": "100"}, CheckpointError, "is not 'bytes 0-99/1000'"),
    ({"Content-Length": "100"}, CheckpointError, "Content-Range ''"),
    ({"Content-Range": "bytes 0-99/1000", "Content-Length": "99"}, CheckpointError, "Content-Length '99'"),
    ({"Content-Range": "bytes 0-99/1000"}, CheckpointError, "Content-Length None"),
    ({"Content-Range": "bytes 0-99/1000", "Content-Length": "100", "ETag": '"other"'}, ObjectChangedError,
     "ETag \"other\" is not"),
])
def test_content_range_checks(headers, error, message) -> None:
    store = ObjectStore("bkt", endpoint_url="http://127.0.0.1:9")
    args = ("http://127.0.0.1:9/bkt/k", "s3://bkt/k", _FakeResponse(headers), 0, 99, 1000, '"tag"')
    if error is None:
        store._check_range(*args)
        return
    with pytest.raises(error) as err:
        store._check_range(*args)
    assert type(err.value) is error and "s3://bkt/k" in str(err.value) and message in str(err.value)


# ----------------------------------------------------------------------------------------------- retries

def test_503_retried_on_read_and_upload(s3, monkeypatch) -> None:
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    store = _store(s3)
    small = os.urandom(1 * MiB)
    s3.inject(503, count=3, method="PUT", match="/r/small")
    etag = store.upload("r/small", len(small), [(0, memoryview(small))])
    big = os.urandom(11 * MiB)
    s3.inject(503, count=3, method="PUT", query="partNumber")
    big_etag = store.upload("r/big", len(big), [(0, memoryview(big[:MiB])), (MiB, memoryview(big[MiB:]))])
    s3.inject(503, count=3, method="GET", code="SlowDown")
    out = bytearray(len(big))
    store.read_into("r/big", [(0, memoryview(out))], size=len(big), etag=big_etag, threads=2)
    assert bytes(out) == big and store.get_bytes("r/small", MiB) == (small, etag)
    log = s3.requests()
    puts = [e["status"] for e in log if e["method"] == "PUT" and e["key"] == "r/small"]
    assert puts == [503, 503, 503, 200]
    parts = [e for e in log if e["method"] == "PUT" and "partNumber" in e["query"]]
    assert sum(e["status"] == 503 for e in parts) == 3 and sum(e["status"] == 200 for e in parts) == 3
    gets = _ranged_gets(s3, "r/big")
    assert sum(e["status"] == 503 for e in gets) == 3 and sum(e["status"] == 206 for e in gets) == 1
    assert store.retries["PUT"] == 3 and store.retries["MPU_PART"] == 3 and store.retries["GET_RANGE"] == 3


def test_control_path_retries_and_gives_up(s3, monkeypatch) -> None:
    store = _store(s3)
    s3.inject(500, count=2, method="HEAD")
    assert store.head("nothing") is None
    assert [e["status"] for e in s3.requests() if e["method"] == "HEAD"] == [500, 500, 404]
    monkeypatch.setenv("MEGASHARD_S3_RETRIES", "1")
    s3.inject(503, count=5, method="PUT")
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/m/manifest.json failed after 2 attempts.*503"):
        store.put_bytes("m/manifest.json", b"{}")


def test_dropped_download_resumes_where_it_stopped(s3) -> None:
    store = _store(s3)
    data = os.urandom(2 * MiB)
    etag = store.put_bytes("t/x", data)
    s3.inject(truncate=300000, count=1, method="GET")
    out = bytearray(len(data) - 10)
    assert store.read_into("t/x", [(10, memoryview(out))], size=len(data), etag=etag) == len(out)
    assert bytes(out) == data[10:]
    gets = _ranged_gets(s3, "t/x")
    assert [e["range"] for e in gets] == [f"bytes=10-{len(data) - 1}", f"bytes={10 + 300000}-{len(data) - 1}"]
    assert all(e["if_match"] == etag for e in gets)


def test_permanent_errors_are_not_retried(s3) -> None:
    store = _store(s3)
    s3.inject(403, count=1, method="GET")
    store.put_bytes("f/x", b"1234")
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/f/x: access denied .*403"):
        store.read_into("f/x", [(0, memoryview(bytearray(4)))], size=4, etag=None)
    with pytest.raises(CheckpointError, match=f"s3://{s3.bucket}/f/missing: the object does not exist"):
        store.read_into("f/missing", [(0, memoryview(bytearray(4)))], size=4, etag=None)
    assert sum(store.retries.values()) == 0


# ----------------------------------------------------------------------------------------------- multipart

def test_multipart_upload_from_segments_byte_identical(s3, monkeypatch) -> None:
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    store = _store(s3)
    data = os.urandom(13 * MiB + 12345)
    cuts = [0, 7, 3 * MiB + 1, 5 * MiB, 5 * MiB + 1, 10 * MiB - 3, 12 * MiB, len(data)]  # spans part boundaries
    segments = [(a, memoryview(data)[a:b]) for a, b in zip(cuts, cuts[1:])]
    etag = store.upload("u/data_0.tensors", len(data), segments, threads=3)
    assert etag.endswith('-3"')
    body = s3.boto3().get_object(Bucket=s3.bucket, Key="u/data_0.tensors")["Body"].read()
    assert body == data
    assert store.stats["MPU_CREATE"] == 1 and store.stats["MPU_PART"] == 3 and store.stats["MPU_COMPLETE"] == 1
    parts = sorted((e for e in s3.requests() if "partNumber" in e["query"]), key=lambda e: e["path"])
    assert len(parts) == 3 and all(e["status"] == 200 for e in parts)
    complete = [e for e in s3.requests() if e["method"] == "POST" and "uploadId" in e["query"]]
    assert [e["if_none_match"] for e in complete] == ["*"]
    assert store.list_uploads("u/") == []


def test_upload_small_and_empty_objects(s3) -> None:
    store = _store(s3)
    assert store.upload("e/empty", 0, [], if_none_match=False) == '"d41d8cd98f00b204e9800998ecf8427e"'
    assert store.get_bytes("e/empty", 0)[0] == b""
    store.upload("e/two", 6, [(0, memoryview(b"abc")), (3, memoryview(b"def"))])
    assert store.get_bytes("e/two", 10)[0] == b"abcdef"
    with pytest.raises(CheckpointError, match="segments must tile"):
        store.upload("e/bad", 6, [(0, memoryview(b"abc")), (4, memoryview(b"de"))])
    with pytest.raises(CheckpointError, match="hold 3 bytes, not 6"):
        store.upload("e/bad", 6, [(0, memoryview(b"abc"))])


def test_failed_multipart_upload_is_aborted(s3, monkeypatch) -> None:
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    store = _store(s3)
    data = os.urandom(11 * MiB)
    s3.inject(403, count=1, method="PUT", query="partNumber")
    with pytest.raises(CheckpointError, match=f"PUT of s3://{s3.bucket}/a/data_0.tensors failed: HTTP 403"):
        store.upload("a/data_0.tensors", len(data), [(0, memoryview(data))])
    assert store.list_uploads("a/") == []
    assert store.head("a/data_0.tensors") is None
    assert store.stats["MPU_ABORT"] == 1


def test_list_uploads_and_abort(s3) -> None:
    store = _store(s3)
    raw = s3.boto3()
    up1 = raw.create_multipart_upload(Bucket=s3.bucket, Key="w/.megashard-save-1/data_0.tensors")["UploadId"]
    up2 = raw.create_multipart_upload(Bucket=s3.bucket, Key="w/.megashard-save-1/data_1.tensors")["UploadId"]
    raw.create_multipart_upload(Bucket=s3.bucket, Key="elsewhere/x")
    uploads = store.list_uploads("w/")
    assert sorted((k, u) for k, u, _ in uploads) == sorted([("w/.megashard-save-1/data_0.tensors", up1),
                                                           ("w/.megashard-save-1/data_1.tensors", up2)])
    assert all(isinstance(t, float) and t > 0 for _, _, t in uploads)
    store.abort_upload("w/.megashard-save-1/data_0.tensors", up1)
    store.abort_upload("w/.megashard-save-1/data_0.tensors", up1)  # already gone: fine
    assert [(k, u) for k, u, _ in store.list_uploads("w/")] == [("w/.megashard-save-1/data_1.tensors", up2)]
    assert store.stats["MPU_LIST"] == 2 and store.stats["MPU_ABORT"] == 2


# ----------------------------------------------------------------------------------------------- setup errors

def test_missing_boto3_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    store = ObjectStore("bkt", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(CheckpointError, match="pip install boto3"):
        store.head("k")


def test_msc_without_the_package_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "multistorageclient", None)
    with pytest.raises(CheckpointError, match="pip install multi-storage-client"):
        ObjectStore.for_url("msc://prof/run")


def test_msc_profile_resolves_to_its_s3_bucket(monkeypatch) -> None:
    """multi-storage-client is not installed here: a stand-in module gives its config dict."""
    config = {"profiles": {
        "ckpt": {"storage_provider": {"type": "s3", "options": {"base_path": "bkt-a/team/runs",
                                                                "endpoint_url": "http://127.0.0.1:9",
                                                                "region_name": "eu-west-1"}},
                 "credentials_provider": {"type": "S3Credentials",
                                          "options": {"access_key": "${MSC_TEST_AK}", "secret_key": "sk"}}},
        "local": {"storage_provider": {"type": "file", "options": {"base_path": "/tmp"}}}}}
    fake = types.ModuleType("multistorageclient")
    fake.StorageClientConfig = type("StorageClientConfig", (), {
        "read_msc_config": staticmethod(lambda: (config, "/etc/msc_config.yaml"))})
    monkeypatch.setitem(sys.modules, "multistorageclient", fake)
    monkeypatch.setenv("MSC_TEST_AK", "ak")
    objclient.clear_store_cache()
    store, key = ObjectStore.for_url("msc://ckpt/run1/iter_0000100")
    assert (store.bucket, key, store.endpoint_url, store.region) == ("bkt-a", "team/runs/run1/iter_0000100",
                                                                    "http://127.0.0.1:9", "eu-west-1")
    assert store._credentials == {"aws_access_key_id": "ak", "aws_secret_access_key": "sk"}
    with pytest.raises(CheckpointError, match="msc://local/x: profile 'local' uses storage provider 'file'"):
        ObjectStore.for_url("msc://local/x")
    with pytest.raises(CheckpointError, match="profile 'nope' is not in the multi-storage-client config"):
        ObjectStore.for_url("msc://nope/x")
    objclient.clear_store_cache()


def test_bulk_connection_is_per_thread_and_reconnects(s3) -> None:
    store = _store(s3)
    etag = store.put_bytes("c/x", b"0123456789")
    buf = bytearray(4)
    store.read_into("c/x", [(2, memoryview(buf))], size=10, etag=etag, threads=1)
    # (get_bytes_many's extra connections of this thread, ``slot`` > 0, have keys one longer)
    conns = {k: c for k, c in getattr(objclient._LOCAL, "conns", {}).items() if len(k) == 3}
    assert len(conns) == 1
    conn = next(iter(conns.values()))
    assert isinstance(conn, http.client.HTTPConnection)
    conn.close()  # a dead socket is reopened on the next request
    store.read_into("c/x", [(6, memoryview(buf))], size=10, etag=etag, threads=1)
    assert bytes(buf) == b"6789" and objclient._LOCAL.conns[next(iter(conns))] is conn


def test_a_connection_idle_past_the_servers_keepalive_is_replaced_not_retried(s3, monkeypatch) -> None:
    """A server closes idle keep-alive connections (SeaweedFS within 150 s): a save minutes after the
    last one must not spend a failed attempt and a retry per connection on them."""
    import socket
    import time

    store = _store(s3)
    data = _data(64 * 1024)
    etag = store.put_bytes("idle/x", data)
    buf = bytearray(len(data))
    store.read_into("idle/x", [(0, memoryview(buf))], size=len(data), etag=etag, threads=1)
    key = next(k for k in objclient._LOCAL.conns if len(k) == 3)  # the bulk path's (not get_bytes_many's extra)
    conn = objclient._LOCAL.conns[key]
    if conn.sock is None:  # the test endpoint closes after each answer; a kept-alive socket, as S3 keeps it
        conn.connect()
    conn.sock.shutdown(socket.SHUT_RDWR)  # what the server's idle timeout leaves behind
    later = time.monotonic() + 3600
    monkeypatch.setattr(objclient, "_clock", lambda: later, raising=False)
    store.retries.clear()
    buf[:] = bytes(len(buf))
    store.read_into("idle/x", [(0, memoryview(buf))], size=len(data), etag=etag, threads=1)
    assert bytes(buf) == data and dict(store.retries) == {}
    assert objclient._LOCAL.conns[key] is not conn


# ----------------------------------------------------------------------------------------------- lost answers

def test_lost_answer_of_conditional_put_is_not_a_conflict(s3, monkeypatch) -> None:
    """The write lands, its answer is lost (503), the retry meets our own object: success, not a conflict."""
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    store = _store(s3)
    s3.inject(503, method="PUT", match="/h/manifest.json", after=True)
    etag = store.put_bytes("h/manifest.json", b'{"objects": "a"}', if_none_match=True)
    s3.inject(503, method="PUT", match="/h/manifest.json", after=True)
    etag2 = store.put_bytes("h/manifest.json", b'{"objects": "b"}', if_match=etag)
    assert store.get_bytes("h/manifest.json", 100) == (b'{"objects": "b"}', etag2)
    statuses = [(e["method"], e["status"]) for e in s3.requests() if e["key"] == "h/manifest.json"]
    assert statuses[:8] == [("PUT", 503), ("PUT", 412), ("HEAD", 200), ("GET", 200),
                            ("PUT", 503), ("PUT", 412), ("HEAD", 200), ("GET", 200)]
    small = os.urandom(1000)
    s3.inject(503, method="PUT", match="/h/small", after=True)
    assert store.upload("h/small", len(small), [(0, memoryview(small))]) == store.head("h/small").etag
    big = os.urandom(6 * MiB)
    s3.inject(503, method="POST", query="uploadId", after=True)
    etag = store.upload("h/big", len(big), [(0, memoryview(big))])
    assert etag == store.head("h/big").etag and etag.endswith('-2"')
    assert s3.boto3().get_object(Bucket=s3.bucket, Key="h/big")["Body"].read() == big
    assert store.list_uploads("h/") == []


def test_retry_that_meets_another_writer_still_conflicts(s3) -> None:
    store = _store(s3)
    theirs = store.put_bytes("h/manifest.json", b"theirs")
    s3.inject(503, method="PUT", match="/h/manifest.json")  # our first attempt fails before it lands
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/h/manifest.json"):
        store.put_bytes("h/manifest.json", b"ours", if_none_match=True)
    s3.inject(503, method="PUT", match="/h/small")
    store.put_bytes("h/small", b"theirs")
    with pytest.raises(CommitConflictError, match=f"s3://{s3.bucket}/h/small"):
        store.upload("h/small", 4, [(0, memoryview(b"ours"))])
    assert store.get_bytes("h/manifest.json", 10) == (b"theirs", theirs)


# ----------------------------------------------------------------------------------------------- paging, fork

def test_list_delete_and_uploads_page(s3, monkeypatch) -> None:
    monkeypatch.setattr(objclient, "_PAGE", 2)
    store = _store(s3)
    keys = [f"g/obj{i}" for i in range(5)]
    for k in keys:
        store.put_bytes(k, k.encode())
    for i in range(3):
        s3.boto3().create_multipart_upload(Bucket=s3.bucket, Key=f"g/up{i}")
    assert [o.key for o in store.list("g/")[0]] == keys
    assert len(store.list_uploads("g/")) == 3
    store.delete(keys)
    assert store.list("g/") == ([], [])
    assert store.stats["LIST"] == 3 + 1 and store.stats["DELETE"] == 3 and store.stats["MPU_LIST"] == 2


def test_fork_gets_fresh_stores_and_connections(s3) -> None:
    store = _store(s3)
    etag = store.put_bytes("f/x", b"abcdef")
    store.read_into("f/x", [(0, memoryview(bytearray(2)))], size=6, etag=etag, threads=1)
    assert objclient._LOCAL.conns and objclient._STORES
    pid = os.fork()
    if pid == 0:  # child: nothing inherited; a new store works
        ok = not objclient._STORES and not getattr(objclient._LOCAL, "conns", None) and objclient._POOL is None
        try:
            buf = bytearray(3)
            ObjectStore.for_url(s3.url())[0].read_into("f/x", [(3, memoryview(buf))], size=6, etag=etag)
            ok = ok and bytes(buf) == b"def"
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_boto3_is_imported_only_when_a_url_is_used() -> None:
    import subprocess
    code = ("import sys, megashard.storage.s3 as o; o.parse_url('s3://bkt/x'); o.ObjectStore('bkt'); "
            "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_bad_tuning_variables_are_named(s3, monkeypatch) -> None:
    store = _store(s3)
    etag = store.put_bytes("v/x", b"123")
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", "16M")
    with pytest.raises(CheckpointError, match="MEGASHARD_S3_GET_BYTES='16M' is not an integer"):
        store.read_into("v/x", [(0, memoryview(bytearray(3)))], size=3, etag=etag)
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", "0")
    with pytest.raises(CheckpointError, match="MEGASHARD_S3_GET_BYTES=0 is below its minimum 1"):
        store.read_into("v/x", [(0, memoryview(bytearray(3)))], size=3, etag=etag)


def test_every_parallel_worker_runs_at_once_even_when_calls_nest() -> None:
    """A bulk call's workers must all be running at once (each holds a connection): an outer call on
    every connection whose tasks each make an inner parallel call still gets all its workers, and
    so do the inner calls; a fixed-size executor queued the inner ones behind busy threads."""
    import threading

    n = objclient.connections()
    outer = threading.Barrier(n, timeout=20)

    def task() -> int:
        outer.wait()  # every outer worker is running
        inner = threading.Barrier(3, timeout=20)
        return sum(objclient._run_parallel([lambda: inner.wait() + 1] * 3, 3))

    got: List[List[int]] = []
    t = threading.Thread(target=lambda: got.append(objclient._run_parallel([task] * n, n)), daemon=True)
    t.start()
    t.join(60)  # a queued worker never starts: fail, do not hang
    assert got == [[0 + 1 + 2 + 3] * n], "parallel workers were queued behind busy threads"


def test_gets_are_cut_into_whole_rounds_of_the_connections(s3, monkeypatch) -> None:
    """5 MiB in 1 MiB GETs on 2 connections would be 5 GETs, the last alone after the other
    connection has finished: cut instead into 3 whole rounds, 6 GETs of at most 1 MiB. A last round
    of a few bytes is left as planned."""
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(MiB))
    store = _store(s3)
    data = os.urandom(5 * MiB)
    etag = store.upload("w/x", len(data), [(0, memoryview(data))], if_none_match=True)
    s3.reset()
    buf = bytearray(len(data))
    assert store.read_into("w/x", [(0, memoryview(buf))], size=len(data), etag=etag, threads=2) == len(data)
    assert bytes(buf) == data
    spans = sorted(tuple(int(x) for x in e["range"][6:].split("-")) for e in _ranged_gets(s3, "w/x"))
    assert len(spans) == 6 and all(b - a + 1 <= MiB for a, b in spans)
    assert spans[0][0] == 0 and spans[-1][1] == len(data) - 1
    assert all(spans[k][1] + 1 == spans[k + 1][0] for k in range(5))
    assert objclient._balanced_limit([MiB] * 4, 2) is None  # whole rounds already
    assert objclient._balanced_limit([MiB] * 3, 4) is None  # one round
    assert objclient._balanced_limit([MiB] * 4 + [100], 2) is None  # a last round of 100 bytes
    assert objclient._balanced_limit([16 * MiB] * 17, 16) == -(-17 * 16 * MiB // 32)


def test_get_size_is_one_round_of_the_connections_in_whole_16_mib_steps(s3, monkeypatch) -> None:
    """Unset ``MEGASHARD_S3_GET_BYTES``: a bulk read's GETs are about one per connection, in whole
    multiples of 16 MiB from 16 to 64 MiB (fewer requests cost client and server less per byte).
    40 MiB on 2 connections: 2 GETs, [0, 32 MiB) and [32, 40 MiB), not 3 of 16 MiB; bit-exact."""
    monkeypatch.delenv("MEGASHARD_S3_GET_BYTES", raising=False)
    assert objclient.get_bytes_for(512 * MiB, 16) == 32 * MiB
    assert objclient.get_bytes_for(256 * MiB, 16) == 16 * MiB
    assert objclient.get_bytes_for(100, 16) == 16 * MiB
    assert objclient.get_bytes_for(40 * MiB, 1) == 48 * MiB
    assert objclient.get_bytes_for(8 << 30, 16) == 64 * MiB
    store = _store(s3)
    data = os.urandom(40 * MiB)
    etag = store.upload("w/y", len(data), [(0, memoryview(data))], if_none_match=True)
    s3.reset()
    buf = bytearray(len(data))
    assert store.read_into("w/y", [(0, memoryview(buf))], size=len(data), etag=etag, threads=2) == len(data)
    assert bytes(buf) == data
    spans = sorted(tuple(int(x) for x in e["range"][6:].split("-")) for e in _ranged_gets(s3, "w/y"))
    assert spans == [(0, 32 * MiB - 1), (32 * MiB, 40 * MiB - 1)]
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(16 * MiB))  # told: as told
    assert objclient.get_bytes_for(512 * MiB, 16) == 16 * MiB


def test_gets_are_cut_at_multiples_of_the_get_size(s3, monkeypatch) -> None:
    """A run's GETs end at multiples of the GET size in the object (a file's tensors start after its
    header: from byte 8192, 3 MiB + 100 bytes in 1 MiB GETs are [8192, 1 MiB), [1 MiB, 2 MiB), ...), so
    with parts of a multiple of the GET size (:func:`part_bytes`) no GET spans two parts: S3 serves a
    part-aligned range from one part, SeaweedFS from whole 4 MiB chunks. Never more GETs than cutting
    from the run's start: a short run across a multiple stays one GET."""
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(MiB))
    store = _store(s3)
    data = os.urandom(5 * MiB)
    etag = store.upload("a/x", len(data), [(0, memoryview(data))], if_none_match=True)
    s3.reset()
    start, n = 8192, 3 * MiB + 100
    buf = bytearray(n)
    assert store.read_into("a/x", [(start, memoryview(buf))], size=len(data), etag=etag, threads=4) == n
    assert bytes(buf) == data[start:start + n]
    spans = sorted(tuple(int(x) for x in e["range"][6:].split("-")) for e in _ranged_gets(s3, "a/x"))
    assert spans == [(start, MiB - 1), (MiB, 2 * MiB - 1), (2 * MiB, 3 * MiB - 1), (3 * MiB, start + n - 1)]
    s3.reset()
    small = bytearray(MiB // 2)  # [0.75 MiB, 1.25 MiB): one GET, not two
    store.read_into("a/x", [(3 * MiB // 4, memoryview(small))], size=len(data), etag=etag)
    assert bytes(small) == data[3 * MiB // 4:3 * MiB // 4 + MiB // 2]
    assert [e["range"] for e in _ranged_gets(s3, "a/x")] == [f"bytes={3 * MiB // 4}-{5 * MiB // 4 - 1}"]


def test_default_parts_are_a_multiple_of_the_get_size_where_that_costs_no_upload_time(monkeypatch) -> None:
    """The benchmark's 256 MiB file (+ 20 KiB of headers) on 16 connections: 16 parts of 16 MiB and a
    20 KiB one, not 16 of 17 MiB (whose ranged GETs of 16 MiB each spanned two parts). A size where a
    power-of-two part would make a connection send more than 1.1x the bytes of the plain size /
    connections keeps that (272 MiB: 17 parts of 16 MiB would send two on one connection)."""
    for name in ("MEGASHARD_S3_PART_BYTES", "MEGASHARD_S3_CONNECTIONS", "MEGASHARD_S3_GET_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert objclient.part_bytes(256 * MiB + 20728) == 16 * MiB
    assert objclient.part_bytes(272 * MiB) == 17 * MiB
    assert objclient.part_bytes(100 * MiB) == 8 * MiB  # the smallest default part already
    assert objclient.part_bytes(480 * MiB) == 32 * MiB  # 15 parts of 32 MiB, not 16 of 30: 7% more per connection
    assert objclient.part_bytes(1024 * MiB) == 64 * MiB
    for size in range(64 * MiB + 1, 4096 * MiB, 7 * MiB + 12345):  # never 10% more bytes on one connection
        plain = min(64 * MiB, max(8 * MiB, -(-(-(-size // 16)) // MiB) * MiB))
        assert objclient._connection_bytes(size, objclient.part_bytes(size), 16) <= 1.1 * \
            objclient._connection_bytes(size, plain, 16)
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(17 * MiB))  # set: taken as given
    assert objclient.part_bytes(256 * MiB + 20728) == 17 * MiB


def test_a_short_last_part_after_whole_rounds_goes_with_the_part_before(s3, monkeypatch) -> None:
    """10 MiB + 100 KiB in 5 MiB parts on 2 connections: 2 parts (5 MiB, 5 MiB + 100 KiB), not 3
    (the third alone in a second round); on 4 connections (no whole round) the short part stays its own."""
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))
    monkeypatch.setenv("MEGASHARD_S3_CONNECTIONS", "2")
    store = _store(s3)
    data = os.urandom(10 * MiB + 100 * 1024)
    etag = store.upload("p/x", len(data), [(0, memoryview(data))], if_none_match=True)
    assert store.stats["MPU_PART"] == 2 and etag.endswith('-2"')
    buf = bytearray(len(data))
    store.read_into("p/x", [(0, memoryview(buf))], size=len(data), etag=etag)
    assert bytes(buf) == data
    assert objclient._part_spans(len(data), 5 * MiB, 4) == [(0, 5 * MiB), (5 * MiB, 10 * MiB), (10 * MiB, len(data))]
    assert len(objclient._part_spans(256 * MiB + 20728, 16 * MiB, 16)) == 16


class _LateHeaders:
    """A stand-in for the save's ``DeferredHashes``: the bytes of ``ranges`` hold zeros until :meth:`wait` is
    asked for them, then their final bytes (as a tensor header gets its hashes)."""

    def __init__(self, buf: bytearray, final: bytes, ranges: List[Tuple[int, int]]) -> None:
        self.buf, self.final, self.ranges = buf, final, ranges
        self.waited: List[Tuple[int, int]] = []
        for s, e in ranges:
            buf[s:e] = bytes(e - s)

    def wait(self, a: int, b: int) -> None:
        self.waited.append((a, b))
        for s, e in self.ranges:
            if s < b and a < e:
                self.buf[s:e] = self.final[s:e]


@pytest.mark.parametrize("part_mib", [64, 5])  # one PUT; multipart with a range across a part boundary
def test_upload_sends_pending_bytes_only_once_they_are_final(s3, monkeypatch, part_mib) -> None:
    """Bytes in ``pending.ranges`` go out only after ``pending.wait`` covered them, and every part waits
    only for the ranges it holds, not for the whole object: the object holds the final bytes."""
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(part_mib * MiB))
    store = _store(s3)
    final = os.urandom(11 * MiB + 777)
    ranges = [(100, 200), (3 * MiB, 3 * MiB + 4096), (5 * MiB - 10, 5 * MiB + 10), (11 * MiB + 700, 11 * MiB + 777)]
    buf = bytearray(final)
    pending = _LateHeaders(buf, final, ranges)
    cuts = sorted({0, len(final), *(x for r in ranges for x in r)})  # each range its own segment, as headers are
    segments = [(a, memoryview(buf)[a:b]) for a, b in zip(cuts, cuts[1:])]
    etag = store.upload("late/data_0.tensors", len(final), segments, pending=pending)
    assert s3.boto3().get_object(Bucket=s3.bucket, Key="late/data_0.tensors")["Body"].read() == final
    assert etag == store.head("late/data_0.tensors").etag
    assert (0, len(final)) not in pending.waited  # nothing waited for the whole object
    assert sorted(pending.waited) == sorted(set(pending.waited))  # each piece waited for once


def test_a_failure_while_a_body_is_half_sent_drops_that_connection(s3, monkeypatch) -> None:
    """The hashing fails after the request's first bytes went out: the upload raises that error, nothing is
    stored, and the thread's next request goes on a fresh connection (not after a half-sent body): no retry."""
    store = _store(s3)
    final = os.urandom(2 * MiB)
    buf = bytearray(final)

    class Failing(_LateHeaders):
        def wait(self, a: int, b: int) -> None:
            if a >= MiB:
                raise RuntimeError("hashing failed")
            super().wait(a, b)

    ranges = [(10, 20), (MiB, MiB + 100)]
    cuts = [0, 10, 20, MiB, MiB + 100, len(final)]
    with pytest.raises(RuntimeError, match="hashing failed"):
        store.upload("half/x", len(final), [(a, memoryview(buf)[a:b]) for a, b in zip(cuts, cuts[1:])],
                     pending=Failing(buf, final, ranges))
    assert store.head("half/x") is None
    store.retries.clear()
    etag = store.upload("half/y", len(final), [(0, memoryview(final))])
    assert store.get_bytes("half/y", len(final))[0] == final and etag == store.head("half/y").etag
    assert sum(store.retries.values()) == 0
