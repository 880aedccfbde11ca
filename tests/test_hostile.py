"""Checkpoints from anywhere: tampering never runs code, never reads outside the directory,
never over-allocates, and always ends in a MegashardError; every flipped bit is caught."""
from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import sys

import pytest
import torch

import megashard
from megashard import storage
from megashard.checkpoint_tools import verify_checkpoint
from megashard.cli import main as cli_main
from megashard.errors import CheckpointError, MegashardError
from megashard.sharded import ShardedTensor
from tamper import read_manifest_doc, write_manifest_doc, write_manifest_text

SECRET = b"host secret: must never be loaded\n" * 4000  # > 64 KiB, so a bytes ref points into a file
SPY = "megashard_test_import_spy"


def _save(path: str, sha256: bool = True) -> None:
    g = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    megashard.save({
        "w0": ShardedTensor("w", g[:4].clone(), (8, 8), (0, 0)),
        "w1": ShardedTensor("w", g[4:].clone(), (8, 8), (4, 0)),
        "local": torch.arange(5, dtype=torch.int64),
        "blob": b"x" * 70_000,
        "args": {"lr": 0.1, "iteration": 7},
    }, path, sha256=sha256)


def _template() -> dict:
    return {"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0)), "local": torch.zeros(5, dtype=torch.int64),
            "blob": b"", "args": {}}


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    return path


def _shard_file(path: str) -> str:
    return next(f for f in sorted(os.listdir(path)) if f.endswith(".tensors"))


def _edit(path, fn):
    doc = read_manifest_doc(path)
    fn(doc)
    write_manifest_doc(path, doc)


def _first_shard(doc):
    return doc["tensors"]["w"]["shards"][0]


def _ref(doc, key):
    tree = next(iter(doc["trees"].values()))
    return tree[key]["ref"]


# each attack edits a valid checkpoint in place; all must fail with MegashardError on load
def _enum_spy(path):
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(
        mode={"__ms__": "enum", "module": SPY, "qualname": "E", "name": "A"}))


def _enum_this(path):
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(
        mode={"__ms__": "enum", "module": "this", "qualname": "E", "name": "A"}))


def _enum_systemexit(path):
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(
        mode={"__ms__": "enum", "module": "unittest.__main__", "qualname": "E", "name": "A"}))


def _symlinked_shard(path):
    f = _shard_file(path)
    target = os.path.join(os.path.dirname(path), "outside.tensors")
    os.rename(os.path.join(path, f), target)
    os.symlink(target, os.path.join(path, f))


def _symlinked_bytes_file(path):
    """A 'shard' that is a link to a host file; a bytes ref pointing into it."""
    secret = os.path.join(os.path.dirname(path), "secret.txt")
    with open(secret, "wb") as fh:
        fh.write(SECRET)
    os.symlink(secret, os.path.join(path, "evil.tensors"))

    def fn(d):
        d["files"]["evil.tensors"] = {"rank": 0, "bytes": len(SECRET), "tensors": 1}
        _ref(d, "blob").update(file="evil.tensors", data_offset=0, nbytes=70_000, shape=[70_000])
    _edit(path, fn)


def _dotdot_name(path):
    def fn(d):
        f = _first_shard(d)["file"]
        d["files"]["../" + f] = d["files"].pop(f)
        for s in d["tensors"]["w"]["shards"]:
            s["file"] = "../" + f
    _edit(path, fn)


def _absolute_name(path):
    def fn(d):
        d["files"]["/etc/passwd"] = {"rank": 0, "bytes": 10, "tensors": 1}
        _ref(d, "local").update(file="/etc/passwd")
    _edit(path, fn)


def _huge_shape(path):
    _edit(path, lambda d: _ref(d, "local").update(shape=[1 << 40, 1 << 20]))


def _huge_global_shape(path):
    def fn(d):
        d["tensors"]["w"]["shape"] = [1 << 50, 8]
    _edit(path, fn)


def _negative_shape(path):
    _edit(path, lambda d: _ref(d, "local").update(shape=[-5]))


def _negative_offset(path):
    _edit(path, lambda d: _first_shard(d).update(data_offset=-4096))


def _offset_past_eof(path):
    _edit(path, lambda d: _first_shard(d).update(data_offset=1 << 40))


def _chunk_outside_global(path):
    _edit(path, lambda d: _first_shard(d).update(offset=[6, 0]))


def _unknown_dtype(path):
    _edit(path, lambda d: d["tensors"]["w"].update(dtype="float128"))


def _truncated_file(path):
    f = os.path.join(path, _shard_file(path))
    os.truncate(f, os.path.getsize(f) - 100)


def _garbage_manifest(path):
    write_manifest_text(path, b"\x00\xff garbage {{{")


def _truncated_manifest(path):
    with open(os.path.join(path, "manifest.json"), "rb") as fh:
        data = fh.read()
    write_manifest_text(path, data[: len(data) // 2])


def _deep_manifest(path):
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(deep=json.loads("[" * 900 + "]" * 900)))


def _deep_manifest_unparseable(path):
    doc = read_manifest_doc(path)
    text = json.dumps(doc)[:-1] + ',"deep":' + "[" * 200_000 + "]" * 200_000 + "}"
    write_manifest_text(path, text)


def _oversized_manifest(path):
    doc = read_manifest_doc(path)
    doc["extra"]["pad"] = "x" * 2_000_000
    write_manifest_doc(path, doc)
    os.environ["MEGASHARD_MAX_MANIFEST_BYTES"] = "1000000"


def _wrong_json_types(path):
    def fn(d):
        d["tensors"]["w"]["shards"] = {"not": "a list"}
        d["files"] = [1, 2]
    _edit(path, fn)


def _huge_integer(path):
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(
        big={"__ms__": "int", "hex": "f" * 5_000_000}))


def _huge_plain_integer(path):
    doc = json.dumps(read_manifest_doc(path))
    write_manifest_text(path, doc.replace('"iteration": 7', '"iteration": ' + "9" * 100_000))


def _fifo_shard(path):
    f = os.path.join(path, _shard_file(path))
    os.unlink(f)
    os.mkfifo(f)


def _shard_replaced_by_dir(path):
    f = os.path.join(path, _shard_file(path))
    os.unlink(f)
    os.mkdir(f)


def _manifest_symlink(path):
    real = os.path.join(os.path.dirname(path), "real-manifest.json")
    os.rename(os.path.join(path, "manifest.json"), real)
    os.symlink(real, os.path.join(path, "manifest.json"))


ATTACKS = [_enum_spy, _enum_this, _enum_systemexit, _symlinked_shard, _symlinked_bytes_file, _dotdot_name,
           _absolute_name, _huge_shape, _huge_global_shape, _negative_shape, _negative_offset, _offset_past_eof,
           _chunk_outside_global, _unknown_dtype, _truncated_file, _garbage_manifest, _truncated_manifest,
           _deep_manifest, _deep_manifest_unparseable, _oversized_manifest, _wrong_json_types, _huge_integer,
           _huge_plain_integer, _fifo_shard, _shard_replaced_by_dir, _manifest_symlink]
# attacks whose target is a value load_common decodes; the others must still never import/crash there
ENUM_ATTACKS = {_enum_spy, _enum_this, _enum_systemexit}


@pytest.fixture
def spy(monkeypatch, tmp_path):
    """A module of our own that records being imported."""
    mod_dir = tmp_path / "spy"
    mod_dir.mkdir()
    marker = tmp_path / "imported"
    (mod_dir / f"{SPY}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    monkeypatch.delenv("MEGASHARD_MAX_MANIFEST_BYTES", raising=False)
    yield marker
    os.environ.pop("MEGASHARD_MAX_MANIFEST_BYTES", None)
    sys.modules.pop(SPY, None)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__.strip("_"))
def test_hostile_checkpoint(attack, ckpt, spy, capsys):
    modules = set(sys.modules)
    attack(ckpt)
    before = _listing(os.path.dirname(ckpt))
    rss0 = _peak_rss_mb()
    outcomes = {}
    for name, call in [("load", lambda: megashard.load(_template(), ckpt, verify=False)),
                       ("load_strict_verify", lambda: megashard.load(_template(), ckpt, verify=True)),
                       ("load_common", lambda: megashard.load_common(ckpt, ["args"], strict=True)),
                       ("verify", lambda: verify_checkpoint(ckpt) or None)]:
        try:
            res = call()
        except MegashardError as e:
            outcomes[name] = e
        else:
            outcomes[name] = res
    # verify never passes a tampered checkpoint; load raises unless the attack is outside what it reads
    assert isinstance(outcomes["verify"], (list, MegashardError)) and outcomes["verify"], outcomes
    assert isinstance(outcomes["load"], MegashardError) or attack in ENUM_ATTACKS, outcomes
    assert isinstance(outcomes["load_strict_verify"], MegashardError), outcomes
    if attack in ENUM_ATTACKS:
        assert isinstance(outcomes["load_common"], CheckpointError), outcomes
        # non-strict: a placeholder, never the module's enum
        mode = megashard.load_common(ckpt, ["args"])["args"]["mode"]
        assert type(mode).__name__ == "UnregisteredEnum"
    assert cli_main(["verify", ckpt]) != 0
    capsys.readouterr()
    # nothing imported, nothing outside the directory leaked into loaded state, nothing changed on disk
    assert not spy.exists()
    assert "this" not in set(sys.modules) - modules
    assert _listing(os.path.dirname(ckpt)) == before
    for v in outcomes.values():
        if isinstance(v, dict):
            assert SECRET[:40] not in (v.get("blob") or b"")
    assert _peak_rss_mb() - rss0 < 200, "memory grew although the files are tiny"


def _listing(root: str) -> dict:
    """Every entry under ``root`` with its type, size, mtime and content hash."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            h = ""
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    h = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, h)
    return out


def test_read_paths_change_nothing(tmp_path, capsys):
    """load/load_common/verify/inspect leave the tree byte-for-byte unchanged, even with an
    interrupted re-save's .old copy around; `megashard recover` is what restores it."""
    path = str(tmp_path / "ckpt")
    _save(path)
    _save(path + "2")
    os.rename(path, str(tmp_path / ".ckpt.old-abc123"))  # a re-save crashed mid-commit
    os.rename(path + "2", path)
    os.rename(path, str(tmp_path / ".ckpt.old-def456"))
    before = _listing(str(tmp_path))
    out = megashard.load(_template(), path)
    assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert megashard.load_common(path, ["args"])["args"]["iteration"] == 7
    assert verify_checkpoint(path) == []
    assert cli_main(["inspect", path]) == 0
    assert cli_main(["verify", path]) == 0
    capsys.readouterr()
    assert _listing(str(tmp_path)) == before
    assert cli_main(["recover", path]) == 0
    assert storage.is_checkpoint(path) and not [n for n in os.listdir(tmp_path) if ".old-" in n]


def _flip_targets(path: str) -> list:
    files = sorted(os.listdir(path))
    return [(f, os.path.getsize(os.path.join(path, f))) for f in files]


@pytest.mark.parametrize("sha256", [True, False], ids=["crc32+sha256", "crc32-only"])
def test_bit_flip_campaign(tmp_path, sha256):
    """Random single-bit flips over every file (structure, padding, data, manifest and its
    digest): verify fails and load(verify=True) raises for every one; with CRC32-only tensor
    headers (``sha256=False``) too: the CRC32 covers each header but its own value, and a flip
    in that value mismatches."""
    path = str(tmp_path / "ckpt")
    _save(path, sha256)
    pristine = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    rng = random.Random(1234)
    n = int(os.environ.get("MEGASHARD_BITFLIPS", "240"))
    caught = 0
    regions: dict = {}
    targets = _flip_targets(path)
    for i in range(n):
        f, size = targets[i % len(targets)]
        pos, bit = rng.randrange(size), rng.randrange(8)
        data = bytearray(pristine[f])
        data[pos] ^= 1 << bit
        with open(os.path.join(path, f), "wb") as fh:
            fh.write(data)
        problems = verify_checkpoint(path)
        try:
            megashard.load(_template(), path, verify=True)
            loaded = True
        except MegashardError:
            loaded = False
        assert problems, f"flip {f}@{pos} bit {bit} passed verify"
        assert not loaded, f"flip {f}@{pos} bit {bit} passed load(verify=True)"
        caught += 1
        regions[f] = regions.get(f, 0) + 1
        with open(os.path.join(path, f), "wb") as fh:
            fh.write(pristine[f])
    assert caught == n
    assert verify_checkpoint(path) == []
    print(f"bit flips caught: {caught}/{n} over {regions}")


def test_bit_flip_every_bit_of_manifest_sha256(tmp_path):
    """Exhaustive over the 520 bits of the digest file (the random campaign rarely hits its
    newline, whose flip to \\v a lenient parser accepted); scripts/bitflip_campaign.py runs it too."""
    path = str(tmp_path / "ckpt")
    _save(path)
    f = os.path.join(path, storage.MANIFEST_DIGEST_NAME)
    pristine = open(f, "rb").read()
    missed = []
    for pos in range(len(pristine)):
        for bit in range(8):
            data = bytearray(pristine)
            data[pos] ^= 1 << bit
            with open(f, "wb") as fh:
                fh.write(data)
            try:  # what verify and every load read first
                with storage.CheckpointFiles(path) as cf:
                    cf.read_manifest_bytes()
                missed.append((pos, bit))
            except CheckpointError:
                pass
            if pos == len(pristine) - 1:  # the newline: the whole verify too
                assert verify_checkpoint(path), f"newline bit {bit} flipped passed verify"
    with open(f, "wb") as fh:
        fh.write(pristine)
    assert not missed, missed
    assert verify_checkpoint(path) == []


def test_unregistered_enum_in_unrequested_key_never_decoded(tmp_path, spy):
    """load decodes only what the template asks for: an enum tag in another key is ignored."""
    path = str(tmp_path / "ckpt")
    _save(path)
    _edit(path, lambda d: next(iter(d["trees"].values())).update(
        other={"__ms__": "enum", "module": SPY, "qualname": "E", "name": "A"}))
    out = megashard.load({"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0))}, path)
    assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert megashard.load_common(path, ["args"])["args"]["iteration"] == 7
    assert not spy.exists()


def _scatter_flips(rank, world, path, flips, transport):
    """Two pipeline stages on one node (rank 0 reads for both): every flip anywhere in the
    checkpoint makes load(verify=True) raise on both ranks."""
    import torch.distributed as dist

    rng = random.Random(99)
    files = sorted(f for f in os.listdir(path))
    pristine = {f: open(os.path.join(path, f), "rb").read() for f in files}
    dist.barrier()  # every rank holds the pristine bytes before rank 0 flips any
    caught = []
    for i in range(flips):
        f = files[i % len(files)]
        pos, bit = rng.randrange(len(pristine[f])), rng.randrange(8)
        if rank == 0:
            data = bytearray(pristine[f])
            data[pos] ^= 1 << bit
            with open(os.path.join(path, f), "wb") as fh:
                fh.write(data)
        dist.barrier()
        key = "stage0" if rank == 0 else "stage1"
        t = {key: ShardedTensor(key, torch.zeros(256, 64), (256, 64), (0, 0))}
        try:
            megashard.load(t, path, mode="scatter", verify=True, scatter_transport=transport)
            caught.append(False)
        except MegashardError:
            caught.append(True)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(path, f), "wb") as fh:
                fh.write(pristine[f])
        dist.barrier()
    t = {key: ShardedTensor(key, torch.zeros(256, 64), (256, 64), (0, 0))}
    out = megashard.load(t, path, mode="scatter", verify=True, scatter_transport=transport)
    return caught, bool(torch.equal(out[key], torch.full((256, 64), float(rank))))


def _save_two_stages(rank, world, path):
    key = f"stage{rank}"
    megashard.save({key: ShardedTensor(key, torch.full((256, 64), float(rank)), (256, 64), (0, 0))}, path)


def test_bit_flips_caught_in_scatter_mode(tmp_path):
    from distributed import all_ok, run_ranks

    path = str(tmp_path / "ckpt")
    all_ok(run_ranks(_save_two_stages, 2, path))
    n = int(os.environ.get("MEGASHARD_SCATTER_BITFLIPS", "24"))
    for transport in ("shm", "group"):
        res = all_ok(run_ranks(_scatter_flips, 2, path, n, transport, timeout=300))
        for rank, (caught, intact) in enumerate(res):
            assert intact, f"rank {rank}: pristine checkpoint did not load back ({transport})"
            missed = [i for i, c in enumerate(caught) if not c]
            assert not missed, f"rank {rank} ({transport}): flips {missed} not caught"


def test_load_common_skips_tensor_only_subtrees(ckpt):
    out = megashard.load_common(ckpt)
    assert set(out) == {"args"}, out  # "w0"/"w1" (sharded), "local" and "blob" (file-backed) are left out


# --------------------------------------------------------------------------- the same on S3
# A checkpoint in an object store is untrusted the same way: its head, index and digest are objects
# anyone with write access to the bucket may have edited (rewriting the digest and ETags too). Every
# attack below ends in a MegashardError naming the object, requests no key outside the checkpoint's
# prefix, and allocates nothing sized by a claim before the object's real size is known.

S3_ROOT = "run"
S3_CKPT = f"{S3_ROOT}/iter_0000007"


class _S3Ckpt:
    """A saved checkpoint in the test bucket and the means to rewrite it as a hostile author would."""

    def __init__(self, s3, tmp_path) -> None:
        from megashard.storage.s3.client import ObjectStore

        self.s3, self.tmp = s3, tmp_path
        self.url = s3.url(S3_CKPT)
        _save(self.url)
        self.store, self.key = ObjectStore.for_url(self.url)
        self.head = json.loads(self.get("manifest.json"))
        self.prefix = self.head["data_prefix"]

    def get(self, name: str) -> bytes:
        return self.store.get_bytes(f"{self.key}/{name}", 1 << 26)[0]

    def data(self, name: str) -> bytes:
        return self.get(f"{self.prefix}/{name}")

    def put(self, name: str, data: bytes) -> str:
        return self.store.put_bytes(f"{self.key}/{name}", data)

    def put_data(self, name: str, data: bytes) -> str:
        return self.put(f"{self.prefix}/{name}", data)

    def shard(self) -> str:
        return next(n for n in self.doc()["files"] if n.endswith(".tensors"))

    def doc(self) -> dict:
        """The logical document (tamper.read_manifest_doc of a local copy of head and index)."""
        d = self.tmp / "doc"
        d.mkdir(exist_ok=True)
        (d / "manifest.json").write_bytes(self.get("manifest.json"))
        (d / "manifest.index").write_bytes(self.data("manifest.index"))
        return read_manifest_doc(str(d))

    def write_head(self, head: dict) -> None:
        """The head as given, with a digest that matches it."""
        data = json.dumps(head).encode()
        self.put("manifest.json", data)
        self.put_data(storage.MANIFEST_DIGEST_NAME, storage.manifest_digest(data).encode())

    def write_doc(self, doc: dict) -> None:
        """A (possibly damaged) logical document as index and head, ETags and digest consistent."""
        from tamper import encode_doc

        head, sections = encode_doc(doc)
        head = json.loads(head)
        head["index"]["etag"] = self.put_data("manifest.index", sections)
        head["data_prefix"] = self.prefix
        self.write_head(head)

    def edit(self, fn) -> None:
        doc = self.doc()
        fn(doc)
        self.write_doc(doc)

    def edit_head(self, fn) -> None:
        head = json.loads(self.get("manifest.json"))
        fn(head)
        self.write_head(head)


def _s3_rename_file(c: _S3Ckpt, new: str, plant: bool = True) -> None:
    """Every reference to the shard file renamed to ``new``; with ``plant``, the object ``new`` would
    reach if it were resolved as a path (a copy of the shard: a load that reads it would succeed)."""
    f = c.shard()
    data = c.data(f)
    if plant:
        c.store.put_bytes(f"{c.key}/other/x", data)
        c.store.put_bytes("other/x", data)

    def fn(d):
        d["files"][new] = d["files"].pop(f)
        for t in d["tensors"].values():
            for s in t["shards"]:
                if s["file"] == f:
                    s["file"] = new
        for tree in d["trees"].values():
            for v in tree.values():
                if isinstance(v, dict) and isinstance(v.get("ref"), dict) and v["ref"].get("file") == f:
                    v["ref"]["file"] = new
    c.edit(fn)


def _s3_dotdot_name(c):
    _s3_rename_file(c, "../other/x")


def _s3_dotdot_to_root(c):
    _s3_rename_file(c, "../../../other/x")


def _s3_absolute_name(c):
    _s3_rename_file(c, "/other/x")


def _s3_url_encoded_dotdot(c):
    _s3_rename_file(c, "..%2F..%2Fother%2Fx")


def _s3_url_encoded_dots(c):
    _s3_rename_file(c, "%2e%2e")


def _s3_query_name(c):
    _s3_rename_file(c, "x.tensors?versionId=1")


def _s3_fragment_name(c):
    _s3_rename_file(c, "x.tensors#../../other")


def _s3_backslash_name(c):
    _s3_rename_file(c, "..\\other\\x")


def _s3_dotdot_data_prefix(c):
    c.edit_head(lambda h: h.update(data_prefix="../other"))


def _s3_file_larger_than_claimed(c):
    f = c.shard()
    c.edit(lambda d: d["files"][f].update(bytes=d["files"][f]["bytes"] - 100))


def _s3_file_smaller_than_claimed(c):
    f = c.shard()
    c.edit(lambda d: d["files"][f].update(bytes=d["files"][f]["bytes"] + 100))


def _s3_file_claims_a_terabyte(c):
    f = c.shard()
    c.edit(lambda d: d["files"][f].update(bytes=1 << 40))


def _s3_index_longer_than_object(c):
    c.edit_head(lambda h: h["index"].update(bytes=h["index"]["bytes"] + 4096))


def _s3_index_shorter_than_object(c):
    c.edit_head(lambda h: h["index"].update(bytes=h["index"]["bytes"] - 10))


def _s3_section_past_index(c):
    """Every section reference of the head points past the index object (index.bytes honest)."""
    def fn(h):
        for table in ("files", "tensors", "trees"):
            for e in h[table]:
                e[1] = h["index"]["bytes"] + 10
    c.edit_head(fn)


def _s3_huge_index_and_sections(c):
    """The head claims a 16 TiB index and sections of that length: nothing may be allocated for them."""
    def fn(h):
        h["index"]["bytes"] = 1 << 44
        for table in ("files", "tensors", "trees"):
            for e in h[table]:
                e[2] = (1 << 44) - e[1]
    c.edit_head(fn)


def _s3_large_index_and_sections(c):
    """The same at 256 MiB (a claim the machine could satisfy: the tracemalloc bound catches it)."""
    def fn(h):
        h["index"]["bytes"] = 1 << 28
        for table in ("files", "tensors", "trees"):
            for e in h[table]:
                e[2] = (1 << 28) - e[1]
    c.edit_head(fn)


def _s3_huge_index_bytes(c):
    c.edit_head(lambda h: h["index"].update(bytes=1 << 44))


def _s3_index_object_huge(c):
    """An index object far larger than the head says (the head's ETag updated to match)."""
    def fn(h):
        h["index"]["etag"] = c.put_data("manifest.index", c.data("manifest.index") + b"\0" * (8 << 20))
    c.edit_head(fn)


def _s3_huge_shape(c):
    c.edit(lambda d: _ref(d, "local").update(shape=[1 << 40, 1 << 20]))


def _s3_offset_past_object(c):
    c.edit(lambda d: _first_shard(d).update(data_offset=1 << 40))


def _s3_digest_truncated(c):
    c.put_data(storage.MANIFEST_DIGEST_NAME, c.data(storage.MANIFEST_DIGEST_NAME)[:32])


def _s3_digest_garbled(c):
    c.put_data(storage.MANIFEST_DIGEST_NAME, c.data(storage.MANIFEST_DIGEST_NAME).upper())


def _s3_digest_of_other_bytes(c):
    c.put_data(storage.MANIFEST_DIGEST_NAME, storage.manifest_digest(b"something else").encode())


def _s3_digest_empty(c):
    c.put_data(storage.MANIFEST_DIGEST_NAME, b"")


def _s3_digest_huge(c):
    c.put_data(storage.MANIFEST_DIGEST_NAME, c.data(storage.MANIFEST_DIGEST_NAME) * (1 << 16))


def _s3_digest_missing(c):
    c.store.delete([f"{c.key}/{c.prefix}/{storage.MANIFEST_DIGEST_NAME}"])


def _s3_shard_truncated_mid_tensor(c):
    """The object cut short (its ETag changes with it: the index's no longer matches)."""
    f = c.shard()
    c.put_data(f, c.data(f)[:-300])


def _s3_shard_truncated_and_index_rewritten(c):
    """A hostile author truncates the object and rewrites size and ETag in the index to match."""
    f = c.shard()
    etag = c.put_data(f, c.data(f)[:-300])
    c.edit(lambda d: d["files"][f].update(bytes=d["files"][f]["bytes"] - 300, etag=etag))


def _s3_shard_missing(c):
    c.store.delete([f"{c.key}/{c.prefix}/{c.shard()}"])


def _s3_index_etag_stale(c):
    c.edit_head(lambda h: h["index"].update(etag='"0123456789abcdef0123456789abcdef"'))


S3_ATTACKS = [_s3_dotdot_name, _s3_dotdot_to_root, _s3_absolute_name, _s3_url_encoded_dotdot, _s3_url_encoded_dots,
              _s3_query_name, _s3_fragment_name, _s3_backslash_name, _s3_dotdot_data_prefix,
              _s3_file_larger_than_claimed, _s3_file_smaller_than_claimed, _s3_file_claims_a_terabyte,
              _s3_index_longer_than_object, _s3_index_shorter_than_object, _s3_section_past_index,
              _s3_huge_index_and_sections, _s3_large_index_and_sections, _s3_huge_index_bytes, _s3_index_object_huge,
              _s3_huge_shape, _s3_offset_past_object, _s3_digest_truncated, _s3_digest_garbled,
              _s3_digest_of_other_bytes, _s3_digest_empty, _s3_digest_huge, _s3_digest_missing,
              _s3_shard_truncated_mid_tensor, _s3_shard_truncated_and_index_rewritten, _s3_shard_missing,
              _s3_index_etag_stale]


@pytest.mark.parametrize("index_read", ["whole", "ranged"])
@pytest.mark.parametrize("attack", S3_ATTACKS, ids=lambda f: f.__name__.strip("_"))
def test_hostile_s3_checkpoint(attack, index_read, s3, tmp_path, capsys, monkeypatch):
    """``index_read``: the index fetched whole with the digest (the default for one this small),
    or in ranged block reads (what a large one gets: MEGASHARD_S3_INDEX_WHOLE_BYTES=0)."""
    import tracemalloc

    c = _S3Ckpt(s3, tmp_path)
    attack(c)
    if index_read == "ranged":
        monkeypatch.setenv("MEGASHARD_S3_INDEX_WHOLE_BYTES", "0")
        monkeypatch.setenv("MEGASHARD_S3_INDEX_BLOCK_BYTES", "512")
    s3.reset()
    outcomes = {}
    tracemalloc.start()
    try:
        for name, call in [("load", lambda: megashard.load(_template(), c.url, verify=False)),
                           ("load_strict_verify", lambda: megashard.load(_template(), c.url, verify=True)),
                           ("load_common", lambda: megashard.load_common(c.url, ["args"], strict=True)),
                           ("verify", lambda: verify_checkpoint(c.url) or None)]:
            try:
                outcomes[name] = call()
            except MegashardError as e:
                outcomes[name] = e
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(outcomes["verify"], (list, MegashardError)) and outcomes["verify"], outcomes
    assert isinstance(outcomes["load"], MegashardError), outcomes
    assert isinstance(outcomes["load_strict_verify"], MegashardError), outcomes
    for v in outcomes.values():  # each message names the checkpoint's objects
        text = str(v) if isinstance(v, MegashardError) else " ".join(map(str, v or []))
        if isinstance(v, (MegashardError, list)):
            assert c.url in text, f"{attack.__name__}: message does not name the checkpoint: {text[:500]}"
    assert cli_main(["verify", c.url]) != 0
    capsys.readouterr()
    # no key outside the checkpoint was ever asked for
    outside = sorted({r["key"] for r in s3.requests() if not r["key"].startswith(c.key + "/")})
    assert not outside, f"{attack.__name__}: requests outside the checkpoint: {outside}"
    if index_read == "ranged":  # the index only ever in ranged GETs
        assert not [r for r in s3.requests() if r["key"].endswith("/manifest.index") and r["method"] == "GET"
                    and not r["range"]]
    assert peak < 32 << 20, f"{attack.__name__}: {peak} bytes allocated although every object is tiny"


@pytest.mark.parametrize("text", [b"../other", b"7/../../other", b"iter_0000007", b"-1", b"1e3", b"0x7", b"7\x00",
                                  b"\xd9\xa7", b"9" * 5000, b"s3://other-bucket/run/iter_0000007", b"release/.."])
def test_hostile_s3_tracker(s3, tmp_path, text):
    """A tracker object naming another prefix (or nothing readable) is refused naming it; a save
    root's readers never follow it outside the root."""
    c = _S3Ckpt(s3, tmp_path)
    root = s3.url(S3_ROOT)
    c.store.put_bytes("other/manifest.json", c.get("manifest.json"))
    c.store.put_bytes(f"{S3_ROOT}/latest_checkpointed_iteration.txt", text)
    s3.reset()
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        storage.read_tracker(root)
    problems = verify_checkpoint(root)
    assert problems and "latest_checkpointed_iteration.txt" in problems[0], problems
    with pytest.raises(MegashardError):
        megashard.load_consolidated(root)
    outside = sorted({r["key"] for r in s3.requests() if not r["key"].startswith(S3_ROOT + "/")})
    assert not outside, outside


def test_s3_damaged_byte_fails_the_load_naming_file_and_tensor(s3, tmp_path, monkeypatch):
    """A byte of a saved tensor damaged in the object, its ETag and size still the index's (rewritten to
    match): the CRC32 the ranged GETs compute as the bytes land (no pass over the tensor after them)
    fails the load with ChecksumError naming the checkpoint, the object and the tensor; the tensors it
    does not touch are not flagged."""
    from megashard import loading
    from megashard.errors import ChecksumError

    c = _S3Ckpt(s3, tmp_path)
    d = c.doc()
    s = _first_shard(d)
    f = s["file"]
    data = bytearray(c.data(f))
    data[s["data_offset"] + 5] ^= 0x10
    etag = c.put_data(f, bytes(data))
    c.edit(lambda d: d["files"][f].update(etag=etag))
    computed: list = []
    real = loading._Crc.compute
    monkeypatch.setattr(loading._Crc, "compute", lambda self, data=None: computed.append(self.name) or real(self, data))
    with pytest.raises(ChecksumError) as e:
        megashard.load(_template(), c.url)
    text = str(e.value)
    assert f"{c.url}/{f}" in text and repr(s["name"]) in text and "damaged" in text, text
    assert text.count("is damaged") == 1, text  # only the flipped tensor
    assert computed == [], computed  # every CRC32 came from the GETs
