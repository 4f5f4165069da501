"""The trial processes' fork server as a copy of the worker (hpo/trial/worker_copy.py): used
where it is safe, multiprocessing's own server everywhere else, and the private state of
multiprocessing it relies on checked on the Python that runs the tests."""

from __future__ import annotations

import os
import shutil
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
    nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    alarm_blocked = signal.SIGALRM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    conn.send((VALUE, os.getppid(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, nvml,
               alarm_blocked))
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
worker_copy.use_nvml_for_cuda_checks()
print("why not:", worker_copy.why_not_copy(before), flush=True)
print("copied:", worker_copy.start_as_copy(before), flush=True)
print("nvml here:", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), flush=True)
server = multiprocessing.forkserver._forkserver._forkserver_pid
print("server:", server, flush=True)
deadline = time.monotonic() + 30
while server is not None and time.monotonic() < deadline:  # the copy names itself as it starts
    name = open(f"/proc/{server}/comm").read().strip()
    if name == "hpo-forkserver":
        break
    time.sleep(0.05)
if server is not None:
    print("server name:", name, flush=True)
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
    env.pop(worker_copy.FORK_SERVER_ENV, None)  # a developer's HPO_FORK_SERVER=fresh
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), mode, str(tmp_path / "note")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


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
    assert lines["why not"] == "None"
    assert lines["copied"] == "True"
    value, parent, default_sigterm, nvml, alarm_blocked = eval(lines["trial"])
    # The trial process came from the copy: what the worker set is there, nothing was reloaded.
    assert value == "set in the worker" and parent == int(lines["server"]) and default_sigterm
    assert not alarm_blocked  # blocked only for the fork: the user's signal.alarm works
    # NVML answers the worker's CUDA check only until the copy: trial processes ask torch's own.
    assert nvml is None and lines["nvml here"] == "None"
    assert lines["server name"] == "hpo-forkserver"  # in `ps -e` and `top`, not a second worker
    assert lines["exit"] == "0"
    assert _gone(int(lines["server"])), "the copy outlived its worker"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_no_copy_of_a_worker_running_threads(tmp_path: Path) -> None:
    """A copy holds only the forking thread: a lock another thread held stays locked in it."""
    lines = _run_worker(tmp_path, "thread")
    assert lines["why not"] == "threads run here (busy)" and lines["copied"] == "False"
    value, _, _, nvml, _ = eval(lines["trial"])
    assert value == "as imported" and lines["exit"] == "0"  # multiprocessing's own server
    assert nvml is None and lines["nvml here"] == "None"  # set only until the copy, made or not


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
    value, parent, *_ = eval(lines["trial"])
    assert value == "as imported" and parent != int(lines["server"]) and lines["exit"] == "0"


class _Driver:
    """A CUDA driver as ctypes opens it: cuCtxGetCurrent answers `answer`."""

    def __init__(self, answer: int) -> None:
        self.answer = answer

    def cuCtxGetCurrent(self, context: object) -> int:  # noqa: N802 (the driver's name)
        return self.answer


def test_only_an_initialised_cuda_driver_rules_the_copy_out(tmp_path: Path) -> None:
    """The driver's library mapped is not CUDA initialised (a GPU host maps it on imports):
    the driver is asked; any answer but 'not initialised', or none, rules the copy out."""
    maps = tmp_path / "maps"
    maps.write_text("7f0 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n")
    opened: list[str] = []

    def driver(answer: int):  # type: ignore[no-untyped-def]
        return lambda path: opened.append(path) or _Driver(answer)

    assert worker_copy.cuda_initialised(str(maps), driver(0)) is None  # NVML is not the driver
    assert opened == []
    maps.write_text(maps.read_text() + "7f1 r-xp 00000000 08:01 2 /usr/lib/libcuda.so.550.54\n")
    assert worker_copy.cuda_initialised(str(maps), driver(3)) is None
    assert opened == ["/usr/lib/libcuda.so.550.54"]
    assert "initialised here (cuCtxGetCurrent gave 0)" in str(
        worker_copy.cuda_initialised(str(maps), driver(0))
    )
    assert "gave 100" in str(worker_copy.cuda_initialised(str(maps), driver(100)))

    def not_loaded(path: str) -> None:
        raise OSError(f"{path}: cannot open shared object file")

    assert "could not say" in str(worker_copy.cuda_initialised(str(maps), not_loaded))
    assert "unreadable" in str(worker_copy.cuda_initialised(str(tmp_path / "missing")))


# A driver in miniature, built as a shared library named as the real one: not initialised
# until cuInit, as cuda.h documents every call.
FAKE_DRIVER = """
static int initialised = 0;
int cuInit(unsigned int flags) { initialised = 1; return 0; }
int cuCtxGetCurrent(void **context) { if (!initialised) return 3; *context = 0; return 0; }
"""
ASK_DRIVER = """
import ctypes, sys
from hpo.trial import worker_copy
print(worker_copy.cuda_initialised())
driver = ctypes.CDLL(sys.argv[1])
print(worker_copy.cuda_initialised())
driver.cuInit(0)
print(worker_copy.cuda_initialised())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps: Linux")
def test_a_loaded_driver_is_asked_through_the_library_already_loaded(tmp_path: Path) -> None:
    """In a process of its own (a driver loaded stays loaded): no driver, then one loaded and
    not initialised, may be copied; once cuInit ran, not."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a driver in miniature")
    (tmp_path / "driver.c").write_text(FAKE_DRIVER)
    library = tmp_path / "libcuda.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "driver.c")], check=True
    )
    done = subprocess.run(
        [sys.executable, "-c", ASK_DRIVER, str(library)], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines() == [
        "None",
        "None",
        "the CUDA driver is initialised here (cuCtxGetCurrent gave 0)",
    ]


def test_only_a_worker_that_is_the_hpo_command_alone_copies_itself() -> None:
    """hpo.run's process, or a test calling main() in its own, may have run torch's OpenMP pool
    or a thread of its own: their trial processes' fork server starts afresh."""
    from types import SimpleNamespace
    from typing import Any

    from hpo.commands.requests import RunRequest
    from hpo.commands.run import copies_itself

    def config(isolation: str) -> Any:
        return SimpleNamespace(study=SimpleNamespace(trial_isolation=isolation))

    command, in_a_user_process = RunRequest("s", own_process=True), RunRequest("s")
    assert copies_itself(command, config("process"), [], None)
    assert copies_itself(command, config("process"), ["0"], 1)
    assert not copies_itself(in_a_user_process, config("process"), [], None)
    assert not copies_itself(RunRequest("s", own_process=False), config("process"), [], None)
    assert not copies_itself(command, config("none"), [], None)  # no trial processes
    assert not copies_itself(command, config("process"), ["0", "1"], None)  # a launcher
    assert not copies_itself(command, config("process"), ["0"], 2)
    assert not copies_itself(command, config("process"), ["0"], "auto")  # decided by the data
