"""The trial processes' fork server made by forking the worker itself, where that is safe: it
then shares what the worker loaded (torch, transformers, hpo) instead of loading it again.

A fork server that multiprocessing starts is a new interpreter that imports torch and
transformers once more: 5-6 s of CPU and a few hundred MB per worker, before its first trial.
The worker has loaded all of that by the time it has checked its inputs. A copy of it made
then, before it opens the study or starts a thread, is the same server at no cost. A copy is
made only while CUDA is not initialised in this process (a child of a process that initialised
it cannot use CUDA; torch.cuda.is_available() is answered by NVML here, which does not),
runs no Python thread but this one (a copy holds only the forking thread: a lock another
thread held stays locked in it), and no native thread the user's modules started (torch's
OpenMP pool hangs a forked child that uses it). Otherwise, and wherever a check below fails,
the first trial process starts the server as multiprocessing does.

multiprocessing has no public way to take a server it did not start: its ForkServer's three
private fields are set here and nowhere else, and only where they and forkserver.main are as
written for (Python 3.10 to 3.13, each checked). tests/test_worker_copy.py fails on a Python
where they are not, so that an upgrade is noticed rather than silently slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import inspect
import logging
import os
import signal
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any, cast

from hpo.trial.protocol import FORK_SERVER_NAME, name_this_process

log = logging.getLogger(__name__)

# HPO_FORK_SERVER=fresh: always the server multiprocessing starts (to compare, or to rule the
# copy out while looking into a problem).
FORK_SERVER_ENV = "HPO_FORK_SERVER"
# What NVML-based availability checks need (torch reads it at each call): set before torch is
# asked, torch.cuda.is_available() does not load the CUDA driver in the worker.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
# The private state of multiprocessing's ForkServer this module writes, and forkserver.main's
# parameters, as Python 3.10 to 3.13 have them (3.14 adds an authentication key).
SERVER_FIELDS = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"}
MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
# Whether use_nvml_for_cuda_checks set the variable (it then removes it after the copy).
_nvml_set_here: list[bool] = []
# Preloaded by a server started afresh, never imported by the worker: it makes its importer's
# exit skip every atexit hook (a copy of the worker ends in os._exit without it).
SERVER_ONLY_MODULES = {"hpo.trial.fork_server"}
# What every CUDA driver call answers before cuInit (cuda.h's CUresult).
CUDA_ERROR_NOT_INITIALIZED = 3


def use_nvml_for_cuda_checks() -> None:
    """Before the worker asks torch whether CUDA is there, until the copy is made (a user's
    own setting is kept). Not for longer: NVML sees a GPU that CUDA may not be able to use (a
    driver older than torch's CUDA), and only torch's own check says so."""
    if NVML_CHECK_ENV not in os.environ:
        os.environ[NVML_CHECK_ENV] = "1"
        _nvml_set_here.append(True)


def _forget_nvml_for_cuda_checks() -> None:
    if _nvml_set_here:
        os.environ.pop(NVML_CHECK_ENV, None)
        _nvml_set_here.clear()


def why_not_copy(native_threads_before: int | None = None) -> str | None:
    """Why this process may not be copied into a fork server now (None: it may).
    `native_threads_before`: the threads the process ran before code hpo does not know ran
    (a user's modules): one started since (an OpenMP pool that torch's first parallel op
    made, a client library's) rules a copy out. Those that run from hpo's own imports on are
    numpy's and scipy's idle OpenBLAS pools, which stop themselves for a fork."""
    if os.environ.get(FORK_SERVER_ENV, "").strip().lower() == "fresh":
        return f"{FORK_SERVER_ENV}=fresh"
    if not sys.platform.startswith("linux"):
        return "not on Linux"
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"threads run here ({names})"
    started = native_threads() - native_threads_before if native_threads_before is not None else 0
    if started > 0:
        return f"{started} native thread(s) started since hpo's imports (by the user's modules)"
    initialised = cuda_initialised()
    if initialised is not None:
        return initialised
    return internals_problem()


def native_threads() -> int:
    """The threads of this process, Python's and native ones (Linux; 0 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def import_preload(preload: Iterable[str]) -> int:
    """Import here what a fork server started afresh would preload (a copy has it then);
    returns native_threads() after."""
    for name in preload:
        if name not in SERVER_ONLY_MODULES:
            importlib.import_module(name)
    return native_threads()


def _loaded_library(path: str) -> Any:
    """The library at `path` as already loaded (RTLD_NOLOAD: never loads it; OSError if not)."""
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)


def cuda_initialised(
    maps: str = "/proc/self/maps", open_driver: Callable[[str], Any] = _loaded_library
) -> str | None:
    """Why CUDA may be initialised in this process (None: it is not, a copy can use it).
    The driver's library being mapped is not enough: on a GPU host something imports it long
    before anything initialises it (2026-11-26, an H100: every worker's copy was refused on
    that ground). The driver itself says, from the first call: CUDA_ERROR_NOT_INITIALIZED
    until cuInit, by whichever library (torch, triton, a user's) it came. `open_driver` opens
    the loaded library of a path (tests give their own)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch has initialised CUDA here"
    try:
        with open(maps) as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if "libcuda.so" in line]
    except OSError:  # cannot tell: assume so (a fork server started afresh is always safe)
        return f"cannot tell whether CUDA is initialised here ({maps} unreadable)"
    if not paths:
        return None
    try:
        driver = open_driver(paths[0])
        answer = driver.cuCtxGetCurrent(ctypes.byref(ctypes.c_void_p()))
    except (OSError, AttributeError) as e:
        return f"the CUDA driver is loaded here and could not say whether it is initialised ({e})"
    if answer == CUDA_ERROR_NOT_INITIALIZED:
        return None
    return f"the CUDA driver is initialised here (cuCtxGetCurrent gave {answer})"


def internals_problem() -> str | None:
    """What of multiprocessing's forkserver is not as this module expects (None: all is)."""
    server = getattr(forkserver, "_forkserver", None)
    if server is None or not SERVER_FIELDS <= set(vars(server)):
        return "multiprocessing's ForkServer has other fields on this Python"
    if hasattr(server, "_forkserver_authkey"):
        return "multiprocessing's fork server takes an authentication key on this Python"
    if list(inspect.signature(forkserver.main).parameters) != MAIN_PARAMETERS:
        return "multiprocessing's forkserver.main takes other parameters on this Python"
    return None


def start_as_copy(native_threads_before: int | None = None) -> bool:
    """Make the fork server a copy of this process, which has imported what a server started
    afresh would preload (import_preload; see why_not_copy for `native_threads_before`). False,
    and a debug line saying why, where it is not safe, a server already runs or the copy
    could not be made: then the first trial process starts one as multiprocessing does."""
    try:
        pid = _copy(native_threads_before)
    finally:
        _forget_nvml_for_cuda_checks()
    if pid is None:
        return False
    log.debug("trial processes: their fork server is a copy of this worker (pid %d)", pid)
    return True


def _copy(native_threads_before: int | None) -> int | None:
    server = cast(Any, forkserver)._forkserver  # private: typeshed leaves it out
    reason = why_not_copy(native_threads_before)
    if reason is None and server._forkserver_pid is not None:
        reason = "a fork server already runs"
    if reason is None:
        resource_tracker.ensure_running()  # shared by the worker, the copy, trial processes
        try:
            address, alive_w, pid = _fork_server()  # not under the lock: the copy would hold it
        except OSError as e:  # no process or socket to be had (a pids limit, a long TMPDIR)
            reason = f"the copy could not be made: {e}"
    if reason is not None:
        log.debug("trial processes: their fork server will start afresh: %s", reason)
        return None
    with server._lock:
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return pid


def _fork_server() -> tuple[str, int, int]:
    """The copy's listening address, the pipe end whose closing ends it, and its pid."""
    with socket.socket(socket.AF_UNIX) as listener:
        # In multiprocessing's temp folder, removed when the worker exits.
        address = cast(Any, connection).arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the worker's end closes when it exits: the copy ends too
        try:
            with _stop_signals_blocked(), warnings.catch_warnings():
                # Python 3.12 and later warn of the native threads numpy's and scipy's OpenBLAS
                # keep idle (they stop themselves for a fork; torch has run nothing yet).
                warnings.filterwarnings("ignore", "This process .* is multi-threaded")
                pid = os.fork()
                if pid == 0:
                    _serve(listener.fileno(), alive_r, alive_w)  # never returns
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    return address, alive_w, pid


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """In the copy: multiprocessing's fork server loop, with the signal handling of one started
    afresh (the worker's handlers would run here on a signal to the process group)."""
    try:
        os.close(alive_w)
        _forget_nvml_for_cuda_checks()  # trial processes ask torch's own check
        name_this_process(FORK_SERVER_NAME)
        _default_signal_handlers()
        # SIGINT stays blocked, as in a server started afresh (see fork_start.sigint_blocked);
        # SIGALRM, blocked for the fork, is the user's again in trial processes.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGALRM})
        # The worker's objects are never collected here (a finalizer of one might act for it).
        gc.freeze()
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # how it ends once the worker has gone
        pass
    except BaseException:  # said, as a server started afresh would; the worker starts one
        traceback.print_exc()
    finally:
        # As fork_server.py does for a server started afresh: no teardown of torch and the
        # worker's objects, nothing of the worker's to flush or close (its atexit hooks).
        os._exit(0)


def _default_signal_handlers() -> None:
    """Every signal handled as in a new interpreter: the worker's Python handlers (stop
    requests, pauses) belong to the worker."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        fresh = _fresh_handler(signum)
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(signum) is not fresh:
                signal.signal(signum, fresh)


def _fresh_handler(signum: int) -> Any:
    """What a new interpreter does with `signum` (Python ignores SIGPIPE and SIGXFSZ)."""
    if signum == signal.SIGINT:
        return signal.default_int_handler
    if signum in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)):
        return signal.SIG_IGN
    return signal.SIG_DFL


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """A Ctrl-C or SIGTERM arriving during the fork waits until the copy has the handlers of a
    new interpreter (the worker's own would otherwise run in it); the worker gets it after. So
    does SIGALRM, which raises a stop that an import held back (hpo.stopping): raised in the
    fork's own hooks (logging's lock release), it was printed as ignored, with a traceback."""
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
