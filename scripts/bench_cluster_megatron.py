"""Megatron-LM resumes on the namespace cluster: megashard's load modes beside Megatron's own ``torch_dist``
loader, with and without ``--ckpt-fully-parallel-load``, bytes counted where they leave storage.

    sudo python scripts/bench_cluster_megatron.py [--layers 2] [--hidden 384] [--storage-mbit 40] \
        [--node-mbit 160] [--rounds 2] [--cases own,scatter,readonce,torch_dist,torch_dist_fpl] [--json out.json]
    sudo python scripts/bench_cluster_megatron.py --local-tier [--tier-cases local,peer,storage] [--shm-mb 512] ...

Builds ``tests/cluster.py``'s cluster (2 nodes x 2 ranks, SeaweedFS on a storage host whose link is
rate-limited with ``tc``, ``weed mount`` on every node) and runs Megatron-LM's own ``pretrain_gpt.py``
(the vendored core_v0.16.1 tree with ``megashard.megatron.install()``:
``tests/megatron_helpers/mlm_pretrain_gpt.py``, the tests' CPU / gloo / mock-data flags) on it with
torchrun, TP=2 within a node x DP=2 over the nodes, fp32 with Adam. Two saves to the shared FUSE mount
(train 1 iteration, save it, stop): ``--save-format tensors`` (megashard) and ``--save-format
torch_dist`` (Megatron's writer). Then, interleaved (order reversed every other round), one launch
per case that loads iteration 1 and trains iteration 2:

- ``own`` / ``scatter`` / ``readonce``: the megashard checkpoint with ``--megashard-load-mode``;
- ``torch_dist``: the torch_dist checkpoint with Megatron's loader as it comes;
- ``torch_dist_fpl``: the same with ``--ckpt-fully-parallel-load`` (reads split over the DP group,
  exchanged with all-gathers).

Before every launch each node's FUSE mount is unmounted and mounted again with an empty chunk cache
and the storage host's volume files get ``POSIX_FADV_DONTNEED`` (``scripts/bench_cluster.py``'s
method). "From storage" is the ``tx`` counter of the storage host's ``eth0`` over the whole launch:
nothing but the load touches the shared mount (code, logs and mock data are on the host's file
system), and a launch that does not load (``--cases`` always starts with one) measures what the rest
of a launch costs. The load time is Megatron's own ``load-checkpoint`` timer (max over ranks,
barriers on both sides); the floor is the checkpoint's bytes (every file of ``iter_0000001``, which
every node needs whole: DP=2 over the nodes) ÷ the storage link rate. Every load must give the same
iteration-2 loss, bit for bit (printed by Megatron with all its digits).

``--local-tier`` benchmarks the restart from the local checkpoint tier instead (``--tier-cases
local,peer,storage``). One run saves: ``--non-persistent-ckpt-type local`` in each node's
``/dev/shm`` every step, replicated to the other node (``--replication --replication-jump 2
--replication-factor 2``), ``--async-save`` (with ``--ckpt-format torch``, without which Megatron-LM
switches it off) to the shared mount every 2 steps; SIGKILLed in step 6
(local versions 3 and 5, persistent 4 committed). Megatron's ``save-checkpoint-non-persistent`` and
``save-checkpoint`` timers give the training stall of each local and async save. Then, interleaved,
launches that restart and train one step (no ``--save``, so nothing changes between them): ``local``
(every rank's own version of 5), ``peer`` (node 1 replaced first by a fresh node with an empty
``/dev/shm``, :meth:`tests.cluster.Cluster.replace_node`: its ranks' versions of 5 come from node 0's
replicas), ``storage`` (an empty local directory: ``--load`` at 4 from the shared mount, megashard's
``auto`` load mode), and ``noload`` (from scratch: the launch's own cost). Per launch: Megatron's
``load-checkpoint`` timer, the seconds from the launch to the first training step's log line, and the
storage link's bytes. The restart from storage must log the same loss for step 5 as the saving run,
every digit; the restarts from the tier all the same loss for step 6.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
sys.path[:0] = [str(TESTS), str(REPO)]

CASES = ("own", "scatter", "readonce", "torch_dist", "torch_dist_fpl")
SCRIPT = TESTS / "megatron_helpers" / "mlm_pretrain_gpt.py"
TIMER = re.compile(r"^.*?(save-checkpoint-non-persistent|save-checkpoint|load-checkpoint) \.*: "
                   r"\(([\d.]+), ([\d.]+)\)", re.M)
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")
NNODES, NPROC = 2, 2


def _tree(scratch: Path) -> str:
    """Megatron-LM's training tree for the installed megatron-core (the tests' lookup: vendored archive)."""
    import importlib.metadata

    from megatron_helpers.mlm_tree import find_tree

    release = re.match(r"\d+\.\d+\.\d+", importlib.metadata.version("megatron-core")).group(0)
    return find_tree(release, REPO, lambda: scratch).path


def _model_args(a: argparse.Namespace) -> List[str]:
    from test_megatron_lm_install import ARGS  # the tests' CPU / gloo / mock-data flags (TP=2)

    args = list(ARGS)
    for flag, value in (("--num-layers", a.layers), ("--hidden-size", a.hidden), ("--global-batch-size", 4)):
        i = args.index(flag)
        args[i + 1] = str(value)
    return args  # ARGS logs every iteration (--log-interval 1): the iteration-2 loss is printed


def _case_args(case: str, root: Path) -> List[str]:
    fmt = "torch_dist" if case.startswith("torch_dist") else "tensors"
    out = ["--load", str(root / fmt), "--train-iters", "2"]
    if fmt == "tensors":
        out += ["--megashard-load-mode", case]
    if case == "torch_dist_fpl":
        out += ["--ckpt-fully-parallel-load"]
    return out


class Launcher:
    """One timed launch of the script on every node of ``c`` after the shared mounts' caches and the
    storage host's page cache are dropped: its storage link bytes, Megatron's timers, losses, and the
    seconds from the launch to the first training step's log line (polled)."""

    def __init__(self, c: Any, model: List[str], env: Dict[str, str], timeout: float) -> None:
        self.c, self.model, self.env, self.timeout = c, model, env, timeout
        self.port = 29500
        self.output = ""

    def __call__(self, name: str, args: List[str], env: Optional[Dict[str, str]] = None,
                 killed: bool = False) -> Dict[str, Any]:
        from bench_cluster import _drop_storage_cache
        from megatron_helpers.runner import FAST_EXIT

        c = self.c
        for i in range(c.nodes):
            c.remount_shared(i)
        _drop_storage_cache(c.root / "storage")
        before = c.storage_link_bytes()
        logs = [c.logs / f"{name}-node{i}.log" for i in range(c.nodes)]
        self.port += 7
        t0 = time.perf_counter()
        agents = c.start_torchrun("-m", [FAST_EXIT, str(SCRIPT), *self.model, *args], nproc=NPROC,
                                  env={**self.env, **(env or {})}, name=name, port=self.port)
        first_step = None
        while first_step is None and any(p.poll() is None for p in agents):
            if any(LOSS.search(f.read_text(errors="replace")) for f in logs if f.exists()):
                first_step = time.perf_counter() - t0
            else:
                time.sleep(0.05)
        codes = c.wait_torchrun(agents, self.timeout, name)
        wall = time.perf_counter() - t0
        after = c.storage_link_bytes()
        out = "\n".join(f.read_text(errors="replace") for f in logs)
        if (codes == [0] * c.nodes) == killed:
            raise SystemExit(f"{name} {'was not killed' if killed else 'failed'} ({codes}): {' '.join(args)}\n"
                             f"{c.job_logs(name)}")
        self.output = out  # the last launch's output, for a caller's checks
        every: Dict[str, List[float]] = {}
        for m in TIMER.finditer(out):
            every.setdefault(m.group(1), []).append(float(m.group(3)) / 1e3)
        return {"name": name, "args": args, "wall_seconds": wall, "first_step_seconds": first_step,
                "tx": after["tx"] - before["tx"], "rx": after["rx"] - before["rx"],
                "timers": {k: v[-1] for k, v in every.items()}, "timers_every": every,
                "losses": {int(m.group(1)): m.group(2) for m in LOSS.finditer(out)},
                "megashard_loaded": "loading with megashard" in out}


def _host(a: argparse.Namespace) -> int:
    import cluster

    why = cluster.missing_prerequisites()
    if why:
        print(f"bench_cluster_megatron: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-cluster-mlm-") as work:
        return (_bench_tier if a.local_tier else _bench)(a, _tree(Path(work)))


def _env(tree: str) -> Dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(TESTS), os.environ.get("PYTHONPATH")])),
            "MEGASHARD_HUGEPAGES": "0", "PYTHONWARNINGS": "ignore", "MEGATRON_LM_DIR": tree,
            "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHDYNAMO_DISABLE": "1"}


def _bench(a: argparse.Namespace, tree: str) -> int:
    import cluster

    cases = ["noload"] + a.cases
    model = _model_args(a)
    env = _env(tree)
    steps: List[Dict[str, Any]] = []
    t_build = time.perf_counter()
    with cluster.Cluster(nodes=NNODES, storage_mbit=a.storage_mbit, node_mbit=a.node_mbit, shm_mb=256,
                         local_mb=16) as c:
        root = c.shared / "mlm"
        print(f"cluster up in {time.perf_counter() - t_build:.1f} s: storage {a.storage_mbit} Mbit/s, nodes "
              f"{a.node_mbit} Mbit/s; Megatron-LM tree {tree}", flush=True)
        launch = Launcher(c, model, env, a.timeout)
        unique: Dict[str, int] = {}
        stored: Dict[str, int] = {}  # what crossed the link into storage at the save (SeaweedFS may compress)
        for fmt in ("tensors", "torch_dist"):
            rec = launch(f"save-{fmt}", ["--save", str(root / fmt), "--save-format", fmt, "--train-iters", "2",
                                         "--save-interval", "1", "--exit-interval", "1"])
            sizes = c.run_in_node(0, ["find", str(root / fmt / "iter_0000001"), "-type", "f", "-printf", "%s\n"])
            unique[fmt] = sum(int(s) for s in sizes.stdout.split())
            stored[fmt] = rec["rx"]
            rec.update(kind="save", format=fmt, files=len(sizes.stdout.split()), unique_bytes=unique[fmt])
            steps.append(rec)
            print(f"save {fmt:10s} {rec['timers'].get('save-checkpoint', float('nan')):6.1f} s (save-checkpoint), "
                  f"{unique[fmt] / 2**20:.1f} MiB in {rec['files']} files, into storage {rec['rx'] / 2**20:.1f} MiB, "
                  f"launch {rec['wall_seconds']:.1f} s", flush=True)
        for r in range(a.rounds):
            for case in (cases if r % 2 == 0 else cases[:1] + cases[:0:-1]):
                if case == "noload":
                    args = ["--train-iters", "1"]  # from scratch, one iteration: the launch without the load
                else:
                    args = _case_args(case, root)
                rec = launch(f"{case}-r{r}", args)
                fmt = "torch_dist" if case.startswith("torch_dist") else "tensors"
                rec.update(kind="load" if case != "noload" else "noload", case=case, round=r, format=fmt)
                steps.append(rec)
                if case == "noload":
                    print(f"round {r} noload          launch {rec['wall_seconds']:6.1f} s, from storage "
                          f"{rec['tx'] / 2**20:6.2f} MiB", flush=True)
                    continue
                floor = unique[fmt] * 8 / (a.storage_mbit * 1e6)
                lc = rec["timers"].get("load-checkpoint", float("nan"))
                print(f"round {r} {case:15s} load-checkpoint {lc:6.1f} s ({lc / floor:.2f}x floor)  from storage "
                      f"{rec['tx'] / 2**20:6.1f} MiB ({rec['tx'] / unique[fmt]:.3f}x)  launch {rec['wall_seconds']:6.1f} s"
                      f"  loss@2 {rec['losses'].get(2)}  megashard {rec['megashard_loaded']}", flush=True)
    noload = [s for s in steps if s["kind"] == "noload"]
    base_tx = statistics.median(s["tx"] for s in noload)
    base_wall = statistics.median(s["wall_seconds"] for s in noload)
    table: Dict[str, Any] = {}
    losses = {s["losses"].get(2) for s in steps if s["kind"] == "load"}
    for case in a.cases:
        runs = [s for s in steps if s["kind"] == "load" and s["case"] == case]
        fmt = runs[0]["format"]
        floor = unique[fmt] * 8 / (a.storage_mbit * 1e6)
        tx = statistics.median(s["tx"] for s in runs)
        lc = statistics.median(s["timers"]["load-checkpoint"] for s in runs)
        wall = statistics.median(s["wall_seconds"] for s in runs)
        table[case] = {"format": fmt, "unique_bytes": unique[fmt], "floor_seconds": floor,
                       "bytes_from_storage_median": tx, "storage_bytes_vs_unique": tx / unique[fmt],
                       "storage_bytes_minus_noload_vs_unique": (tx - base_tx) / unique[fmt],
                       "bytes_into_storage_at_save": stored[fmt], "storage_bytes_vs_saved": tx / stored[fmt],
                       "load_checkpoint_seconds_median": lc, "load_vs_floor": lc / floor,
                       "launch_seconds_median": wall, "launch_minus_noload_seconds": wall - base_wall,
                       "rounds": len(runs), "loss_iteration_2": sorted({s["losses"].get(2) for s in runs}, key=str),
                       "through_megashard": sorted({s["megashard_loaded"] for s in runs})}
    result = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
              "storage_mbit": a.storage_mbit, "node_mbit": a.node_mbit, "nodes": NNODES, "ranks_per_node": NPROC,
              "layout": "TP=2 x DP=2", "model_args": model, "unique_bytes": unique, "bytes_into_storage_at_save": stored,
              "noload_tx_median": base_tx, "noload_launch_seconds_median": base_wall,
              "same_loss_everywhere": len(losses) == 1 and None not in losses, "table": table, "steps": steps}
    print(f"\nno-load launch: {base_wall:.1f} s, {base_tx / 2**20:.2f} MiB from storage; "
          f"iteration-2 loss identical in every load: {result['same_loss_everywhere']} ({sorted(losses, key=str)})")
    print(f"{'case':15s} {'MiB':>6s} {'from storage / unique':>22s} {'/ saved':>8s} {'load-checkpoint':>16s} {'/ floor':>8s} "
          f"{'launch':>8s}")
    for case, r in table.items():
        print(f"{case:15s} {r['unique_bytes'] / 2**20:6.1f} {r['storage_bytes_vs_unique']:22.3f} {r['storage_bytes_vs_saved']:8.3f} "
              f"{r['load_checkpoint_seconds_median']:15.1f}s {r['load_vs_floor']:8.2f} {r['launch_seconds_median']:7.1f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


TIER = "/dev/shm/megashard-tier"  # --non-persistent-local-ckpt-dir on every node (its own tmpfs)
NO_TIER = "/dev/shm/megashard-no-tier"  # an empty local tier: the restart from storage
TIER_CASES = ("local", "peer", "storage")
KILL_AT = 5  # the tier run: local saves 1, 3, 5 (replicated), async saves to storage 2, 4, SIGKILLed in step 6
RESTORED = re.compile(r"restored rank (\d+)'s local checkpoint of iteration (\d+) from rank (\d+)'s replica in "
                      r"([\d.]+) s")


def _tier_flags(where: str) -> List[str]:
    return ["--save-format", "tensors", "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "local",
            "--non-persistent-local-ckpt-dir", where, "--replication", "--replication-jump", str(NPROC),
            "--replication-factor", str(NNODES)]


def _async_flags() -> List[str]:
    """``--async-save`` as Megatron-LM keeps it on a CPU host: it switches it off for the dist formats
    (``--ckpt-format torch`` only affects Megatron's own saves; ``tests/test_async_megatron_lm.py``)."""
    from test_async_megatron_lm import STRATEGY

    return ["--async-save", "--ckpt-format", "torch", *STRATEGY]


def _bench_tier(a: argparse.Namespace, tree: str) -> int:
    """The local tier's restart against the restart from storage (``--local-tier``)."""
    import cluster
    from bench_localtier import REPLICATED

    model, env = _model_args(a), _env(tree)
    steps: List[Dict[str, Any]] = []
    with cluster.Cluster(nodes=NNODES, storage_mbit=a.storage_mbit, node_mbit=a.node_mbit, shm_mb=a.shm_mb,
                         local_mb=16) as c:
        root = c.shared / "mlm"
        launch = Launcher(c, model, env, a.timeout)
        setup = launch("tier-save", [*_tier_flags(TIER), "--save", str(root), *_async_flags(), "--train-iters", "8",
                                     "--save-interval", "2"], env={"MEGASHARD_TEST_KILL_AT": str(KILL_AT)}, killed=True)
        if f"scheduled an async save of iteration {KILL_AT - 1}" not in launch.output:
            raise SystemExit(f"Megatron-LM did not save asynchronously\n{launch.output[-4000:]}")
        replicated = [{"iteration": int(i), "mb_per_rank": float(mb), "seconds": float(t)}
                      for i, mb, t in REPLICATED.findall(launch.output)]
        tracker = c.run_in_node(0, ["cat", f"{root}/latest_checkpointed_iteration.txt"]).stdout.strip()
        sizes = c.run_in_node(0, ["find", f"{root}/iter_{KILL_AT - 1:07d}", "-type", "f", "-printf", "%s\n"])
        persistent_bytes = sum(int(x) for x in sizes.stdout.split())
        own = c.run_in_node(0, ["sh", "-c", f"cat {TIER}/megashard-*/rank*/iter_{KILL_AT:07d}/* | wc -c"])
        node_version_bytes = int(own.stdout)
        if tracker != str(KILL_AT - 1) or sorted(setup["losses"]) != list(range(1, KILL_AT + 1)):
            raise SystemExit(f"the tier run did not end as planned (tracker {tracker!r}, losses "
                             f"{sorted(setup['losses'])})\n{launch.output[-4000:]}")
        setup.update(kind="setup", replicated=replicated)
        steps.append(setup)
        stalls = setup["timers_every"]
        print(f"tier run: local version of a node {node_version_bytes / 2**20:.1f} MiB, persistent checkpoint "
              f"{persistent_bytes / 2**20:.1f} MiB; stall per local save "
              f"{stalls.get('save-checkpoint-non-persistent')} s, "
              f"per async save {stalls.get('save-checkpoint')} s; replication {[r['seconds'] for r in replicated]} s",
              flush=True)
        cases = ["noload", *a.tier_cases]
        for r in range(a.rounds):
            for case in (cases if r % 2 == 0 else cases[:1] + cases[:0:-1]):
                if case == "noload":
                    args = ["--train-iters", "1"]
                elif case == "storage":  # every node's tier lost: --load, iteration KILL_AT - 1, then one step
                    args = [*_tier_flags(NO_TIER), "--load", str(root), "--train-iters", "8",
                            "--exit-interval", str(KILL_AT)]
                else:  # the tier's KILL_AT, then one step; "peer": node 1 replaced first (its /dev/shm empty)
                    if case == "peer":
                        c.replace_node(1)
                    args = [*_tier_flags(TIER), "--load", str(root), "--train-iters", "8",
                            "--exit-interval", str(KILL_AT + 1)]
                rec = launch(f"{case}-r{r}", args)
                out = launch.output
                restored = RESTORED.findall(out)
                want = {"noload": "", "storage": f"at iteration {KILL_AT - 1} (optimizer loaded, rng loaded)",
                        "local": "loaded local checkpoint", "peer": "loaded local checkpoint"}[case]
                if want not in out or bool(restored) != (case == "peer"):
                    raise SystemExit(f"{case}: not the restart planned\n{out[-4000:]}")
                rec.update(kind=case, round=r, peer_transfer_seconds=[float(x[3]) for x in restored],
                           restored=[[int(x[0]), int(x[2])] for x in restored])
                steps.append(rec)
                print(f"round {r} {case:8s} load-checkpoint {rec['timers'].get('load-checkpoint', float('nan')):6.2f} s"
                      f"  first step {rec['first_step_seconds']:6.1f} s  launch {rec['wall_seconds']:6.1f} s  from "
                      f"storage {rec['tx'] / 2**20:6.1f} MiB  losses {rec['losses']}"
                      + (f"  peer transfer {rec['peer_transfer_seconds']} s" if restored else ""), flush=True)
    med = statistics.median
    table: Dict[str, Any] = {}
    for case in ["noload", *a.tier_cases]:
        runs = [s for s in steps if s["kind"] == case]
        table[case] = {"rounds": len(runs), "first_step_seconds_median": med(s["first_step_seconds"] for s in runs),
                       "launch_seconds_median": med(s["wall_seconds"] for s in runs),
                       "bytes_from_storage_median": med(s["tx"] for s in runs),
                       "losses": sorted({json.dumps(s["losses"], sort_keys=True) for s in runs})}
        if case != "noload":
            table[case]["load_checkpoint_seconds_median"] = med(s["timers"]["load-checkpoint"] for s in runs)
            table[case]["load_checkpoint_seconds"] = [s["timers"]["load-checkpoint"] for s in runs]
        if case == "peer":
            table[case]["peer_transfer_seconds_median"] = med(x for s in runs for x in s["peer_transfer_seconds"])
    # the restart from storage takes the step after KILL_AT - 1 as the uninterrupted run did, every digit;
    # the restarts from the tier (own or a peer's replica) all take the same step after KILL_AT
    checks = {"storage_loss_equals_uninterrupted": all(
                  s["losses"].get(KILL_AT) == setup["losses"][KILL_AT] for s in steps if s["kind"] == "storage"),
              "tier_losses_identical": len({s["losses"].get(KILL_AT + 1) for s in steps
                                            if s["kind"] in ("local", "peer")}) == 1}
    base = table["noload"]["first_step_seconds_median"]
    for t in table.values():  # what the restart adds to a launch that loads nothing (noise: about a second)
        t["first_step_minus_noload_seconds"] = t["first_step_seconds_median"] - base
    ratios = {}
    if "storage" in table:
        for case in ("local", "peer"):
            if case in table:
                ratios[f"storage_vs_{case}_load_checkpoint"] = (table["storage"]["load_checkpoint_seconds_median"]
                                                                / table[case]["load_checkpoint_seconds_median"])
                ratios[f"storage_vs_{case}_first_step"] = (table["storage"]["first_step_seconds_median"]
                                                           / table[case]["first_step_seconds_median"])
    result = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
              "storage_mbit": a.storage_mbit, "node_mbit": a.node_mbit, "nodes": NNODES, "ranks_per_node": NPROC,
              "layout": "TP=2 x DP=2", "model_args": model, "tier_flags": _tier_flags(TIER),
              "persistent_checkpoint_bytes": persistent_bytes, "node_local_version_bytes": node_version_bytes,
              "local_save_stall_seconds": stalls.get("save-checkpoint-non-persistent", []),
              "async_save_stall_seconds": stalls.get("save-checkpoint", []), "replication": replicated,
              "table": table, "ratios": ratios, "checks": checks, "steps": steps}
    print(f"\nlocal save stall {stalls.get('save-checkpoint-non-persistent')} s, async save stall "
          f"{stalls.get('save-checkpoint')} s; checks {checks}")
    print(f"{'case':8s} {'load-checkpoint':>16s} {'first step':>11s} {'- noload':>9s} {'launch':>8s} "
          f"{'from storage':>13s}")
    for case, t in table.items():
        print(f"{case:8s} {t.get('load_checkpoint_seconds_median', float('nan')):15.2f}s "
              f"{t['first_step_seconds_median']:10.1f}s {t['first_step_minus_noload_seconds']:8.1f}s "
              f"{t['launch_seconds_median']:7.1f}s "
              f"{t['bytes_from_storage_median'] / 2**20:9.1f} MiB")
    print("ratios " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if all(checks.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--storage-mbit", type=int, default=40)
    ap.add_argument("--node-mbit", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=600, help="per launch, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--local-tier", action="store_true",
                    help="instead: the restart from the local tier (own, a peer's replica) against storage")
    ap.add_argument("--tier-cases", default=",".join(TIER_CASES))
    ap.add_argument("--shm-mb", type=int, default=512, help="each node's /dev/shm (--local-tier)")
    a = ap.parse_args()
    a.tier_cases = [m for m in a.tier_cases.split(",") if m]
    if [m for m in a.tier_cases if m not in TIER_CASES]:
        ap.error(f"--tier-cases: choose from {','.join(TIER_CASES)}")
    a.cases = [m for m in a.cases.split(",") if m]
    bad = [m for m in a.cases if m not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {','.join(CASES)}")
    return _host(a)


if __name__ == "__main__":
    sys.exit(main())
