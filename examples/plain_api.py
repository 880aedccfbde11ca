"""megashard's plain Python API, no Megatron: two ranks save a tensor-parallel model, then
load it at another layout, bit for bit.

    torchrun --nproc-per-node 2 examples/plain_api.py /tmp/plain-ckpt

Ranks 0 and 1 hold a two-layer MLP split for tensor parallelism (TP=2): ``fc1``'s rows
(column-parallel) and ``fc2``'s columns (row-parallel); ``fc2.bias`` is whole on both.
They save it; then each loads the whole model (TP=1, one copy per rank, as data
parallelism would) from the same checkpoint, and checks it against the global weights.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import megashard

TP_SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # key -> axis this rank holds a part of


def mlp(hidden: int, ffn: int) -> torch.nn.Sequential:
    m = torch.nn.Sequential()
    m.add_module("fc1", torch.nn.Linear(hidden, ffn))
    m.add_module("act", torch.nn.GELU())
    m.add_module("fc2", torch.nn.Linear(ffn, hidden))
    return m


def main() -> None:
    ckpt = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "plain-ckpt")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = mlp(16, 64)  # the global model, the same on every rank (seeded)

    # --- save at TP=world: this rank's slice of every split weight ---------------------
    tp = mlp(16, 64 // world)
    with torch.no_grad():
        for name, p in tp.named_parameters():
            g = full.get_parameter(name)
            ax = TP_SPLIT.get(name)
            p.copy_(g if ax is None else g.chunk(world, dim=ax)[rank])
    state = megashard.sharded_state_dict(tp, TP_SPLIT, rank=rank, world=world)
    state["step"] = 100  # any JSON-like value rides along
    megashard.save(state, ckpt)  # collective; the directory appears atomically
    if rank == 0:
        print(f"saved {ckpt} at TP={world}: {sorted(megashard.read_manifest(ckpt).tensors)}", flush=True)

    # --- load at TP=1: every rank the whole model (replica_id: rank 0's copy is the main one)
    whole = mlp(16, 64)
    template = megashard.sharded_state_dict(whole, replica_id=rank)
    template["step"] = 0
    out = megashard.load(template, ckpt)  # fills `whole`'s parameters in place
    same = all(torch.equal(p, full.get_parameter(n)) for n, p in whole.named_parameters())
    x = torch.randn(4, 16)
    print(f"rank {rank}: loaded at TP=1, step {out['step']}, weights bit-exact: {same}, "
          f"output equal: {torch.equal(whole(x), full(x))}", flush=True)
    print(f"rank {rank}: common values: {megashard.load_common(ckpt, ['step'])}", flush=True)
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
