"""The index is checked as a whole (issue 19, defects 9-14): overlapping chunks, colliding
names, declared dtypes that differ from the data, decoding that imports or over-allocates,
sizes claimed beyond the files, and a strictly parsed ``manifest.sha256``."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest
import torch

import megashard
from megashard import jsonstate, storage
from megashard.checkpoint_tools import verify_checkpoint
from megashard.errors import CheckpointError, MegashardError, StateDictError
from megashard.sharded import ShardedTensor
from tamper import read_manifest_doc, write_manifest_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = torch.arange(64, dtype=torch.float32).reshape(8, 8)


def _save_rows(path: str) -> None:
    """``w`` (8x8) saved as two row halves, plus a rank-local tensor and an arg."""
    megashard.save({"w0": ShardedTensor("w", G[:4].clone(), (8, 8), (0, 0)),
                    "w1": ShardedTensor("w", G[4:].clone(), (8, 8), (4, 0)),
                    "local": torch.arange(5, dtype=torch.int64), "args": {"lr": 0.1}}, path)


def _edit(path, fn):
    doc = read_manifest_doc(path)
    fn(doc)
    write_manifest_doc(path, doc)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _all_loads_refuse(path: str, needles) -> None:
    """load, load(verify=True) and load_consolidated raise a CheckpointError naming ``needles``;
    `megashard verify` reports it."""
    calls = [lambda: megashard.load({"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0))}, path),
             lambda: megashard.load({"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0))}, path, verify=True),
             lambda: megashard.load_consolidated(path)]
    for call in calls:
        with pytest.raises(CheckpointError) as ei:
            call()
        for n in needles:
            assert n in str(ei.value), str(ei.value)
    problems = verify_checkpoint(path)
    assert problems and any(all(n in p for n in needles) for p in problems), problems


# ------------------------------------------------------------------ 9: overlapping chunks


def test_forged_overlapping_chunks_refused(tmp_path):
    """Rows 3..6 claimed twice, row 7 never: the sum of the chunks' sizes is still 64."""
    path = str(tmp_path / "ckpt")
    _save_rows(path)
    _edit(path, lambda d: d["tensors"]["w"]["shards"][1].update(offset=[3, 0]))
    _all_loads_refuse(path, ["'w'", "[0, 0]+[4, 8]", "[3, 0]+[4, 8]", "overlap"])


def test_forged_overlapping_flat_ranges_refused(tmp_path):
    """Two records of one chunk whose flat ranges overlap (and leave a gap)."""
    path = str(tmp_path / "ckpt")
    megashard.save({"a": ShardedTensor("w", G.reshape(-1)[:32].clone(), (8, 8), (0, 0), local_shape=(8, 8),
                                       flattened_range=slice(0, 32)),
                    "b": ShardedTensor("w", G.reshape(-1)[32:].clone(), (8, 8), (0, 0), local_shape=(8, 8),
                                       flattened_range=slice(32, 64))}, path)

    def forge(d):
        s = d["tensors"]["w"]["shards"][1]
        s["flat"] = [16, 48]  # overlaps [0, 32), leaves 48..64 uncovered
    _edit(path, forge)
    _all_loads_refuse(path, ["'w'", "flat", "[0, 32]", "[16, 48]", "overlap"])


def test_allocated_destination_never_returned_partial(tmp_path, caplog):
    """strict=False with a hole: a destination megashard would allocate (template without
    data) is not handed back half-filled (before: uninitialised memory)."""
    path = str(tmp_path / "ckpt")
    _save_rows(path)
    _edit(path, lambda d: d["tensors"]["w"]["shards"].pop(1))
    t = {"w": ShardedTensor("w", None, (8, 8), (0, 0), local_shape=(8, 8), dtype=torch.float32),
         "u": ShardedTensor("w", None, (8, 8), (0, 0), local_shape=(4, 8), dtype=torch.float32)}
    out = megashard.load(t, path, strict=False)
    assert out["w"] is None
    assert torch.equal(out["u"], G[:4])  # the part that was saved loads
    with pytest.raises(CheckpointError, match="missing data"):
        megashard.load_consolidated(path)


# ------------------------------------------------------------------ 10: names inside a file


def test_global_key_with_rank_local_prefix_refused(tmp_path):
    """A global key ``__rank0__/x`` would share its file name with rank 0's local tensor ``x``."""
    path = str(tmp_path / "ckpt")
    sd = {"x": torch.full((4,), 7.0), "g": ShardedTensor("__rank0__/x", torch.full((4,), 1.0), (4,), (0,))}
    with pytest.raises(StateDictError, match=r"__rank0__/x.*reserved"):
        megashard.save(sd, path)
    assert not os.path.exists(path)
    with pytest.raises(StateDictError, match=r"__object__/o.*reserved"):
        megashard.save({"g": ShardedTensor("__object__/o/0", torch.ones(2), (2,), (0,))}, path)


def test_key_equal_to_derived_shard_name_refused(tmp_path):
    """Key ``a/shard_0.0_4.8`` is the name of key ``a``'s first row half inside the file: both
    would be one tensor there and the checkpoint would lack one of them."""
    path = str(tmp_path / "ckpt")
    sd = {"a0": ShardedTensor("a", G[:4].clone(), (8, 8), (0, 0)),
          "a1": ShardedTensor("a", G[4:].clone(), (8, 8), (4, 0)),
          "b": ShardedTensor("a/shard_0.0_4.8", torch.full((4, 8), -1.0), (4, 8), (0, 0))}
    with pytest.raises(StateDictError) as ei:
        megashard.save(sd, path)
    msg = str(ei.value)
    assert "a/shard_0.0_4.8" in msg and "'a'" in msg, msg
    assert not os.path.exists(path)


def test_tied_weights_still_saved_once(tmp_path):
    """The same shard listed twice on a rank (tied embeddings) is one tensor, not a collision."""
    path = str(tmp_path / "ckpt")
    emb = G.clone()
    megashard.save({"e": ShardedTensor("emb", emb, (8, 8), (0, 0)), "o": ShardedTensor("emb", emb, (8, 8), (0, 0))},
                   path)
    out = megashard.load({"e": ShardedTensor("emb", torch.zeros(8, 8), (8, 8), (0, 0))}, path)
    assert torch.equal(out["e"], G)


def test_forged_index_naming_one_tensor_twice_refused(tmp_path):
    """Two different chunks pointing at the same tensor of a file: refused at load and by verify."""
    path = str(tmp_path / "ckpt")
    _save_rows(path)

    def forge(d):
        a, b = d["tensors"]["w"]["shards"]
        b.update(file=a["file"], name=a["name"], header_offset=a["header_offset"], data_offset=a["data_offset"],
                 crc32=a["crc32"])
    _edit(path, forge)
    t = {"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0))}
    for verify in (False, True):
        with pytest.raises(CheckpointError, match="named twice"):
            megashard.load(t, path, verify=verify)
    assert any("named twice" in p for p in verify_checkpoint(path)), verify_checkpoint(path)


# ------------------------------------------------------------------ 11: declared dtype vs data


def test_declared_dtype_differs_from_data_refused_at_save(tmp_path):
    path = str(tmp_path / "ckpt")
    sd = {"w": ShardedTensor("w", torch.ones(4, 8), (4, 8), (0, 0), dtype=torch.bfloat16)}
    with pytest.raises(StateDictError) as ei:
        megashard.save(sd, path)
    msg = str(ei.value)
    assert "'w'" in msg and "bfloat16" in msg and "float32" in msg, msg
    assert not os.path.exists(path)


def test_declared_dtype_differs_from_data_refused_at_load(tmp_path):
    path = str(tmp_path / "ckpt")
    megashard.save({"w": ShardedTensor("w", torch.ones(4, 8, dtype=torch.bfloat16), (4, 8), (0, 0))}, path)
    dest = torch.zeros(4, 8)  # float32 storage behind a bfloat16 declaration
    for strict in (True, False):
        with pytest.raises(StateDictError) as ei:
            megashard.load({"w": ShardedTensor("w", dest, (4, 8), (0, 0), dtype=torch.bfloat16)}, path, strict=strict)
        msg = str(ei.value)
        assert "'w'" in msg and "bfloat16" in msg and "float32" in msg, msg
    assert torch.equal(dest, torch.zeros(4, 8))


def test_megatron_core_sharded_tensor_dtype_mismatch_refused(tmp_path):
    """megatron-core's own ShardedTensor, its data swapped after construction."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MCoreST

    st = MCoreST.from_rank_offsets("w", torch.ones(4, 8))
    st.data = torch.ones(4, 8, dtype=torch.float16)
    with pytest.raises(StateDictError, match=r"'w'.*float32.*float16|'w'.*float16.*float32"):
        megashard.save({"w": st}, str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ 12: decoding imports nothing

_IMPORT_PROBE = r"""
import json, sys
import torch
from megashard import jsonstate
from megashard.errors import CheckpointError
name = sys.argv[1]
before = set(sys.modules)
try:
    jsonstate.decode({"d": {jsonstate.TAG: "torch.dtype", "name": name}})
    outcome = "decoded"
except CheckpointError as e:
    outcome = "CheckpointError: " + str(e)
print(json.dumps({"outcome": outcome, "new": sorted(set(sys.modules) - before)}))
"""


@pytest.mark.parametrize("name", ["_dynamo", "_inductor", "onnx", "testing"])
def test_torch_dtype_tag_naming_a_submodule_imports_nothing(name):
    """In a fresh process (earlier imports must not mask it): no module is imported."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, name], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["new"] == [], res["new"][:20]
    assert res["outcome"].startswith("CheckpointError") and f"no dtype {name!r}" in res["outcome"], res


def test_torch_dtype_tag_round_trips_every_dtype():
    for dt in [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool, torch.complex64,
               torch.uint8, torch.float16]:
        assert jsonstate.decode(jsonstate.encode(dt)) is dt


@pytest.mark.parametrize("dtype", ["|V0", "<U0", "|S0", "<V0"])
def test_zero_itemsize_array_refused_without_allocating(dtype):
    """A 73-byte entry: a zero-itemsize dtype and a huge shape (before: 1.9 GB, or out of memory)."""
    bad = {jsonstate.TAG: "ndarray", "dtype": dtype, "shape": [1 << 30, 1 << 20], "b64": ""}
    rss0 = _peak_rss_mb()
    with pytest.raises(CheckpointError, match="zero-size|itemsize"):
        jsonstate.decode({"a": bad})
    assert _peak_rss_mb() - rss0 < 50


@pytest.mark.parametrize("dtype, needle", [("|O", "object"), ("O", "object"), ("<i4,<f4", "structured"),
                                           ("(2,)<f4", "numpy dtype"), ("zz9", "numpy dtype"),
                                           ("<M8[ns]junk", "numpy dtype"), (">f4\n", "numpy dtype")])
def test_numpy_dtype_strings_outside_the_table_refused(dtype, needle):
    with pytest.raises(CheckpointError, match=needle):
        jsonstate.decode({jsonstate.TAG: "ndarray", "dtype": dtype, "shape": [1], "b64": ""})


def test_numpy_values_still_round_trip():
    import numpy as np

    vals = [np.arange(6, dtype=">f4").reshape(2, 3), np.array([True, False]), np.array(["ab", "c"]),
            np.array([b"xy"]), np.array([1, 2], dtype="datetime64[ns]"), np.array([3], dtype="timedelta64[s]"),
            np.float16(1.5), np.str_(""), np.bytes_(b""), np.complex128(1 + 2j), np.zeros(0, dtype=np.int8)]
    for v in vals:
        out = jsonstate.decode(json.loads(json.dumps(jsonstate.encode(v))))
        assert type(out) is type(v) and out.dtype == v.dtype and out.tobytes() == v.tobytes(), v


def test_zero_itemsize_array_refused_at_save():
    import numpy as np

    with pytest.raises(StateDictError, match="zero-size"):
        jsonstate.encode({"a": np.zeros(3, dtype="V0")})


def test_zero_itemsize_array_in_a_checkpoint_refused_by_load_common(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_rows(path)
    bad = {jsonstate.TAG: "ndarray", "dtype": "|V0", "shape": [1 << 28], "b64": ""}
    _edit(path, lambda d: next(iter(d["trees"].values()))["args"].update(v=bad))
    rss0 = _peak_rss_mb()
    with pytest.raises(CheckpointError, match="zero-size"):
        megashard.load_common(path, ["args"])
    assert _peak_rss_mb() - rss0 < 100
    assert any("zero-size" in p for p in verify_checkpoint(path))


# ------------------------------------------------------------------ 13: claimed sizes vs real ones

HUGE = 64 << 30  # 64 GiB, claimed by a file of a few KiB


def _claim_huge_file(d, name):
    d["files"][name]["bytes"] = HUGE + (1 << 20)


def test_huge_rank_local_claim_refused_before_allocating(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_rows(path)

    def forge(d):
        ref = next(iter(d["trees"].values()))["local"]["ref"]
        _claim_huge_file(d, ref["file"])
        ref.update(shape=[HUGE // 8], nbytes=HUGE)
    _edit(path, forge)
    rss0, t0 = _peak_rss_mb(), time.perf_counter()
    # "local" is not in the template: it is returned as saved (allocated from the index's claim)
    with pytest.raises(CheckpointError, match="size"):
        megashard.load({"args": {}}, path)
    with pytest.raises(CheckpointError, match="size"):
        megashard.load({"args": {}}, path, verify=True)
    assert time.perf_counter() - t0 < 20
    assert _peak_rss_mb() - rss0 < 100


def test_huge_global_tensor_claim_refused_by_load_consolidated(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_rows(path)

    def forge(d):
        t = d["tensors"]["w"]
        t["shape"] = [HUGE // 4 // 8 // 2, 8]
        for i, s in enumerate(t["shards"]):
            _claim_huge_file(d, s["file"])
            s.update(offset=[i * HUGE // 4 // 8 // 4, 0], shape=[HUGE // 4 // 8 // 4, 8], nbytes=HUGE // 4)
    _edit(path, forge)
    rss0 = _peak_rss_mb()
    with pytest.raises(CheckpointError, match="size"):
        megashard.load_consolidated(path)
    with pytest.raises(CheckpointError, match="size"):
        megashard.load({"w": ShardedTensor("w", None, tuple([HUGE // 4 // 8 // 2, 8]), (0, 0),
                                           dtype=torch.float32, local_shape=(HUGE // 4 // 8 // 2, 8))}, path)
    assert _peak_rss_mb() - rss0 < 100


# ------------------------------------------------------------------ 14: manifest.sha256 parsed strictly


@pytest.mark.parametrize("tail", [b"\x0b", b"\r", b" ", b"\n\n", b"", b"\t", b"\x0c"])
def test_digest_with_anything_but_one_newline_refused(tmp_path, tail):
    path = str(tmp_path / "ckpt")
    _save_rows(path)
    f = os.path.join(path, storage.MANIFEST_DIGEST_NAME)
    digest = open(f, "rb").read()
    assert len(digest) == 65 and digest.endswith(b"\n")
    with open(f, "wb") as fh:
        fh.write(digest[:64] + tail)
    with pytest.raises(CheckpointError, match="manifest.sha256"):
        megashard.load({"w": ShardedTensor("w", torch.zeros(8, 8), (8, 8), (0, 0))}, path)
    assert verify_checkpoint(path)


def test_uppercase_digest_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_rows(path)
    f = os.path.join(path, storage.MANIFEST_DIGEST_NAME)
    digest = open(f, "rb").read()
    with open(f, "wb") as fh:
        fh.write(digest[:64].upper() + b"\n")
    assert verify_checkpoint(path)


def test_rank_local_paths_that_print_alike_refused(tmp_path):
    """``{"a.b": t}`` and ``{"a": {"b": t}}`` both have the path ``a.b``: one name in the file."""
    path = str(tmp_path / "ckpt")
    with pytest.raises(StateDictError, match="'a.b'.*both be stored|both be stored.*'a.b'"):
        megashard.save({"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}}, path)
    assert not os.path.exists(path)


def test_data_with_fewer_elements_than_declared_refused_at_save(tmp_path):
    path = str(tmp_path / "ckpt")
    sh = ShardedTensor("w", torch.ones(4, 8), (8, 8), (0, 0), local_shape=(8, 8))
    with pytest.raises(StateDictError, match=r"'w'.*declares 64 elements.*has 32"):
        megashard.save({"w": sh}, path)
    assert not os.path.exists(path)
