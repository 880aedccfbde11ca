"""megashard.load_consolidated: full global tensors in one process, no process group."""
from __future__ import annotations

import pytest
import torch

import megashard
from megashard import CheckpointError
from megashard.consolidated import global_nbytes

from distributed import all_ok, run_ranks
from layouts import GLOBALS, Layout, bit_equal, expected_global, full, model_state, union_state
from tamper import read_manifest_doc, write_manifest_doc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """TP=2 x DP=2 with the distributed optimizer: TP row/column splits and flattened ranges."""
    path = str(tmp_path_factory.mktemp("cons") / "iter_0000010")
    sd = union_state(Layout(tp=2, dp=2), distopt=True)
    sd.update({"iteration": 10, "rng": torch.arange(7)})
    megashard.save(sd, path)
    return path


def test_all_tensors_bit_exact_and_bytes_read_equal_needed(ckpt):
    m = megashard.read_manifest(ckpt)
    assert any(s.flat is not None for t in m.tensors.values() for s in t.shards), "no flattened shards to test"
    assert any(len(t.shards) > 1 for t in m.tensors.values())
    out, stats = megashard.load_consolidated(ckpt, return_stats=True)
    assert set(out) == set(m.tensors)
    assert len(out) == 2 * len(GLOBALS)
    for k, t in out.items():
        assert bit_equal(t, expected_global(k)), k
    needed = sum(global_nbytes(t) for t in m.tensors.values())
    assert stats.mode == "consolidated"
    assert stats.bytes_read == needed


def test_key_patterns_read_only_those_bytes(ckpt):
    m = megashard.read_manifest(ckpt)
    out, stats = megashard.load_consolidated(ckpt, ["decoder.layers.*", "embedding.word_embeddings.weight"], verify=True,
                                             return_stats=True)
    want = [k for k in m.tensors if k.startswith("decoder.layers.") or k == "embedding.word_embeddings.weight"]
    assert sorted(out) == sorted(want)
    for k in want:
        assert bit_equal(out[k], full(k))
    assert stats.bytes_read == sum(global_nbytes(m.tensors[k]) for k in want)
    with pytest.raises(CheckpointError, match="no global tensor matches 'nope.*'"):
        megashard.load_consolidated(ckpt, ["nope.*"])


def test_missing_shard_is_a_clear_error(tmp_path):
    sd = model_state(Layout(tp=2), 0)  # only TP rank 0's halves: global tensors half covered
    path = str(tmp_path / "half")
    with pytest.raises(megashard.StateDictError):
        megashard.save(sd, path)  # save refuses incomplete coverage; build one by editing the manifest
    full_sd = union_state(Layout(tp=2), distopt=False)
    megashard.save(full_sd, path)
    doc = read_manifest_doc(path)
    doc["tensors"]["decoder.layers.self_attention.linear_proj.weight"]["shards"].pop()
    write_manifest_doc(path, doc)
    with pytest.raises(CheckpointError, match="linear_proj.weight.*covers"):
        megashard.load_consolidated(path)
    out = megashard.load_consolidated(path, ["decoder.final_layernorm.weight"])
    assert bit_equal(out["decoder.final_layernorm.weight"], full("decoder.final_layernorm.weight"))


def _rank0_only(rank, world, path):
    """Rank 0 loads while rank 1 waits in nothing: any collective would hang the job."""
    if rank == 0:
        out = megashard.load_consolidated(path)
        return {k: bit_equal(t, expected_global(k)) for k, t in out.items()}
    return {}


def test_no_collectives_with_an_initialised_process_group(ckpt):
    res = all_ok(run_ranks(_rank0_only, 2, ckpt, timeout=90))
    assert res[0] and all(res[0].values())
