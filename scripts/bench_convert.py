"""Throughput and peak memory of ``megashard convert`` and ``load_consolidated``, one fresh process each.

    python scripts/bench_convert.py [--gb 1.0] [--dir /tmp/megashard-bench-convert]
    python scripts/bench_convert.py --hf [--gb 1.0]   # Hugging Face import / export against a raw floor

Builds a megashard checkpoint of ``--gb`` GB (bf16 weights saved as TP=2 halves, plus fp32
distributed-optimizer state saved as flattened DP=2 ranges), then runs each direction in a
fresh Python process and reports seconds, GB/s and memory: peak RSS (``VmHWM``, which also
counts file pages mapped by the process), peak anonymous RSS (``RssAnon`` sampled every
5 ms: the memory the process itself allocated) and the largest child's peak RSS
(megatron-core may write from child processes). Timings are for reporting only.

``--hf``: a Llama-shaped Hugging Face directory of ``--gb`` GB (bf16, written tensor by
tensor), then ``hf_import`` (HF -> megashard), ``hf`` (megashard -> HF safetensors shards),
``hf_tensors`` (one HF-named ``.tensors`` file) and ``floor``: a plain read + write + fsync of
the same bytes (the source safetensors files copied in 64 MiB chunks), each in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

WORKER = r"""
import json, os, resource, sys, threading, time
peak = {"anon": 0}
def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak["anon"] = max(peak["anon"], anon())
        stop.wait(0.005)
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
import torch, megashard
from megashard.convert import convert
base_anon = anon()
th = threading.Thread(target=sample, daemon=True); th.start()
what, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if what == "floor":  # raw read + write of the same bytes: the floor any conversion pays
    nbytes = 0
    os.makedirs(dst)
    buf = bytearray(64 << 20)
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(src, name), "rb", buffering=0) as fi, open(os.path.join(dst, name), "wb") as fo:
            while True:
                n = fi.readinto(buf)
                if not n:
                    break
                fo.write(memoryview(buf)[:n])
                nbytes += n
            fo.flush(); os.fsync(fo.fileno())
elif what == "hf_import":
    nbytes = convert(src, dst, progress=False).bytes
elif what in ("hf", "hf_tensors"):
    nbytes = convert(src, dst, to="hf", hf_tensors=what == "hf_tensors", progress=False).bytes
elif what == "load_consolidated":
    out, stats = megashard.load_consolidated(src, return_stats=True)
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    assert stats.bytes_read == nbytes, (stats.bytes_read, nbytes)  # read == needed
else:
    nbytes = convert(src, dst, to=what, progress=False).bytes
dt = time.perf_counter() - t0
stop.set(); th.join()
peak["anon"] = max(peak["anon"], anon())
print(json.dumps({"what": what, "seconds": dt, "bytes": nbytes, "vmhwm": hwm(), "anon_peak": peak["anon"],
                  "anon_at_start": base_anon,
                  "child_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def build(path: str, gb: float) -> int:
    import torch

    import megashard
    from megashard.sharded import ShardedTensor

    rows = 4096
    cols = 4096
    per = rows * cols * 2  # bf16 weight bytes
    n = max(1, int(gb * 1e9 / (per * 3)))  # weight (bf16) + exp_avg (fp32 = 2x)
    sd = {"model": {}, "optimizer": {}, "iteration": 100, "args": argparse.Namespace(lr=1e-4)}
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        w = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        key = f"decoder.layers.{i}.mlp.linear_fc1.weight"
        for tp in range(2):
            sd["model"][f"{i}.{tp}"] = ShardedTensor(key, w[tp * rows // 2:(tp + 1) * rows // 2].clone(),
                                                     (rows, cols), (tp * rows // 2, 0))
        flat = w.float().reshape(-1)
        half = flat.numel() // 2
        for dp in range(2):
            sd["optimizer"][f"{i}.{dp}"] = ShardedTensor(
                f"optimizer.state.exp_avg.{key}", flat[dp * half:(dp + 1) * half].clone(), (rows, cols), (0, 0),
                local_shape=(rows, cols), dtype=torch.float32, flattened_range=slice(dp * half, (dp + 1) * half))
        del w, flat
    megashard.save(sd, path)
    return n * per * 3


def build_hf(path: str, gb: float) -> int:
    """A Llama-shaped HF directory (hidden 2048, ffn 5632, 16 heads, 4 groups, vocab 32000, bf16)."""
    import json

    import torch

    from megashard.hf.importer import expected
    from megashard.hf.mapping import spec_from_hf_config
    from megashard.hf.safetensors import SafetensorsWriter

    h, f, v = 2048, 5632, 32000
    per_layer = 2 * (h * h + 2 * (h // 4) * h + h * h + 3 * f * h + 2 * h)
    layers = max(1, int((gb * 1e9 - 4 * v * h) / per_layer))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": f,
           "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": v,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16"}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    specs = [(n, torch.bfloat16, s) for n, s in expected(spec_from_hf_config(cfg, path))]
    w = SafetensorsWriter(os.path.join(path, "model.safetensors"), specs)
    g = torch.Generator().manual_seed(0)
    total = 0
    for n, d, s in specs:
        t = torch.randn(s, generator=g).to(d)
        w.write(n, t)
        total += t.numel() * t.element_size()
    w.close()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/megashard-bench-convert")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--hf", action="store_true", help="Hugging Face import/export against the raw floor")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    src = os.path.join(a.dir, "src")
    if a.hf:
        model = build_hf(src, a.gb)
        print(f"Hugging Face directory: {model / 1e9:.2f} GB of bf16 tensors")
        runs = [("floor", src, "floor"), ("hf_import", src, "ms"), ("hf", "ms", "hf"),
                ("hf_tensors", "ms", "hft")]
    else:
        model = build(src, a.gb)
        print(f"checkpoint: {model / 1e9:.2f} GB of tensors, largest global tensor "
              f"{4096 * 4096 * 4 / 1e6:.0f} MB (fp32 exp_avg)")
        runs = [("tensors", src, "out.tensors"), ("safetensors", src, "out.safetensors"),
                ("torch_dist", src, "td"), ("megashard", "td", "back"), ("load_consolidated", src, "-")]
    results = []
    for rep in range(a.repeat):
        for what, s, d in runs:
            s = s if os.path.isabs(s) else os.path.join(a.dir, s)
            dst = os.path.join(a.dir, f"{d}.{rep}") if d != "-" else "-"
            if what == "megashard":
                s = os.path.join(a.dir, f"td.{rep}")
            if what in ("hf", "hf_tensors"):
                s = os.path.join(a.dir, f"ms.{rep}")
            r = subprocess.run([sys.executable, "-c", WORKER, what, s, dst], capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-3000:])
                raise SystemExit(f"{what} failed")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            results.append(res)
            print(f"{what:>18}: {res['seconds']:6.2f} s  {res['bytes'] / res['seconds'] / 1e9:5.2f} GB/s  "
                  f"peak RSS {res['vmhwm'] / 1e6:7.0f} MB  peak anon {res['anon_peak'] / 1e6:7.0f} MB "
                  f"(at start {res['anon_at_start'] / 1e6:.0f})  child max RSS {res['child_maxrss'] / 1e6:.0f} MB",
                  flush=True)
            if d not in ("-", "td", "ms"):
                p = os.path.join(a.dir, f"{d}.{rep}")
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.exists(p) and os.unlink(p)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
