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


def test_torchrun_runs_again_when_another_process_took_its_port(tmp_path, monkeypatch):
    """The port the runner picked is taken before torchrun binds it (a shared machine): the launch
    is run again on another port instead of failing the test that asked for it."""
    import socket

    sys.path.insert(0, TESTS)
    from megatron_helpers import runner

    script = tmp_path / "hello.py"  # each rank leaves a file (their output may interleave)
    script.write_text(f"import os, pathlib\npathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).touch()\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = runner.free_port
        monkeypatch.setattr(runner, "free_port", lambda: ports.pop() if ports else real())
        run = runner.torchrun(str(script), [], nproc=2, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    assert (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists(), run.output[-3000:]
    assert not ports
