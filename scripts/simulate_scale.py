#!/usr/bin/env python
"""Drive megashard's save planning, index building and load planning for 1k-16k ranks in one process.

Every rank's sharded state is fabricated by ``scale_models.rank_state_dict`` (shapes,
offsets, flattened ranges and replica ids as megatron-core builds them; meta tensors, no
data). The functions are the ones ``megashard.save`` / ``megashard.load`` run:

* per rank: ``saving._make_save_hook`` + ``saving._tree_parts`` + ``saving.announce``
  (what a rank sends the coordinator), then ``saving._select`` + ``saving._write_job`` with a
  stand-in for the file writer (offsets laid out like a ``.tensors`` file, no bytes written);
* the coordinator (rank 0): ``saving.coordinate`` (validate + assign writers) and
  ``saving.build_index`` (the index);
* per sampled rank: ``manifest.LazyIndex`` over the index bytes, ``loading._decode_saved_tree``
  of its state tree, ``loading.plan_shard`` for every ShardedTensor of its template (own mode)
  and ``index.object`` for every ShardedObject.

Message sizes are those of the JSON the collectives carry (``transport.Comm.gather_json`` /
``scatter_json``: each message its own size, plus 8 bytes of size exchange).
``coordinator_peak_mb`` is the peak resident memory the coordinator's work adds on top of
the messages it received (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

Usage: ``scripts/simulate_scale.py --model llama3-70b --tp 8 --pp 8 --dp 16 --distributed-optimizer
[--reshard-to TP,PP,DP[,EP]] [--sample 16] [--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scale_models as sm  # noqa: E402
from _bench_worker import _status_kib, reset_peak_rss  # noqa: E402

from megashard import jsonstate, loading, manifest as mf, saving  # noqa: E402
from megashard.sharded import ShardedTensor, looks_like_sharded_object, looks_like_sharded_tensor, object_unique_key  # noqa: E402

SIZE_EXCHANGE = 8  # the int64 each rank sends/receives before a gather/scatter payload


def _wire(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":")).encode())


def _fake_write(tensors: Dict[str, Any], path: str, align: int, fsync: bool, threads: Optional[int]) -> Tuple[List[Any], int]:
    """Stands in for ``format.write_file``: offsets laid out like a .tensors file (a metadata
    block, a header per tensor, data aligned to ``align``), nothing written."""
    pos = 4096 * (1 + (len(tensors) * 160) // 4096)
    infos = []
    for name, t in tensors.items():
        header = 64 + len(name.encode()) + 8 * t.dim()
        nbytes = t.numel() * t.element_size()
        data = pos + header + (-(pos + header)) % align if nbytes else pos + header
        infos.append(SimpleNamespace(name=name, header_offset=pos, data_offset=data, nbytes=nbytes,
                                     crc32=(data * 2654435761) & 0xFFFFFFFF))
        pos = data + nbytes
    return infos, pos + 8


def _save_state(model: str, layout: sm.Layout, rank: int, quirk: bool) -> saving._SaveState:
    sd = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk)
    st = saving._SaveState(rank)
    st.tree = jsonstate.encode(dict(sd), hook=saving._make_save_hook(st, sm.file_stems(model, layout, rank)))
    st.tree_parts = saving._tree_parts(st, rank)
    return st


def simulate_save(model: str, layout: sm.Layout, quirk: bool = False) -> Dict[str, Any]:
    """Every rank announces; the coordinator plans; every rank "writes"; the coordinator
    builds the index. Returns the figures and the index bytes."""
    world = layout.world
    t0 = time.perf_counter()
    t_decode = 0.0  # rank 0 parsing what it receives (both gathers)
    messages, send = [], []
    for r in range(world):
        st = _save_state(model, layout, r, quirk)
        msg = saving.announce(st, r)
        payload = {"error": None, "payload": msg}
        send.append(_wire(payload))
        text = json.dumps({"error": None, "payload": msg})
        t1 = time.perf_counter()
        messages.append(json.loads(text)["payload"])  # what arrives: parsed JSON
        t_decode += time.perf_counter() - t1
    t_announce = time.perf_counter() - t0

    rss_before = _status_kib("VmRSS") * 1024
    peak_ok = reset_peak_rss()
    t0 = time.perf_counter()
    keep = saving._Coordinator()
    replies = saving.coordinate(messages, "simulated", keep)
    t_plan = time.perf_counter() - t0
    recv = [_wire({"ok": rep}) for rep in replies]
    del messages

    t0 = time.perf_counter()
    results, commit_send = [], []
    for r in range(world):
        st = _save_state(model, layout, r, quirk)
        saving.announce(st, r)  # sets the shard order the reply indexes
        job = saving._select(st, replies[r])
        res = saving._write_job(job, "/nonexistent", r, 4096, False, None, write=_fake_write)
        commit_send.append(_wire({"error": None, "payload": res}))
        text = json.dumps({"error": None, "payload": res})
        t1 = time.perf_counter()
        results.append(json.loads(text)["payload"])
        t_decode += time.perf_counter() - t1
    t_write = time.perf_counter() - t0

    t0 = time.perf_counter()
    head, sections = saving.build_index(results, keep.tensors, world, {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp})
    t_index = time.perf_counter() - t0
    peak_after = _status_kib("VmHWM") * 1024
    del results
    return {
        "world": world,
        "announce_s_all_ranks": round(t_announce, 2),
        "coordinator_plan_s": round(t_plan, 3),
        "coordinator_index_s": round(t_index, 3),
        "coordinator_s": round(t_plan + t_index, 3),
        "coordinator_decode_s": round(t_decode, 3),
        "coordinator_peak_mb": round(max(0, peak_after - rss_before) / 2**20, 1) if peak_ok else None,
        "coordinator_recv_bytes": sum(send) + sum(commit_send),
        "max_rank_send_bytes": {"save/plan": max(send) + SIZE_EXCHANGE, "save/commit": max(commit_send) + SIZE_EXCHANGE},
        "max_rank_recv_bytes": {"save/plan": max(recv[1:] or recv) + SIZE_EXCHANGE, "save/commit": 16 + SIZE_EXCHANGE},
        "write_records_s_all_ranks": round(t_write, 2),
        "index_bytes": len(head) + len(sections),
        "index_head_bytes": len(head),
        "_head": head,
        "_sections": sections,
    }


def _leaves(x: Any) -> List[Any]:
    out, stack = [], [x]
    while stack:
        v = stack.pop()
        if looks_like_sharded_tensor(v) or looks_like_sharded_object(v):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def plan_rank(head: bytes, sections: bytes, model: str, layout: sm.Layout, rank: int, quirk: bool = False) -> Dict[str, Any]:
    """One rank's load planning (own mode) against the index: what it reads of the index,
    how long parse + plan take, bytes needed vs read, temporaries."""
    template = sm.rank_state_dict(model, layout, rank, swiglu_dist_opt_quirk=quirk)
    t0 = time.perf_counter()
    index = mf.LazyIndex(mf.parse_head(head, "simulated"), lambda s, n: sections[s:s + n], "simulated", len(head))
    work = loading._LoadWork(rows_ok=True)
    loading._decode_saved_tree(index.tree_for_rank(rank), index, work, lazy=True)
    needed = read = temps = 0
    problems: List[str] = []
    for leaf in _leaves(template):
        if looks_like_sharded_object(leaf):
            if index.has_object(object_unique_key(leaf)):
                index.object(object_unique_key(leaf))
            continue
        sh = ShardedTensor.from_any(leaf)
        isz = sh.data.element_size()
        needed += ((sh.flat_range[1] - sh.flat_range[0]) if sh.flat_range else sh.data.numel()) * isz
        boxes, probs = loading.plan_shard(sh, index, rows_ok=True)
        problems += probs
        for bp in boxes:
            read += bp.wp.read_bytes + sum(rr.run_bytes * _prod(rr.lead_shape) for rr in bp.wp.rows)
            temps += sum(bp.wp.buffers) * isz
    return {"rank": rank, "plan_s": time.perf_counter() - t0, "index_read_bytes": index.bytes_read,
            "needed_bytes": needed, "read_bytes": read, "temp_bytes": temps, "problems": problems[:5]}


def _prod(s: Sequence[int]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def _sample(world: int, n: int) -> List[int]:
    if world <= n:
        return list(range(world))
    step = world / n
    return sorted({int(i * step) for i in range(n)} | {world - 1})


def run(model: str, layout: sm.Layout, reshard: Optional[sm.Layout], sample: int) -> Dict[str, Any]:
    out = simulate_save(model, layout)
    head, sections = out.pop("_head"), out.pop("_sections")
    ranks = [plan_rank(head, sections, model, layout, r) for r in _sample(layout.world, sample)]
    out["rank_plan_s"] = round(max(r["plan_s"] for r in ranks), 3)
    out["rank_index_read_bytes"] = max(r["index_read_bytes"] for r in ranks)
    out["same_layout_read_amplification"] = round(max(r["read_bytes"] / max(r["needed_bytes"], 1) for r in ranks), 3)
    out["problems"] = [p for r in ranks for p in r["problems"]][:5]
    if reshard is not None:
        rs = [plan_rank(head, sections, model, reshard, r) for r in _sample(reshard.world, sample)]
        out["reshard_to"] = f"TP{reshard.tp}·PP{reshard.pp}·DP{reshard.dp}" + (f"·EP{reshard.ep}" if reshard.ep > 1 else "")
        out["reshard_read_amplification"] = round(max(r["read_bytes"] / max(r["needed_bytes"], 1) for r in rs), 3)
        out["reshard_temp_bytes"] = max(r["temp_bytes"] for r in rs)
        out["reshard_rank_plan_s"] = round(max(r["plan_s"] for r in rs), 3)
        out["reshard_problems"] = [p for r in rs for p in r["problems"]][:5]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(sm.MODELS), required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--vp", type=int, default=None)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--reshard-to", default=None, help="TP,PP,DP[,EP] of the loading job")
    ap.add_argument("--sample", type=int, default=16, help="ranks whose load plan is measured")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    layout = sm.Layout(tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep, vp=a.vp, distributed_optimizer=a.distributed_optimizer)
    reshard = None
    if a.reshard_to:
        v = [int(x) for x in a.reshard_to.split(",")]
        reshard = sm.Layout(tp=v[0], pp=v[1], dp=v[2], ep=v[3] if len(v) > 3 else 1, vp=a.vp,
                            distributed_optimizer=a.distributed_optimizer)
    out = {"model": a.model, "layout": f"TP{a.tp}·PP{a.pp}·DP{a.dp}" + (f"·EP{a.ep}" if a.ep > 1 else "")}
    out.update(run(a.model, layout, reshard, a.sample))
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>34}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
