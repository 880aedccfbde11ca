#!/usr/bin/env python
"""Draw the headline benchmark figures as SVG from the benchmarks' JSON (no plotting library needed).

Inputs (written by the benchmark scripts with ``--json``):

* ``docs/megatron-bench/<run>/*.json`` from ``scripts/bench_megatron.py``: Megatron-LM's own
  ``save-checkpoint`` / ``load-checkpoint`` timers for megashard (``tensors``) and ``torch_dist``,
  and the raw ``pwrite`` / ``preadv`` floor of the same bytes;
* ``docs/scale/*.json`` from ``scripts/simulate_scale.py --json``: bytes per rank against ranks;
* ``docs/bench-s3.json`` from ``scripts/bench_s3.py``: S3 save and load GB/s against tensorizer and the floor.

Outputs: ``docs/img/megatron-save.svg``, ``docs/img/megatron-load.svg``, ``docs/img/scale-bytes.svg``,
``docs/img/s3.svg``.

Usage: ``python scripts/plot_bench.py [--run docs/megatron-bench/run-2025] [--out docs/img]``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from html import escape
from typing import Dict, List, Sequence, Tuple

COLORS = ("#2b6cb0", "#c05621", "#718096", "#2f855a")
BAR_H, LEFT, WIDTH = 9, 360, 880


def _config_label(cfg: Dict) -> str:
    """'8L h1024, TP=2, DistOpt SwiGLU' — the README table's row names."""
    par = f"TP={cfg['tp']}" if cfg["pp"] == 1 else f"TP={cfg['tp']} PP={cfg['pp']}·VP={cfg['vp']}"
    opt = "DistOpt" if cfg["distributed_optimizer"] else "Adam"
    return f"{cfg['layers']}L h{cfg['hidden']}, {par}, {opt}{' SwiGLU' if cfg['swiglu'] else ''}"


def _num(v: float) -> str:
    return f"{v:.3g}" if v < 100 else f"{v:,.0f}"


def grouped_bars(title: str, unit: str, rows: Sequence[str], series: Dict[str, Sequence[float]],
                 note: str = "") -> str:
    """A horizontal grouped bar chart: one group per row, one bar per series, value printed at its end."""
    names = list(series)
    group_h = BAR_H * len(names) + 8
    top = 40 + 18 * len(names)
    height = top + group_h * len(rows) + (34 if note else 16)
    vmax = max(v for vals in series.values() for v in vals) or 1.0
    scale = (WIDTH - LEFT - 70) / vmax
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>']
    for i, name in enumerate(names):
        y = 32 + 18 * i
        out.append(f'<rect x="{LEFT}" y="{y}" width="12" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{LEFT + 18}" y="{y + 9}">{escape(name)}</text>')
    for r, row in enumerate(rows):
        y0 = top + r * group_h
        out.append(f'<text x="{LEFT - 8}" y="{y0 + group_h / 2 + 2}" text-anchor="end">{escape(row)}</text>')
        for i, name in enumerate(names):
            v = series[name][r]
            y = y0 + i * BAR_H
            out.append(f'<rect x="{LEFT}" y="{y}" width="{max(v * scale, 1):.1f}" height="{BAR_H - 1}" '
                       f'fill="{COLORS[i % len(COLORS)]}"/>')
            out.append(f'<text x="{LEFT + v * scale + 4:.1f}" y="{y + BAR_H - 1}" font-size="9">'
                       f'{_num(v)} {escape(unit)}</text>')
    if note:
        out.append(f'<text x="10" y="{height - 10}" font-size="10" fill="#4a5568">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def megatron_charts(run_dir: str) -> Tuple[str, str]:
    """Save and load seconds per configuration: megashard, torch_dist, raw floor."""
    runs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        if d["config"]["hidden"] >= 1024:  # the README's rows
            runs.append(d)
    runs.sort(key=lambda d: (d["config"]["pp"], d["config"]["distributed_optimizer"], d["config"]["swiglu"]))
    rows = [_config_label(d["config"]) for d in runs]
    med = lambda d, k, f: d[k][f]["median"]  # noqa: E731
    note = f"Megatron-LM pretrain_gpt.py timers, 2 gloo ranks, fp32, medians; {os.path.basename(run_dir)}"
    save = grouped_bars("Save (s, lower is better)", "s", rows, {
        "megashard (--save-format tensors)": [med(d, "save_checkpoint_s", "tensors") for d in runs],
        "torch_dist": [med(d, "save_checkpoint_s", "torch_dist") for d in runs],
        "raw floor: pwrite + fsync of the same bytes": [d["save_raw_floor_s"]["first"]["median"] for d in runs],
    }, note)
    load = grouped_bars("Load (s, lower is better)", "s", rows, {
        "megashard": [med(d, "load_checkpoint_s", "tensors") for d in runs],
        "torch_dist": [med(d, "load_checkpoint_s", "torch_dist") for d in runs],
        "raw floor: preadv of the same bytes": [d["load_raw_floor_s"]["median"] for d in runs],
    }, note)
    return save, load


def other_ranks_recv(run: Dict) -> Dict[str, int]:
    """Largest message a rank other than the coordinator receives, per phase: the simulator's
    ``max_other_rank_recv_bytes`` (since the steady-state commit; ``max_rank_recv_bytes`` is then the
    busiest rank's total), earlier JSON kept these per phase under ``max_rank_recv_bytes``."""
    return run.get("max_other_rank_recv_bytes", run["max_rank_recv_bytes"])


def scale_chart(scale_dir: str) -> str:
    """Bytes a rank exchanges and reads against the number of ranks: flat is the goal."""
    runs: List[Dict] = []
    for path in sorted(glob.glob(os.path.join(scale_dir, "*.json"))):
        with open(path) as f:
            text = f.read().strip()
        if text:
            runs.append(json.loads(text))
    runs.sort(key=lambda d: (d["model"], d["world"]))
    rows = [f"{d['model']} {d['layout']} ({d['world']:,} ranks)" for d in runs]
    kib = lambda n: n / 1024  # noqa: E731
    return grouped_bars("Per-rank metadata traffic vs job size (KiB, flat is the goal)", "KiB", rows, {
        "largest message a rank receives (plan)": [kib(other_ranks_recv(d)["save/plan"]) for d in runs],
        "largest message a rank sends (commit)": [kib(d["max_rank_send_bytes"]["save/commit"]) for d in runs],
        "index bytes a loading rank reads": [kib(d["rank_index_read_bytes"]) for d in runs],
    }, "scripts/simulate_scale.py --distributed-optimizer --json; bytes, not seconds (independent of machine load)")


def s3_chart(path: str) -> str:
    """GB/s of one ``scripts/bench_s3.py`` run (medians): megashard, tensorizer's S3 path and the
    best plain-HTTP floor, for save (default and CRC32-only headers) and load."""
    with open(path) as f:
        d = json.load(f)
    r, summ = d["results"], d["summary"]
    rows = ["save", "save, CRC32-only headers", "load"]
    floor_save, floor_load = r[summ["save"]["floor"]]["GBps"], r[summ["load"]["floor"]]["GBps"]
    return grouped_bars(f"S3 (SeaweedFS, {d['mib']} MiB, one rank): GB/s, higher is better", "GB/s", rows, {
        "megashard": [r["megashard_save"]["GBps"], r["megashard_save_crc32"]["GBps"], r["megashard_load_own"]["GBps"]],
        "tensorizer": [r["tensorizer_save"]["GBps"], r["tensorizer_save"]["GBps"], r["tensorizer_load"]["GBps"]],
        "floor (best of 1-32 plain streams)": [floor_save, floor_save, floor_load],
    }, note=f"{d['date']}: client and server share {d['host']['cpus']} CPUs; medians of {d['reps']} rounds; "
            "docs/bench-s3.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="docs/megatron-bench/run-2025")
    ap.add_argument("--scale", default="docs/scale")
    ap.add_argument("--s3", default="docs/bench-s3.json")
    ap.add_argument("--out", default="docs/img")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    save, load = megatron_charts(a.run)
    charts = {"megatron-save.svg": save, "megatron-load.svg": load}
    if glob.glob(os.path.join(a.scale, "*.json")):
        charts["scale-bytes.svg"] = scale_chart(a.scale)
    if os.path.exists(a.s3):
        charts["s3.svg"] = s3_chart(a.s3)
    for name, svg in charts.items():
        with open(os.path.join(a.out, name), "w") as f:
            f.write(svg)
        print(os.path.join(a.out, name))


if __name__ == "__main__":
    main()
