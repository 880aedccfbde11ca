"""``megatron_helpers.fast_exit`` (how the Megatron tests end their launchers and ranks) keeps what a
program and its launcher observe: exit status, atexit handlers, joined threads, flushed output."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

PROGRAM = r"""
import atexit, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=False))
def late():
    time.sleep(0.2)
    print("thread joined")
threading.Thread(target=late).start()
print("argv", sys.argv[1:], "main", __name__, "path0", sys.path[0] == HERE)
sys.stdout.write("unflushed")
MODE
"""


@pytest.mark.parametrize("mode, status, err", [
    ("pass", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit('bad input')", 1, "bad input"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_fast_exit_keeps_status_atexit_threads_and_output(tmp_path, mode, status, err):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("MODE", mode).replace("HERE", repr(str(tmp_path))))
    p = subprocess.run([sys.executable, "-m", "megatron_helpers.fast_exit", str(script), "--x", "1"],
                       capture_output=True, text=True, timeout=60, cwd=TESTS)
    assert p.returncode == status, p.stderr
    assert p.stdout == "argv ['--x', '1'] main __main__ path0 True\nunflushedthread joined\natexit ran\n"
    assert err in p.stderr


def test_fast_exit_runs_a_module(tmp_path):
    (tmp_path / "modprog.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, str(tmp_path)]))
    p = subprocess.run([sys.executable, "-m", "megatron_helpers.fast_exit", "-m", "modprog", "a"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert (p.returncode, p.stdout) == (4, "__main__ ['a']\n"), p.stderr
