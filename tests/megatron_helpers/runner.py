"""Run ``examples/pretrain_gpt.py`` (or another script) under torchrun and parse its output."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torchrun_ports import PORT_TRIES, free_port, port_taken  # noqa: F401  (tests use runner.PORT_TRIES)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "pretrain_gpt.py")
TESTS = os.path.join(REPO, "tests")
FAST_EXIT = "megatron_helpers.fast_exit"

#: tiny, fast defaults shared by every test run (CPU, 2 ranks)
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--save-format", "tensors"]


@dataclass
class Run:
    args: List[str]
    returncode: int
    output: str
    losses: Dict[int, float] = field(default_factory=dict)
    lrs: Dict[int, float] = field(default_factory=dict)
    started: Optional[str] = None
    digests: Dict[str, str] = field(default_factory=dict)     # "start" / "saved@N" -> params digest
    rng: Dict[str, str] = field(default_factory=dict)         # "start" / "saved@N" -> rng digest

    def check(self) -> "Run":
        assert self.returncode == 0, f"run failed ({self.returncode}): {' '.join(self.args)}\n{self.output[-6000:]}"
        return self


def parse(args: List[str], rc: int, out: str) -> Run:
    r = Run(args, rc, out)
    for line in out.splitlines():
        m = re.match(r"iteration (\d+) \| loss (\S+) \| lr (\S+)", line)
        if m:
            r.losses[int(m.group(1))] = float(m.group(2))
            r.lrs[int(m.group(1))] = float(m.group(3))
        if line.startswith("started from"):
            r.started = line
        m = re.match(r"params-digest (\w+) \| rng-digest (\w+)", line)
        if m:
            r.digests["start"], r.rng["start"] = m.group(1), m.group(2)
        # the state a save took: "saved checkpoint ..." (sync), "save started ..." (--async-save, at the snapshot)
        m = re.match(r"(?:saved checkpoint|save started) at iteration (\d+) .*params-digest (\w+) \| rng-digest (\w+)",
                     line)
        if m:
            r.digests[f"saved@{m.group(1)}"], r.rng[f"saved@{m.group(1)}"] = m.group(2), m.group(3)
    return r


def torchrun(script: str, args: List[str], nproc: int = 2, timeout: int = 240,
             env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> Run:
    """``python -m torch.distributed.run --nproc-per-node N script args`` on loopback; the launcher and
    its ranks end without the interpreter's teardown (``megatron_helpers.fast_exit`` says why).

    The free port is free when picked, not when torchrun binds it: on a shared machine another
    process may take it in between. A launch whose rendezvous could not listen is run again on
    another port (nothing of the script ran), at most :data:`PORT_TRIES` times."""
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(
        p for p in (REPO, TESTS, e.get("PYTHONPATH")) if p)})
    if env:
        e.update(env)
    for _ in range(PORT_TRIES):
        cmd = [sys.executable, "-m", FAST_EXIT, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", FAST_EXIT, script, *args]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=e, cwd=cwd or REPO)
        if not (p.returncode != 0 and port_taken(p.stdout)):
            break
    return parse(cmd, p.returncode, p.stdout)


def pretrain(args: List[str], nproc: int = 2, **kw) -> Run:
    """Run the example with the tiny defaults plus ``args``."""
    return torchrun(EXAMPLE, [*TINY, *args], nproc=nproc, **kw)


def compare_checkpoints(a: str, b: str, prefixes: Optional[List[str]] = None) -> Dict[str, object]:
    """Global tensors of two megashard checkpoints, compared bit for bit (in this process)."""
    from megatron_helpers.ckpt_compare import compare

    return compare(a, b, prefixes)
