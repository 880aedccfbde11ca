"""scripts/plot_bench.py draws the documentation's figures from the benchmarks' JSON: the values in
the pictures are the medians in the JSON, and every figure is well-formed SVG."""
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "docs", "megatron-bench", "run-2025")


def test_figures_show_the_json_medians(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_bench.py"), "--run", RUN,
                    "--scale", os.path.join(ROOT, "docs", "scale"), "--out", str(tmp_path)], check=True, cwd=ROOT)
    texts = {}
    for name in ("megatron-save.svg", "megatron-load.svg", "scale-bytes.svg", "s3.svg"):
        tree = ET.parse(tmp_path / name)  # well-formed
        texts[name] = [t.text for t in tree.iter("{http://www.w3.org/2000/svg}text")]
    with open(os.path.join(RUN, "tp2_adam.json")) as f:
        d = json.load(f)
    for name, key in (("megatron-save.svg", "save_checkpoint_s"), ("megatron-load.svg", "load_checkpoint_s")):
        for fmt in ("tensors", "torch_dist"):
            assert f"{d[key][fmt]['median']:.3g} s" in texts[name], (name, fmt)
    assert "8L h1024, TP=2, Adam" in texts["megatron-save.svg"]
    scale_rows = [t for t in texts["scale-bytes.svg"] if t and "ranks)" in t]
    assert len(scale_rows) == len([p for p in glob.glob(os.path.join(ROOT, "docs", "scale", "*.json"))
                                   if os.path.getsize(p)])
    with open(os.path.join(ROOT, "docs", "bench-s3.json")) as f:
        s3 = json.load(f)
    for case in ("megashard_save", "megashard_load_own", "tensorizer_load"):
        assert f"{s3['results'][case]['GBps']:.3g} GB/s" in texts["s3.svg"], case
