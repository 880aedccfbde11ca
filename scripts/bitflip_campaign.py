"""The long bit-flip campaign: 1,000 random single-bit flips over every file of a checkpoint
(own mode, `megashard verify` and `load(verify=True)`), plus flips in scatter mode with two
pipeline stages on one node (shm and process-group transports). CI runs a few hundred.

    python scripts/bitflip_campaign.py [--own 1000] [--scatter 100]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--own", type=int, default=1000)
    ap.add_argument("--scatter", type=int, default=100)
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MEGASHARD_BITFLIPS=str(a.own), MEGASHARD_SCATTER_BITFLIPS=str(a.scatter))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", os.path.join(root, "tests", "test_hostile.py"),
                            "-k", "bit_flip"], env=env, cwd=root)


if __name__ == "__main__":
    sys.exit(main())
