"""The trial processes' fork server as a copy of the worker (hpo/trial/worker_copy.py): used
where it is safe, multiprocessing's own server everywhere else, and the private state of
multiprocessing it relies on checked on the Python that runs the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpo.trial import worker_copy

# A worker in miniature: a module with a value the worker changes before the copy is made
# (a server started afresh imports it anew), and a trial process that reports what it sees.
MARK_MODULE = """
import os
import signal

VALUE = "as imported"


def report(conn):
    conn.send((VALUE, os.getppid(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL))
"""
WORKER = """
import _thread, multiprocessing, os, signal, sys, threading, time
import copymark
from hpo.trial import worker_copy

mode, note = sys.argv[1], sys.argv[2]
before = worker_copy.native_threads()  # what runs after hpo's imports
copymark.VALUE = "set in the worker"
if mode == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True, name="busy").start()
if mode == "native":  # a thread Python's threading module does not know (an OpenMP pool's)
    _thread.start_new_thread(time.sleep, (60,))
if mode == "handler":
    signal.signal(signal.SIGTERM, lambda *_: open(note, "w").write("the worker's handler ran"))
context = multiprocessing.get_context("forkserver")
print("why not:", worker_copy.why_not_copy(before), flush=True)
print("copied:", worker_copy.start_as_copy(["copymark"], before), flush=True)
server = multiprocessing.forkserver._forkserver._forkserver_pid
print("server:", server, flush=True)
if server is not None:
    time.sleep(0.2)  # the copy names itself as it starts
    print("server name:", open(f"/proc/{server}/comm").read().strip(), flush=True)
if mode == "handler":  # a SIGTERM to the process group reaches the server too
    os.kill(server, signal.SIGTERM)
    while open(f"/proc/{server}/stat").read().split()[2] != "Z":
        time.sleep(0.05)
ours, theirs = context.Pipe()
process = context.Process(target=copymark.report, args=(theirs,))
process.start()
print("trial:", ours.recv(), flush=True)
process.join()
print("exit:", process.exitcode, flush=True)
"""


def _run_worker(tmp_path: Path, mode: str) -> dict[str, str]:
    (tmp_path / "copymark.py").write_text(MARK_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), mode, str(tmp_path / "note")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    return lines


def _gone(pid: int, within_s: float = 10) -> bool:
    """Exited (or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_multiprocessing_is_as_the_copy_expects() -> None:
    """Fails on a Python whose forkserver changed (3.14 adds a key): worker_copy.py must be
    checked against it, or every worker would start its server afresh again, seconds slower."""
    assert worker_copy.internals_problem() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_the_server_is_a_copy_of_the_worker_and_ends_with_it(tmp_path: Path) -> None:
    lines = _run_worker(tmp_path, "plain")
    assert lines["why not"] == "None" and lines["copied"] == "True"
    value, parent, default_sigterm = eval(lines["trial"])
    # The trial process came from the copy: what the worker set is there, nothing was reloaded.
    assert value == "set in the worker" and parent == int(lines["server"]) and default_sigterm
    assert lines["server name"] == "hpo-forkserver"  # in `ps -e` and `top`, not a second worker
    assert lines["exit"] == "0"
    assert _gone(int(lines["server"])), "the copy outlived its worker"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_no_copy_of_a_worker_running_threads(tmp_path: Path) -> None:
    """A copy holds only the forking thread: a lock another thread held stays locked in it."""
    lines = _run_worker(tmp_path, "thread")
    assert lines["why not"] == "threads run here (busy)" and lines["copied"] == "False"
    value, _, _ = eval(lines["trial"])
    assert value == "as imported" and lines["exit"] == "0"  # multiprocessing's own server


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_no_copy_once_the_user_s_code_started_a_native_thread(tmp_path: Path) -> None:
    """torch's OpenMP pool, made by its first parallel op, hangs a forked child that uses it."""
    lines = _run_worker(tmp_path, "native")
    assert (
        lines["why not"] == "1 native thread(s) started since hpo's imports (by the user's modules)"
    )
    assert lines["copied"] == "False" and eval(lines["trial"])[0] == "as imported"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_the_worker_s_signal_handlers_do_not_run_in_the_copy(tmp_path: Path) -> None:
    """A SIGTERM to the process group ends the copy as it ends a server started afresh; the
    next trial process gets a server started afresh."""
    lines = _run_worker(tmp_path, "handler")
    assert lines["copied"] == "True"
    assert not (tmp_path / "note").exists(), (tmp_path / "note").read_text()
    value, parent, _ = eval(lines["trial"])
    assert value == "as imported" and parent != int(lines["server"]) and lines["exit"] == "0"


def test_a_loaded_cuda_driver_rules_the_copy_out(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f0 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n")
    assert not worker_copy.cuda_driver_loaded(str(maps))  # NVML's library is not the driver
    maps.write_text(maps.read_text() + "7f1 r-xp 00000000 08:01 2 /usr/lib/libcuda.so.550.54\n")
    assert worker_copy.cuda_driver_loaded(str(maps))
    assert worker_copy.cuda_driver_loaded(str(tmp_path / "missing"))  # cannot tell: no copy
