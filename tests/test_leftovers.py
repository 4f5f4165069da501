"""Processes a trial leaves running (hpo/trial/leftovers.py): how they are found below the trial
process, ended and waited for, and a training function that forks a child, run through `hpo run`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpo.trial.leftovers import (
    ProcessInfo,
    _has_children,
    descendants,
    kept_helper,
    read_processes,
)
from tests.conftest import REPO, run_hpo
from tests.test_entrypoint import entrypoint_config

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has exited and been waited for within `within_s`."""
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_descendants_lists_parents_first_and_leaves_out_the_root_s_kept_helpers() -> None:
    tree = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 10, 21: 20, 30: 1}  # pid: parent
    processes = {pid: ProcessInfo(pid, parent, zombie=pid == 12) for pid, parent in tree.items()}
    found = descendants(10, processes)
    assert [p.pid for p in found] == [11, 12, 20, 13, 21]
    assert [p.pid for p in found if p.zombie] == [12]
    assert [p.pid for p in descendants(10, processes, keep=lambda pid: pid == 20)] == [11, 12, 13]
    assert descendants(13, processes) == [] and descendants(99, processes) == []


def test_read_processes_parses_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    stats = {"7": "7 (a) b (c) S 3 7 7", "8": "8 (z) Z 7 7 7", "self": "", "9": "9 (short)"}
    for name, stat in stats.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "stat").write_text(stat)
    (tmp_path / "8" / "cmdline").write_bytes(
        b"python\0/x/torch/_inductor/compile_worker/__main__.py"
    )
    assert read_processes(str(tmp_path)) == {
        7: ProcessInfo(7, 3, zombie=False),
        8: ProcessInfo(8, 7, zombie=True),
    }
    assert read_processes(str(tmp_path / "nothing")) == {}  # no /proc: nothing found
    assert kept_helper(8, str(tmp_path)) and not kept_helper(7, str(tmp_path))
    # Whether a process has children: its threads' lists, else the whole table read.
    assert _has_children(3, str(tmp_path)) and not _has_children(8, str(tmp_path))
    for thread, children in (("7", ""), ("71", "8 ")):
        (tmp_path / "7" / "task" / thread).mkdir(parents=True)
        (tmp_path / "7" / "task" / thread / "children").write_text(children)
    assert _has_children(7, str(tmp_path))
    (tmp_path / "7" / "task" / "71" / "children").write_text("")
    assert not _has_children(7, str(tmp_path))


# A trial process in miniature: it becomes a subreaper, then its "trial" leaves a child that
# ignores SIGTERM, a child that dies on it, and a grandchild whose parent has exited (handed to
# this process). Each writes its pid to a file once it runs.
LEAVES_THREE = """
import logging, os, signal, sys, time
from pathlib import Path
from hpo.trial import leftovers

logging.basicConfig(level=logging.INFO, format="%(message)s")
leftovers.END_GRACE_S = 0.5
assert leftovers.become_subreaper()
folder = Path(sys.argv[1])

def leave(name, ignore_term=False, grandchild=False):
    if os.fork() == 0:
        if grandchild and os.fork() != 0:
            os._exit(0)
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (folder / name).write_text(str(os.getpid()))
        time.sleep(120)
        os._exit(0)

leave("ignores"), leave("plain"), leave("orphan", grandchild=True)
deadline = time.monotonic() + 30
while len(list(folder.iterdir())) < 3 and time.monotonic() < deadline:
    time.sleep(0.02)
started = time.monotonic()
print("ended", leftovers.end_what_the_trial_left(3), round(time.monotonic() - started, 1))
zombies = [p for p in leftovers.read_processes().values() if p.parent_pid == os.getpid()]
print("children left", len(zombies))
"""


@linux_only
def test_what_a_trial_left_is_ended_killed_past_the_grace_and_waited_for(tmp_path: Path) -> None:
    folder = tmp_path / "pids"
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", LEAVES_THREE, str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    ended, took_s = done.stdout.splitlines()[0].split()[1:]
    assert ended == "3" and float(took_s) < 5  # SIGTERM, then SIGKILL for the one ignoring it
    assert "children left 0" in done.stdout  # every one waited for: no zombie
    assert "trial 3 left 3 processes running; ended them" in done.stderr
    for name in ("ignores", "plain", "orphan"):
        assert _gone(int((folder / name).read_text()), within_s=5), name


FORKING_FUNCTION = """
import os, time


def train(ctx):
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:  # a child that outlives the function, holding hpo's stdout and stderr
        path = os.path.join(ctx.params["folder"], f"child-{ctx.trial_number}")
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        os.write(ready_w, b"x")
        time.sleep(120)
        os._exit(0)
    os.read(ready_r, 1)  # the child runs when the function returns
    return {"val_loss": ctx.params["lr"]}
"""


@linux_only
@pytest.mark.slow
def test_a_child_forked_by_the_training_function_ends_with_its_trial(tmp_path: Path) -> None:
    """Each trial's child, sleeping for 120 s, ends when its trial does: the run does not wait
    for it (its output pipes close), and the log says what was ended."""
    (tmp_path / "train_fn.py").write_text(FORKING_FUNCTION)
    raw = entrypoint_config(n_trials=2)
    raw["search_space"]["folder"] = {"type": "categorical", "choices": [str(tmp_path)]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    done = run_hpo(
        "run",
        "--config",
        "config.yaml",
        "--study",
        "s",
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        cwd=tmp_path,
        timeout=100,
    )
    took_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert took_s < 60, took_s  # the run's pipes closed without waiting out the children
    for number in (0, 1):
        assert f"trial {number} left 1 process running; ended it" in done.stderr
        assert _gone(int((tmp_path / f"child-{number}").read_text()), within_s=10)
