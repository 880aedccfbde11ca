"""Checkpoints in an S3-compatible object store (issue 22), against a real local endpoint
(SeaweedFS on 127.0.0.1 behind a proxy, tests/s3_endpoint.py) that logs every request."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import megashard
from megashard import CheckpointError, MegashardError, storage
from megashard.errors import CommitConflictError
from megashard.storage.s3 import checkpoint as objck
from megashard.sharded import ShardedTensor
from megashard.storage.s3.client import ObjectStore

from bitexact import assert_same
from distributed import all_ok, run_ranks

MiB = 1 << 20


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    """5 MiB parts (S3's minimum): the ~12 MiB tensor below goes up in a multipart upload."""
    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(5 * MiB))


def state(seed: int = 0, big: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "iteration": 7 + seed,
        "name": f"run-{seed}",
    }
    if big:  # above one 5 MiB part: a multipart upload
        out["big"] = torch.randn(3 * MiB + 1000, generator=g)  # ~12 MiB
    return out


def template(s: dict) -> dict:
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in s.items()}


def check_loaded(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert_same(got[k], v)
        else:
            assert got[k] == v


def _objects(url: str) -> dict:
    store, key = ObjectStore.for_url(url)
    objects, _ = store.list(key + "/")
    return {o.key[len(key) + 1:]: o for o in objects}


def _data_names(url: str) -> dict:
    """{file name: bytes} of the committed save's data objects."""
    store, key = ObjectStore.for_url(url)
    head, _ = store.get_bytes(f"{key}/manifest.json", 1 << 20)
    prefix = json.loads(head)["data_prefix"]
    out = {}
    for name, o in _objects(url).items():
        if name.startswith(prefix + "/") and name.endswith(".tensors"):
            data, _ = store.get_bytes(o.key, 64 * MiB)
            out[name.split("/", 1)[1]] = data
    return out


def test_save_load_bit_exact_and_objects_identical_to_a_posix_save(s3, tmp_path):
    want = state(big=True)
    url = s3.url("run/iter_0000007")
    megashard.save(want, url)
    megashard.save(want, tmp_path / "posix")
    got = megashard.load(template(want), url)
    check_loaded(got, want)
    remote = _data_names(url)
    local = {n: (tmp_path / "posix" / n).read_bytes() for n in os.listdir(tmp_path / "posix") if n.endswith(".tensors")}
    assert remote.keys() == local.keys() and remote == local
    names = set(_objects(url))
    assert "manifest.json" in names and all(n == "manifest.json" or n.startswith(".megashard-save-") for n in names)
    reqs = s3.requests()
    assert any(r["method"] == "POST" and "uploads" in r.get("query", "") for r in reqs)  # multipart was used
    assert megashard.load_common(url, ["iteration"]) == {"iteration": 7}


def test_tensorizer_reads_a_shard_object_from_s3(s3):
    from tensorizer import TensorDeserializer, stream_io

    want = {"w": torch.randn(128, 16), "b": torch.arange(10, dtype=torch.int32)}
    url = s3.url("tz/iter_0000001")
    megashard.save(want, url, align=1)
    store, key = ObjectStore.for_url(url)
    name = next(n for n in _objects(url) if n.endswith(".tensors"))
    stream = stream_io.open_stream(f"{url}/{name}", "rb", s3_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                                   s3_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                                   s3_endpoint=s3.endpoint, force_http=True)
    with TensorDeserializer(stream, verify_hash=True, lazy_load=False) as d:
        got = {k: d[k] for k in d.keys()}
    assert len(got) == 2
    for k, v in got.items():
        assert_same(v, want["w"] if v.dtype == torch.float32 else want["b"])


def test_crc32_only_save_to_s3_equals_a_posix_one_and_tensorizer_verifies_it(s3, tmp_path):
    """``sha256=False``: the uploaded objects are the file-system save's bytes (CRC32-only headers,
    no SHA-256 computed), a default load checks their CRC32s and tensorizer verifies them."""
    from tensorizer import TensorDeserializer

    from megashard.format import open_file

    want = state(big=True)
    url = s3.url("crc/iter_0000003")
    megashard.save(want, url, sha256=False)
    megashard.save(want, tmp_path / "posix", sha256=False)
    remote = _data_names(url)
    local = {n: (tmp_path / "posix" / n).read_bytes() for n in os.listdir(tmp_path / "posix") if n.endswith(".tensors")}
    assert remote.keys() == local.keys() and remote == local
    (name,) = local
    with open_file(tmp_path / "posix" / name) as r:
        assert {i.sha256 for i in r.infos()} == {""} and r.verify_all() == []
    with TensorDeserializer(str(tmp_path / "posix" / name), device="cpu", verify_hash=True) as d:
        got = {k: d[k] for k in d.keys()}
    assert_same(next(v for v in got.values() if v.numel() == want["big"].numel()), want["big"])
    got, stats = megashard.load(template(want), url, return_stats=True)
    check_loaded(got, want)
    assert stats.crc_checked >= want["big"].numel() * 4
    check_loaded(megashard.load(template(want), url, verify=True), want)


def _save_and_load_ranks(rank, world, url, mode):
    import torch.distributed as dist

    from megashard.storage.s3.client import ObjectStore
    from megashard.sharded import ShardedTensor

    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    rows = 64 // world
    piece = full[rank * rows:(rank + 1) * rows].clone()
    megashard.save({"w": ShardedTensor.from_rank_offsets("w", piece, (0, rank, world))}, url)
    dist.barrier()
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    # reshard: every rank loads column halves instead of row blocks
    cols = 8 // world
    dest = torch.empty(64, cols)
    _, st = megashard.load({"w": ShardedTensor.from_rank_offsets("w", dest, (1, rank, world))}, url, mode=mode,
                           return_stats=True)
    return {"ok": bool(torch.equal(dest, full[:, rank * cols:(rank + 1) * cols])), "stats": dict(store.stats),
            "mode": st.mode, "read": st.bytes_read}


@pytest.mark.parametrize("mode", ["own", "scatter", "readonce"])
def test_two_ranks_save_and_reshard_with_exact_request_counts(s3, mode):
    url = s3.url(f"dist-{mode}/iter_0000001")
    # readonce: the two ranks on two nodes, where mode="auto" chooses it
    env = ({str(r): {"MEGASHARD_NODE_ID": f"node{r}"} for r in range(2)} if mode == "readonce"
           else {"MEGASHARD_NODE_ID": "node0"})
    out = all_ok(run_ranks(_save_and_load_ranks, 2, url, "auto" if mode == "readonce" else mode, env=env))
    assert [o["mode"] for o in out] == [mode, mode]
    assert all(o["ok"] for o in out)
    assert_same(megashard.load_consolidated(url)["w"], torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8))
    for r, o in enumerate(out):
        assert o["stats"].get("LIST", 0) == 0, f"rank {r} listed the bucket on load: {o['stats']}"
    if mode == "scatter":
        reader, other = out[0]["stats"], out[1]["stats"]
        assert sum(other.values()) == 0, f"rank 1 made requests in scatter mode: {other}"
        assert reader.get("GET", 0) == 3  # head, digest and the whole index, once for the node
    elif mode == "readonce":  # each rank saved one row block; both need (the covering spans of) both
        assert sum(o["read"] for o in out) == 64 * 8 * 4  # every byte left the store once for the job
        assert all(o["read"] > 0 for o in out)  # read on both nodes
        for o in out:
            assert o["stats"].get("GET", 0) == 3  # head, digest and the whole index, per rank
    else:
        for o in out:
            assert o["stats"].get("GET", 0) == 3  # head, digest and the whole index, per rank


def test_row_runs_load_bit_exact_in_ranged_gets(s3, monkeypatch):
    """Column halves loaded whole (own): each half's rows reach the object store's files object
    as one row run (``fastio.Requests``, a job of its own), which reads it as plain requests:
    bit-exact, and the back-to-back rows of both jobs coalesce into ranged GETs, not one GET per row."""
    from megashard.format.fastio import Requests
    from megashard.sharded import ShardedTensor

    url = s3.url("rows/iter_0000001")
    rows, cols = 64, 512  # a half row is 1 KiB: read in place, one request per row
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    megashard.save({k: ShardedTensor.from_rank_offsets("w", full[:, r * 256:(r + 1) * 256].contiguous(), (1, r, 2))
                    for r, k in enumerate("ab")}, url)
    seen = []
    real = objck.ObjectCheckpointFiles.read_files

    def spy(self, jobs, **kw):
        for _, reqs, _ in jobs:
            if isinstance(reqs, Requests):
                seen.append([len(views) for _, _, views in reqs.runs])
        return real(self, jobs, **kw)

    monkeypatch.setattr(objck.ObjectCheckpointFiles, "read_files", spy)
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    dest = torch.zeros(rows, cols)
    megashard.load({"w": ShardedTensor.from_rank_offsets("w", dest)}, url, mode="own")
    assert_same(dest, full)
    assert seen == [[rows], [rows]]  # one job per row run: each saved half's CRC32 is checked as soon as it is in
    assert 1 <= store.stats.get("GET_RANGE", 0) <= 2, dict(store.stats)  # 2 * 64 rows in one or two GETs


def test_a_stale_resave_loses_cleanly(s3, monkeypatch):
    url = s3.url("race/iter_0000001")
    megashard.save(state(0), url)
    real = objck.ObjectSave.commit
    done = []

    def overtaken(self, *a, **k):
        if not done:  # another save of the same checkpoint commits first
            done.append(1)
            monkeypatch.setattr(objck.ObjectSave, "commit", real)
            megashard.save(state(2), url)
            monkeypatch.setattr(objck.ObjectSave, "commit", overtaken)
        return real(self, *a, **k)

    monkeypatch.setattr(objck.ObjectSave, "commit", overtaken)
    with pytest.raises(CommitConflictError, match="another save committed"):
        megashard.save(state(1), url)
    check_loaded(megashard.load(template(state(2)), url), state(2))
    prefixes = {n.split("/", 1)[0] for n in _objects(url) if "/" in n}
    assert len(prefixes) == 1, prefixes  # the loser's objects and the replaced save's are gone


def test_an_object_replaced_after_the_commit_is_detected(s3):
    url = s3.url("swap/iter_0000001")
    megashard.save(state(0), url)
    megashard.save(state(1), s3.url("other/iter_0000001"))
    store, _ = ObjectStore.for_url(url)
    name, data = next(iter(_data_names(url).items()))
    other = _data_names(s3.url("other/iter_0000001"))[name]
    assert len(other) == len(data) and other != data
    key = next(o.key for n, o in _objects(url).items() if n.endswith("/" + name))
    store.put_bytes(key, other)  # same size, other bytes
    with pytest.raises(CheckpointError, match="replaced|changed"):
        megashard.load(template(state(0)), url)


def test_hostile_data_prefix_is_refused_before_any_request(s3):
    url = s3.url("hostile/iter_0000001")
    megashard.save(state(0), url)
    store, key = ObjectStore.for_url(url)
    head, _ = store.get_bytes(f"{key}/manifest.json", 1 << 20)
    for bad in ["../other", ".megashard-save-x/../../y", "other-prefix", "", None]:
        doc = json.loads(head)
        doc["data_prefix"] = bad
        store.put_bytes(f"{key}/manifest.json", json.dumps(doc).encode())
        s3.reset()
        with pytest.raises(CheckpointError, match="data_prefix"):
            megashard.load(template(state(0)), url)
        keys = [r["key"] for r in s3.requests() if r["method"] in ("GET", "HEAD")]
        assert keys == [f"{key}/manifest.json"], keys  # nothing outside was asked for


def test_saves_and_loads_survive_injected_503s(s3):
    want = state(3, big=True)
    url = s3.url("flaky/iter_0000001")
    s3.inject(status=503, count=3, method="PUT")
    megashard.save(want, url)
    s3.inject(status=503, count=3, method="GET")
    check_loaded(megashard.load(template(want), url), want)
    assert sum(1 for r in s3.requests() if r["status"] == 503) == 6


def test_async_save_to_s3(s3):
    want = state(4, big=True)
    url = s3.url("async/iter_0000001")
    h = megashard.save(want, url, async_save=True)
    want_copy = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in want.items()}
    want["w"].zero_()  # the snapshot was taken: changing the tensors now changes nothing saved
    h.result()
    check_loaded(megashard.load(template(want_copy), url), want_copy)


def test_inspect_and_verify_an_s3_checkpoint(s3, capsys):
    from megashard.checkpoint_tools import verify_checkpoint
    from megashard.cli import main as cli_main

    url = s3.url("tools/iter_0000009")
    megashard.save(state(5), url)
    assert verify_checkpoint(url) == []
    assert cli_main(["inspect", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == url and info["totals"]["iteration"] == 12 and info["totals"]["files"] == 1
    check_loaded(megashard.load(template(state(5)), url, verify=True), state(5))
    # one flipped bit in the shard object: verify names it, a verified load refuses it
    store, key = ObjectStore.for_url(url)
    obj = next(o for n, o in _objects(url).items() if n.endswith(".tensors"))
    data = bytearray(store.get_bytes(obj.key, 64 * MiB)[0])
    data[-100] ^= 1
    store.put_bytes(obj.key, bytes(data))
    problems = verify_checkpoint(url)
    assert problems and any(".tensors" in p for p in problems), problems


_SAVER = textwrap.dedent("""
    import os, signal, sys, torch, megashard
    from megashard import storage
    url, when = sys.argv[1], sys.argv[2]
    if when == "before-tracker":  # die between the head PUT (the commit) and the tracker
        storage.write_tracker = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(64, 32, generator=g), "big": torch.randn(3 << 20, generator=g), "iteration": 2}
    megashard.save(state, url + "/iter_0000002")
    storage.write_tracker(url, 2)
""")


@pytest.mark.parametrize("when", ["mid-upload", "before-tracker"])
def test_sigkill_leaves_the_previous_checkpoint_and_recover_cleans(s3, when):
    root = s3.url(f"kill-{when}")
    megashard.save(state(0), root + "/iter_0000001")
    storage.write_tracker(root, 1)
    if when == "mid-upload":  # parts are in, the upload's completion keeps failing: SIGKILL then
        s3.inject(status=503, count=10_000, method="POST", query="uploadId", match="iter_0000002")
    p = subprocess.Popen([sys.executable, "-c", _SAVER, root, when], env=dict(os.environ))
    try:
        if when == "mid-upload":
            # the saver starts a Python, imports torch and uploads ~12 MiB before its first completion
            # POST: on a loaded 2-core CI box that can take well over a minute. The wait ends at the
            # first 503, so a generous limit costs nothing; past it, say so instead of killing the
            # saver early (which left no upload and failed the assertions below obscurely)
            deadline = time.monotonic() + 240
            while not any(r["status"] == 503 for r in s3.requests()):
                assert p.poll() is None and time.monotonic() < deadline, \
                    f"the saver never reached its upload's completion (exit status {p.poll()})"
                time.sleep(0.05)
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=300)  # before-tracker: the whole save, on a loaded box; ends as soon as it dies
    finally:
        p.kill()
        s3.reset()
    assert p.returncode == -signal.SIGKILL
    assert storage.read_tracker(root) == 1
    check_loaded(megashard.load(template(state(0)), root + "/iter_0000001"), state(0))
    second = root + "/iter_0000002"
    store, key = ObjectStore.for_url(second)
    if when == "mid-upload":
        assert storage.locate(second) is None  # objects and an unfinished upload, but no head: no checkpoint
        assert store.list_uploads(key + "/")
        removed = objck.cleanup(second, older_than_s=0)
        assert removed and _objects(second) == {} and store.list_uploads(key + "/") == []
    else:
        assert storage.locate(second) == second  # committed; the tracker still names iteration 1
        assert objck.cleanup(second, older_than_s=0) == []
        got = megashard.load({"w": torch.empty(64, 32), "big": torch.empty(3 << 20), "iteration": None}, second)
        assert got["iteration"] == 2


def test_a_save_refuses_a_prefix_holding_foreign_objects(s3):
    url = s3.url("foreign/iter_0000001")
    store, key = ObjectStore.for_url(url)
    store.put_bytes(f"{key}/model_optim_rng.pt", b"not ours")
    with pytest.raises(MegashardError, match="did not write"):
        megashard.save(state(0), url)
    assert set(_objects(url)) == {"model_optim_rng.pt"}


# --------------------------------------------------------------------------- commits whose outcome is unknown

# the requests of the commit sequence (method, path substring, query parameter) in the order a save sends them
_COMMIT_REQUESTS = {
    "index": ("PUT", "/manifest.index", None),
    "digest": ("PUT", "/manifest.sha256", None),
    "head": ("PUT", "iter_0000002/manifest.json", None),
    "delete-replaced": ("POST", None, "delete"),  # DeleteObjects of the replaced head's prefix
    "tracker": ("PUT", "/latest_checkpointed_iteration.txt", None),
}


def _head_prefix(url: str):
    store, key = ObjectStore.for_url(url)
    if store.head(f"{key}/manifest.json") is None:
        return None
    return json.loads(store.get_bytes(f"{key}/manifest.json", 1 << 20)[0])["data_prefix"]


def _assert_head_names_present_objects(url: str, states: dict) -> object:
    """docs/object-storage.md: never a head that names missing objects. Returns which state the head holds."""
    from megashard.checkpoint_tools import verify_checkpoint

    prefix = _head_prefix(url)
    if prefix is None:
        assert storage.locate(url) is None
        return None
    assert verify_checkpoint(url) == []
    for seed, want in states.items():
        got = megashard.load(template(want), url)
        if got["name"] == want["name"]:
            check_loaded(got, want)
            return seed
    raise AssertionError(f"{url} holds neither of {sorted(states)}")


@pytest.mark.parametrize("lost, first", [(lost, first) for lost in sorted(_COMMIT_REQUESTS) for first in (True, False)
                                         if not (first and lost == "delete-replaced")])  # a first save replaces none
def test_a_lost_answer_at_any_commit_request_never_leaves_a_head_naming_missing_objects(s3, monkeypatch, lost, first):
    """Every request of the commit sequence is applied by the store but its answer is lost, on every attempt
    (the retries run out): the head names objects that exist, and a head naming this save means it succeeded."""
    monkeypatch.setenv("MEGASHARD_S3_RETRIES", "1")
    root = s3.url(f"lost-{lost}-{first}")
    url = root + "/iter_0000002"
    if not first:
        megashard.save(state(0), url)
        storage.write_tracker(root, 2)
    method, match, query = _COMMIT_REQUESTS[lost]
    s3.inject(503, count=2, method=method, match=match, query=query, after=True)
    try:
        megashard.save(state(1), url)
        storage.write_tracker(root, 2)
        err = None
    except MegashardError as e:
        err = e
    assert any(r["injected"] for r in s3.requests()), "the injected request was never sent"
    s3.reset()
    held = _assert_head_names_present_objects(url, {0: state(0), 1: state(1)})
    if lost in ("index", "digest"):  # before the commit point: the save failed, the previous head stands
        assert err is not None and held == (None if first else 0)
    elif lost == "tracker":  # after the commit: the tracker's answer was lost, but it names a committed save
        assert held == 1 and storage.read_tracker(root) == 2 and "latest_checkpointed_iteration" in str(err)
    else:  # the head landed: read back, this save succeeded
        assert err is None and held == 1
    if held == 1:  # the prefix the head replaced is gone (its deletion landed) or left for a later clean-up
        assert {n.split("/", 1)[0] for n in _objects(url) if "/" in n} >= {_head_prefix(url)}


@pytest.mark.parametrize("applied", [True, False], ids=["write-landed", "write-refused"])
@pytest.mark.parametrize("first", [True, False], ids=["first-save", "re-save"])
def test_a_commit_whose_outcome_cannot_be_decided_keeps_every_object_and_says_how_to_check(s3, monkeypatch, applied,
                                                                                           first):
    from megashard.errors import CommitOutcomeUnknownError

    monkeypatch.setenv("MEGASHARD_S3_RETRIES", "1")
    url = s3.url(f"unknown-{applied}-{first}/iter_0000002")
    if not first:
        megashard.save(state(0), url)
    before = set(_objects(url))
    real = objck.ObjectSave.commit

    def commit(self, *a, **k):  # after planning read the old head
        s3.inject(503, count=2, method="PUT", match="iter_0000002/manifest.json", after=applied)
        s3.inject(503, count=100, method="GET", match="iter_0000002/manifest.json")  # the head cannot be read back
        s3.inject(503, count=100, method="HEAD", match="iter_0000002/manifest.json")
        return real(self, *a, **k)

    monkeypatch.setattr(objck.ObjectSave, "commit", commit)
    with pytest.raises(CommitOutcomeUnknownError, match=r"outcome .*unknown.*megashard verify " + url):
        megashard.save(state(1), url)
    s3.reset()
    after = set(_objects(url))
    new = {n for n in after - before if n.startswith(".megashard-save-")}
    assert before <= after and any(n.endswith(".tensors") for n in new)  # nothing deleted, this save's kept
    held = _assert_head_names_present_objects(url, {0: state(0), 1: state(1)})
    assert held == (1 if applied else (None if first else 0))


def test_a_commit_that_another_save_overtook_while_the_answer_was_lost_is_discarded(s3, monkeypatch):
    """The head PUT's answers are lost and meanwhile another save committed: read back, the head is the
    other save's, so this save lost for certain and removes only its own prefix."""
    monkeypatch.setenv("MEGASHARD_S3_RETRIES", "1")
    url = s3.url("overtaken/iter_0000002")
    megashard.save(state(0), url)
    real = objck.ObjectSave.commit

    def overtaken(self, *a, **k):
        monkeypatch.setattr(objck.ObjectSave, "commit", real)
        megashard.save(state(2), url)  # another save commits first ...
        s3.inject(503, count=2, method="PUT", match="iter_0000002/manifest.json")  # ... and our PUTs get 503
        return real(self, *a, **k)

    monkeypatch.setattr(objck.ObjectSave, "commit", overtaken)
    with pytest.raises(CommitConflictError, match="another save committed"):
        megashard.save(state(1), url)
    assert _assert_head_names_present_objects(url, {1: state(1), 2: state(2)}) == 2
    assert len({n.split("/", 1)[0] for n in _objects(url) if "/" in n}) == 1


# --------------------------------------------------------------------------- recover touches only megashard's uploads

def test_recover_aborts_only_uploads_of_dead_megashard_saves(s3):
    """Other clients' multipart uploads under the prefix survive ``megashard recover``; on a Megatron save
    root the age rule applies to each save prefix under iter_N, so a save still being written survives and
    only a dead one's upload is aborted. The server dates uploads truly, so "old" is ``--older-than 8`` and the
    dead save's upload is started 8 s before the young save's."""
    from megashard.cli import main as cli_main

    root = s3.url("mroot")
    store, key = ObjectStore.for_url(root)
    client = s3.boto3()
    # the young save stays young only while recover reaches it within age - 1 s (dates have whole seconds):
    # with 3 s, 2 s for a few dozen requests through the proxy and SeaweedFS, short on a loaded 2-core box
    age = 8.0

    def start(k):
        return client.create_multipart_upload(Bucket=s3.bucket, Key=f"{key}/{k}")["UploadId"]

    dead = start("iter_0000002/.megashard-save-dead/state-r00000.tensors")
    dead_started = time.time()
    megashard.save(state(0), root + "/iter_0000001")
    storage.write_tracker(root, 1)
    foreign = {start("iter_0000002/model.bin"), start("other-client/big.bin"), start("top.bin")}
    assert cli_main(["recover", "--older-than", str(age), root + "/iter_0000001"]) == 0
    time.sleep(max(0.0, dead_started + age + 1.2 - time.time()))  # upload dates have whole seconds
    store.put_bytes(f"{key}/iter_0000002/.megashard-save-young/state-r00000.tensors", b"written just now")
    young = start("iter_0000002/.megashard-save-young/state-r00001.tensors")
    # a save root: every iteration recovered, its dead saves cleaned
    assert cli_main(["recover", "--older-than", str(age), root]) == 0
    left = {u for _k, u, _t in store.list_uploads(key + "/")}
    assert left == foreign | {young}, (left, dead)
    # a checkpoint URL: another client's upload under it is not megashard's either
    url = root + "/iter_0000001"
    theirs = start("iter_0000001/their-upload.bin")
    assert objck.cleanup(url, older_than_s=0) == []
    assert theirs in {u for _k, u, _t in store.list_uploads(key + "/")}
    check_loaded(megashard.load(template(state(0)), url), state(0))


# --------------------------------------------------------------------------- a failed async save exits cleanly

_FAILING_ASYNC = textwrap.dedent("""
    import atexit, sys, threading
    # registered before megashard's exit hook, so it runs after it: which megashard threads are left?
    atexit.register(lambda: print("threads at exit:", sorted(t.name for t in threading.enumerate()
                                                             if t.name.startswith("megashard")), file=sys.stderr))
    import time, torch, megashard
    url, mode = sys.argv[1], sys.argv[2]
    save = megashard.save  # imports async_save first, as a plain script does
    if mode == "threads-start-late":  # the upload starts its threads only once the process exits
        from megashard.storage.s3 import client
        real = client._threads
        client._threads = lambda: (time.sleep(1.0), real())[1]
    g = torch.Generator().manual_seed(0)
    h = save({"w": torch.randn(64, 32, generator=g), "big": torch.randn(3 << 20, generator=g)}, url,
             async_save=True)
    try:
        h.result(timeout=None if mode == "fails" else 0.01)
    except megashard.MegashardError as e:
        print("error:", type(e).__name__, file=sys.stderr)
    sys.exit(3)
""")


@pytest.mark.parametrize("mode", ["fails", "times-out", "threads-start-late"])
def test_a_failed_async_s3_save_ends_the_process_with_its_own_error_status(s3, mode):
    """An async S3 save whose upload fails (or whose result() times out while it still retries) ends the
    process with the script's own status, never SIGABRT: no megashard thread is left running at interpreter
    teardown (a daemon thread inside a torch call then aborts: "terminate called without an active
    exception"). Repeated, in subprocesses. ``threads-start-late``: the upload starts the S3 client's threads
    only after the exit hooks began (a fresh-clone CI saw two such threads left: they were stopped before
    the background write that started them)."""
    env = dict(os.environ, MEGASHARD_S3_RETRIES="3", MEGASHARD_ASYNC_EXIT_WAIT="60")
    for i in range(4 if mode != "threads-start-late" else 2):
        url = s3.url(f"async-fail-{mode}/iter_{i:07d}")
        if mode == "fails":
            s3.inject(403, count=1, method="PUT", query="partNumber", match=f"iter_{i:07d}")
        else:
            s3.inject(503, count=10_000, method="PUT", query="partNumber", match=f"iter_{i:07d}")
        p = subprocess.run([sys.executable, "-c", _FAILING_ASYNC, url, mode], env=env, capture_output=True,
                           text=True, timeout=300)
        s3.reset()
        assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
        assert "terminate called" not in p.stderr and "error: Distributed" in p.stderr, p.stderr[-3000:]
        assert "threads at exit: []" in p.stderr, p.stderr[-3000:]
        assert storage.locate(url) is None


def _gets_meet_in_pairs(monkeypatch) -> list:
    """Every ranged GET waits (up to 20 s) until another one is in flight too: a load that sends its
    GETs one at a time fails (BrokenBarrierError) instead of finishing."""
    import threading

    from megashard.storage.s3 import client as objclient

    barrier = threading.Barrier(2, timeout=20)
    keys: list = []
    real = objclient.ObjectStore._get_range

    def get_range(self, key, *a, **kw):
        keys.append(key)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise AssertionError(f"ranged GET of {key} was alone in flight") from None
        return real(self, key, *a, **kw)

    monkeypatch.setattr(objclient.ObjectStore, "_get_range", get_range)
    return keys


def test_a_load_keeps_the_stores_connections_busy_not_the_cpu_count(s3, monkeypatch):
    """``threads=1`` (a CPU count of 1) still reads with the store's connections: the two GETs of
    the big tensor are in flight at once."""
    want = state(big=True)
    url = s3.url("run/iter_0000011")
    megashard.save(want, url)
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(7 * MiB))  # the ~12 MiB tensor: two GETs
    monkeypatch.setenv("MEGASHARD_S3_CONNECTIONS", "4")
    keys = _gets_meet_in_pairs(monkeypatch)
    got = megashard.load(template(want), url, threads=1)
    check_loaded(got, want)
    assert len(keys) == 2


def test_files_of_one_load_are_read_at_once(s3, monkeypatch):
    """Two objects' GETs share one queue: the second file's GET is in flight with the first's."""
    store, _ = ObjectStore.for_url(s3.url())
    a, b = os.urandom(3 * MiB), os.urandom(2 * MiB)
    ea, eb = store.put_bytes("x/a", a), store.put_bytes("x/b", b)
    keys = _gets_meet_in_pairs(monkeypatch)
    got_a, got_b = bytearray(len(a)), bytearray(len(b))
    n = store.read_many([("x/a", [(0, memoryview(got_a))], len(a), ea), ("x/b", [(0, memoryview(got_b))], len(b), eb)],
                        threads=2)
    assert (n, bytes(got_a), bytes(got_b)) == (len(a) + len(b), a, b)
    assert sorted(keys) == ["x/a", "x/b"]


def test_a_save_sends_parts_while_the_tensors_are_still_hashed(s3, monkeypatch):
    """No tensor is hashed until a part has gone out (a save that hashed first would fail after 20 s),
    and the load with ``verify=True`` checks every tensor's CRC32 and SHA-256 (byte identity with a
    file-system save: test_save_load_bit_exact_and_objects_identical_to_a_posix_save)."""
    import threading

    from megashard.format import writer
    from megashard.storage.s3 import client as objclient

    sent = threading.Event()
    real_hash, real_put = writer._hash_item, objclient.ObjectStore._put_views

    def hash_item(it):
        if not sent.wait(20):
            raise AssertionError(f"tensor {it.name} was to be hashed before any part was sent")
        real_hash(it)

    def put_views(self, kind, *a, **kw):
        out = real_put(self, kind, *a, **kw)
        if kind == "MPU_PART":
            sent.set()
        return out

    monkeypatch.setattr(writer, "_hash_item", hash_item)
    monkeypatch.setattr(objclient.ObjectStore, "_put_views", put_views)
    want = state(big=True)
    url = s3.url("run/iter_0000012")
    megashard.save(want, url)
    monkeypatch.setattr(writer, "_hash_item", real_hash)
    got = megashard.load(template(want), url, verify=True)  # every tensor's hashes checked
    check_loaded(got, want)


def _load_replicated_scatter(rank, world, url, n):
    from megashard.storage.s3.client import ObjectStore

    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    dest = {"w": torch.empty(n)}
    _, stats = megashard.load(dest, url, mode="scatter", scatter_chunk_bytes=MiB, scatter_transport="shm",
                              return_stats=True)
    want = torch.randn(n, generator=torch.Generator().manual_seed(5))
    return {"ok": bool(torch.equal(dest["w"], want)), "stats": dict(store.stats), "transport": stats.transport}


def test_scatter_ring_extents_are_read_in_coalesced_gets(s3):
    """Both ranks need the whole 4 MiB tensor: it crosses the node's ring in four 1 MiB extents, which
    the reader fetches in one ranged GET (not one per extent); bit-exact on both ranks."""
    n = MiB  # fp32: 4 MiB
    url = s3.url("ring/iter_0000001")
    megashard.save({"w": torch.randn(n, generator=torch.Generator().manual_seed(5))}, url)
    out = all_ok(run_ranks(_load_replicated_scatter, 2, url, n, env={"MEGASHARD_NODE_ID": "node0"}))
    assert [o["ok"] for o in out] == [True, True]
    assert out[0]["transport"] == "shm"
    assert out[0]["stats"].get("GET_RANGE", 0) == 1, out[0]["stats"]
    assert sum(out[1]["stats"].values()) == 0


def _load_halves_scatter(rank, world, url, rows, cols, dim, transport="shm"):
    from megashard.sharded import ShardedTensor
    from megashard.storage.s3.client import ObjectStore

    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6))
    want = full.chunk(world, dim)[rank].contiguous()
    dest = torch.zeros_like(want)
    _, stats = megashard.load({"w": ShardedTensor.from_rank_offsets("w", dest, (dim, rank, world))}, url,
                              mode="scatter", scatter_chunk_bytes=MiB, scatter_transport=transport,
                              return_stats=True)
    return {"ok": bool(torch.equal(dest, want)), "stats": dict(store.stats), "transport": stats.transport,
            "read": stats.bytes_read, "received": stats.bytes_received, "nbytes": want.numel() * 4}


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_from_s3_each_rank_gets_the_bytes_only_it_needs_itself(s3, dim):
    """Row halves of an 8 MiB tensor: every byte is needed by one rank only, so each rank GETs its own
    half itself (an object store needs no descriptor for that) and nothing crosses the node's ring:
    scatter costs what ``own`` does. Column halves: a rank's 8 KiB row pieces lie between the other
    rank's, and GETs of one rank's pieces would fetch the other's too; they go through the ring,
    read once by the reader. The other rank never fetches the head or the index (its reader sends
    it); bit-exact on both ranks, each byte from the store once."""
    rows, cols = 512, 4096  # fp32: 8 MiB, half a row 8 KiB
    url = s3.url(f"halves{dim}/iter_0000001")
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6))
    megashard.save({"w": ShardedTensor.from_rank_offsets("w", full)}, url)
    out = all_ok(run_ranks(_load_halves_scatter, 2, url, rows, cols, dim, env={"MEGASHARD_NODE_ID": "node0"}))
    assert [o["ok"] for o in out] == [True, True]
    assert [o["transport"] for o in out] == ["shm", "shm"]
    reader, other = out
    assert other["stats"].get("GET", 0) == 0 and other["stats"].get("HEAD", 0) == 0, other["stats"]
    assert reader["stats"].get("GET", 0) == 3, reader["stats"]  # head, digest, the whole index: once for the node
    if dim == 0:
        assert [o["read"] for o in out] == [o["nbytes"] for o in out]  # each rank its own half, from the store
        assert [o["received"] for o in out] == [0, 0]
        assert other["stats"].get("GET_RANGE", 0) >= 1
    else:
        assert reader["read"] == 2 * reader["nbytes"] and other["read"] == 0  # every byte once, by the reader
        assert other["received"] >= other["nbytes"]  # the span of its rows, through the ring
        assert sum(other["stats"].values()) == 0, other["stats"]


def test_scatter_rank_that_cannot_reach_the_store_fails_every_rank_and_group_needs_no_access(s3):
    """Rank 1 cannot reach the object store (its endpoint is a closed port): with shared memory it
    would GET its own half itself, so the load fails on every rank, the message naming rank 1 and
    ``scatter_transport='group'``; with that transport rank 1 sends no request and loads bit-exact."""
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sk.getsockname()[1]}"
    rows, cols = 512, 4096
    url = s3.url("unreachable/iter_0000001")
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6))
    megashard.save({"w": ShardedTensor.from_rank_offsets("w", full)}, url)
    env = {"0": {"MEGASHARD_NODE_ID": "node0"},
           "1": {"MEGASHARD_NODE_ID": "node0", "AWS_ENDPOINT_URL": dead, "AWS_ENDPOINT_URL_S3": dead,
                 "MEGASHARD_S3_RETRIES": "0"}}
    out = run_ranks(_load_halves_scatter, 2, url, rows, cols, 0, env=env)
    for ok, msg in out:
        assert not ok
        assert "rank(s) 1" in msg and "scatter_transport='group'" in msg, msg
    out = all_ok(run_ranks(_load_halves_scatter, 2, url, rows, cols, 0, "group", env=env))
    assert [o["ok"] for o in out] == [True, True]
    assert out[1]["read"] == 0 and out[1]["received"] == out[1]["nbytes"]


def test_a_load_checks_each_tensors_crc32_while_later_bytes_still_download(s3, monkeypatch):
    """On one connection, GETs of 5 MiB: the small tensors' CRC32s are final (computed by the GETs
    as their bytes landed, handed over with the read) before the last GET of the ~12 MiB tensor has
    even been sent; no tensor's bytes are read again for it (``_Crc.compute`` never runs); the load
    is bit-exact and every tensor's CRC32 is checked exactly once."""
    from megashard import loading
    from megashard.storage.s3 import client as objclient

    want = state(big=True)
    url = s3.url("run/iter_0000012")
    megashard.save(want, url)
    monkeypatch.setenv("MEGASHARD_S3_GET_BYTES", str(5 * MiB))
    monkeypatch.setenv("MEGASHARD_S3_CONNECTIONS", "1")
    gets: list = []
    real_get = objclient.ObjectStore._get_range

    def get_range(self, key, url_, first, end, *a, **kw):
        n = real_get(self, key, url_, first, end, *a, **kw)
        gets.append(end)
        return n

    checked: list = []  # (tensor name, GETs finished by then)
    real_arrived = loading._LoadWork.arrived

    def arrived(self, read, crc=None):
        c = self.by_read.get(id(read))
        if c is not None:
            assert crc is not None, c.name
            checked.append((c.name.rsplit("/", 1)[-1], len(gets)))  # "__rank0__/w": rank-local tensor w
        return real_arrived(self, read, crc)

    computed: list = []
    real_compute = loading._Crc.compute
    monkeypatch.setattr(loading._Crc, "compute", lambda self, data=None: computed.append(self.name) or
                        real_compute(self, data))
    monkeypatch.setattr(objclient.ObjectStore, "_get_range", get_range)
    monkeypatch.setattr(loading._LoadWork, "arrived", arrived)
    got, stats = megashard.load(template(want), url, return_stats=True)
    check_loaded(got, want)
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert sorted(n for n, _ in checked) == sorted(tensors)  # once each
    assert computed == []
    assert stats.crc_checked == sum(v.numel() * v.element_size() for v in want.values() if isinstance(v, torch.Tensor))
    assert len(gets) >= 3
    early = [n for n, k in checked if k < len(gets)]
    assert set(early) >= {"w", "b", "steps"}, (checked, len(gets))


def test_the_digest_and_the_index_are_fetched_at_once(s3, monkeypatch):
    """After the head, a load's digest GET and index GET are in flight together (one round trip,
    not two), and from one thread: both requests are sent before either answer is read (no other
    thread to wake, which a loaded machine may start milliseconds late); the load is bit-exact
    with GET 3 as before, and a damaged digest is still reported before anything about the index."""
    import http.client
    import threading

    want = state()
    url = s3.url("run/iter_0000013")
    megashard.save(want, url)
    events: list = []
    real_end, real_resp = http.client.HTTPConnection.endheaders, http.client.HTTPConnection.getresponse
    targets: dict = {}

    def endheaders(self, *a, **kw):
        name = (self._buffer[0].split(b" ")[1].split(b"?")[0].rsplit(b"/", 1)[-1].decode()
                if self._buffer else "?")
        targets[id(self)] = name
        events.append(("send", name, threading.get_ident()))
        return real_end(self, *a, **kw)

    def getresponse(self):
        events.append(("answer", targets.get(id(self)), threading.get_ident()))
        return real_resp(self)

    monkeypatch.setattr(http.client.HTTPConnection, "endheaders", endheaders)
    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", getresponse)
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    got = megashard.load(template(want), url)
    monkeypatch.setattr(http.client.HTTPConnection, "endheaders", real_end)
    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", real_resp)
    check_loaded(got, want)
    assert store.stats["GET"] == 3, dict(store.stats)
    mine = [e for e in events if e[1] in ("manifest.sha256", "manifest.index")]
    assert [e[:2] for e in mine] == [("send", "manifest.sha256"), ("send", "manifest.index"),
                                     ("answer", "manifest.sha256"), ("answer", "manifest.index")], events
    assert len({e[2] for e in mine}) == 1
    store.put_bytes(f"{url[len('s3://' + s3.bucket + '/'):]}/{_digest_key(url)}", b"0" * 64 + b"\n")
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        megashard.load(template(want), url)


def _digest_key(url: str) -> str:
    return next(n for n in _objects(url) if n.endswith("/manifest.sha256"))


def _many(n: int = 1500) -> dict:
    g = torch.Generator().manual_seed(11)
    return {f"t{i:04d}": torch.randn(8, 4, generator=g) for i in range(n)}


def test_a_load_reads_only_the_index_blocks_holding_its_sections(s3, monkeypatch):
    """A large index (here: above an 8 KiB MEGASHARD_S3_INDEX_WHOLE_BYTES, 1 KiB blocks) is not
    fetched whole: beside the digest only its last block (its Content-Range: the real size, before
    any buffer), then ranged GETs pinned to the head's index ETag of the blocks holding the sections this load
    reads: a few keys' load fetches a small share of it, bit-exact; a load of every key
    reads it all, each byte once, neighbouring blocks in one GET, bit-exact."""
    from megashard.sharded import ShardedTensor

    want = _many()
    url = s3.url("big/iter_0000001")
    megashard.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in want.items()}, url)
    store, key = ObjectStore.for_url(url)
    head = json.loads(store.get_bytes(f"{key}/manifest.json", 1 << 20)[0])
    size, etag = head["index"]["bytes"], head["index"]["etag"]
    assert size > 48 << 10, size  # many blocks
    monkeypatch.setenv("MEGASHARD_S3_INDEX_WHOLE_BYTES", str(8 << 10))
    monkeypatch.setenv("MEGASHARD_S3_INDEX_BLOCK_BYTES", "1024")
    some = {k: want[k] for k in ("t0007", "t0300")}

    def index_requests():
        return [r for r in s3.requests() if r["key"].endswith("/manifest.index")]

    def sharded(s):
        return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in s.items()}

    def load(s):
        got = sharded(s)
        megashard.load(got, url)
        return {k: v.data for k, v in got.items()}

    from megashard import index as index_mod

    sections = []  # (start, length) of every section the load reads
    real_read = index_mod._IndexFile.read

    def read(self, start, length):
        sections.append((start, length))
        return real_read(self, start, length)

    monkeypatch.setattr(index_mod._IndexFile, "read", read)
    s3.reset()
    check_loaded(load(some), some)
    idx = index_requests()
    assert not [r for r in idx if not r["range"]], idx  # never the whole object (nor a HEAD: the last block's GET checks)
    ranged = [r for r in idx if r["range"]]
    assert ranged and all(r["method"] == "GET" and r["if_match"] == etag and r["status"] == 206 for r in ranged)
    spans = [tuple(int(x) for x in r["range"].split("=")[1].split("-")) for r in ranged]
    fetched = sum(b - a + 1 for a, b in spans)
    assert fetched < size // 2, (fetched, size, spans)  # its tree (every key's part: one rank saved all) and 2 keys'
    assert all(a % 1024 == 0 for a, _ in spans) and len(ranged) <= 16, spans
    spans.sort()
    assert all(b < c for (_, b), (c, _) in zip(spans, spans[1:])), spans  # no byte fetched twice
    # the blocks fetched are those holding its sections (and the last), but for read-ahead of a few
    touched = {b for a, n in sections for b in range(a // 1024, (a + n - 1) // 1024 + 1)} | {(size - 1) // 1024}
    got = {b for a, e in spans for b in range(a // 1024, e // 1024 + 1)}
    assert touched <= got and len(got - touched) <= len(touched) // 4, (sorted(got - touched), len(touched))
    others = [r for r in s3.requests() if r["method"] == "GET" and not r["key"].endswith("/manifest.index")
              and not r["range"]]
    assert sorted(r["key"].rsplit("/", 1)[-1] for r in others) == ["manifest.json", "manifest.sha256"]

    s3.reset()
    check_loaded(load(want), want)  # every key: every block
    ranged = [r for r in index_requests() if r["range"]]
    spans = sorted(tuple(int(x) for x in r["range"].split("=")[1].split("-")) for r in ranged)
    assert len(ranged) < size // 1024 // 1.5, len(ranged)  # fewer GETs than blocks: neighbours share them
    assert all(b < c for (_, b), (c, _) in zip(spans, spans[1:])), spans

    monkeypatch.delenv("MEGASHARD_S3_INDEX_WHOLE_BYTES")  # default 4 MiB: small, fetched whole with the digest
    s3.reset()
    check_loaded(load(some), some)
    assert [(r["method"], r["range"]) for r in index_requests()] == [("GET", None)]


def test_index_blocks_give_the_bytes_asked_for_and_refuse_ranges_past_the_end():
    """:class:`IndexBlocks` against plain bytes: random reads are the bytes at their offsets,
    each block fetched once (while cached), a range past the claimed size refused before any fetch."""
    import random

    data = bytes(random.Random(5).randbytes(100_003))
    fetches = []

    def fetch(reqs):
        fetches.append([(o, len(v)) for o, v in reqs])
        for o, v in reqs:
            v[:] = data[o:o + len(v)]

    blocks = objck.IndexBlocks(len(data), fetch, "s3://b/k/manifest.index", block=4096, ahead_bytes=0)
    rnd = random.Random(6)
    for _ in range(300):
        a = rnd.randrange(len(data))
        n = rnd.randrange(min(9000, len(data) - a) + 1)
        out = bytearray(n)
        assert blocks.read_into([(a, memoryview(out))]) == n
        assert bytes(out) == data[a:a + n]
    fetched = [o for f in fetches for o, _ in f]
    assert len(fetched) == len(set(fetched)) <= -(-len(data) // 4096)
    n = len(fetches)
    with pytest.raises(CheckpointError, match="past its end"):
        blocks.read_into([(len(data) - 10, memoryview(bytearray(11)))])
    assert len(fetches) == n
    # a scan reads ahead: 25 blocks in far fewer fetches
    scan = objck.IndexBlocks(len(data), fetch, "x", block=4096, ahead_bytes=64 << 10)
    fetches.clear()
    for a in range(0, len(data), 1000):
        out = bytearray(min(1000, len(data) - a))
        scan.read_into([(a, memoryview(out))])
        assert bytes(out) == data[a:a + len(out)]
    assert len(fetches) <= 6, fetches


def test_a_file_in_one_put_is_sent_while_its_tensors_are_still_hashed(s3, monkeypatch):
    """A file small enough for one PUT (most ranks' files at scale) starts its body before any tensor is
    hashed: each tensor header waits for its own hashes on the open request, nothing waits for the whole
    file (a save that hashed first would fail after 20 s); the load with ``verify=True`` checks every
    tensor's CRC32 and SHA-256."""
    import http.client
    import threading

    from megashard.format import writer
    from megashard.format.layout import MAGIC

    monkeypatch.setenv("MEGASHARD_S3_PART_BYTES", str(64 * MiB))  # ~12 MiB: one PUT
    sent = threading.Event()
    real_hash, real_send = writer._hash_item, http.client.HTTPConnection.send

    def hash_item(it):
        if not sent.wait(20):
            raise AssertionError(f"tensor {it.name} was to be hashed before the file's first bytes were sent")
        real_hash(it)

    def send(self, data):
        if bytes(memoryview(data)[:len(MAGIC)]) == MAGIC:  # the prologue: the body has begun
            sent.set()
        return real_send(self, data)

    monkeypatch.setattr(writer, "_hash_item", hash_item)
    monkeypatch.setattr(http.client.HTTPConnection, "send", send)
    want = state(big=True)
    url = s3.url("run/iter_0000013")
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    megashard.save(want, url)
    assert store.stats["MPU_PART"] == 0  # the .tensors file went up in one PUT
    monkeypatch.setattr(writer, "_hash_item", real_hash)
    got = megashard.load(template(want), url, verify=True)
    check_loaded(got, want)


def test_shards_read_into_the_templates_tensors_need_no_head_first(s3):
    """A load whose shards all go straight into the template's own tensors allocates nothing from the
    index's claims, so it sends no HEAD before its GETs (each ranged GET checks the object's size,
    Content-Range, and version, If-Match, before a byte of it lands): GET 3 (head, digest, index) and
    the ranged GETs. A shard the load must allocate (a template without data) still has its object's
    size and ETag checked first (one HEAD). An object replaced by one of another size after the commit
    still fails the load naming it, and bytes of the replacement never reach the template."""
    from megashard.sharded import ShardedTensor

    g = torch.Generator().manual_seed(5)
    want = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16)}
    url = s3.url("nohead/iter_0000001")
    megashard.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in want.items()}, url)
    store, _ = ObjectStore.for_url(url)
    store.stats.clear()
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    megashard.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in dest.items()}, url, mode="own")
    for k in want:
        assert_same(dest[k], want[k])
    assert store.stats.get("HEAD", 0) == 0 and store.stats["GET"] == 3 and store.stats["GET_RANGE"] >= 1, \
        dict(store.stats)
    store.stats.clear()
    got = megashard.load({"a": ShardedTensor("a", None, (64, 32), (0, 0), local_shape=(64, 32), dtype=torch.float32)},
                         url, mode="own")
    assert_same(got["a"], want["a"])
    assert store.stats["HEAD"] == 1, dict(store.stats)
    name, data = next(iter(_data_names(url).items()))
    key = next(o.key for n, o in _objects(url).items() if n.endswith("/" + name))
    store.put_bytes(key, data + b"\0" * 4096)  # another size (and ETag)
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    with pytest.raises(CheckpointError, match=name):
        megashard.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in dest.items()}, url, mode="own")
    assert all(not t.any() for t in dest.values())
