"""Workers on one CPU host share its cores, however they were started: the registry of live
workers (a dead one's entry ignored, kill -9 included) and two real workers each taking half."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from hpo.trial import cpu_share
from tests.conftest import start_hpo, tiny_config, write_config


@pytest.fixture(autouse=True)
def _no_thread_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests pin one thread (conftest): here, as for a user, nothing is set."""
    for name in cpu_share.THREAD_ENVS:
        monkeypatch.delenv(name, raising=False)


def test_two_registered_workers_share_the_cores(tmp_path: Path) -> None:
    with cpu_share.registered(tmp_path) as first, cpu_share.registered(tmp_path) as second:
        assert first is not None and second is not None
        assert [count for _, count in cpu_share.live_workers(tmp_path)] == [None, None]
        shares = [cpu_share.share_for(i, [None, None], 8) for i in range(2)]
        assert [(s.threads, s.host_threads, s.workers) for s in shares] == [(4, 8, 2), (4, 8, 2)]
        share = cpu_share.trial_share(first)
        assert share is not None and share.workers == 2
        assert share.why() == "2 hpo workers on this host"
    # Both ended: their entries are gone, and a trial of a later worker has every core.
    assert cpu_share.live_workers(tmp_path) == []
    with cpu_share.registered(tmp_path) as alone:
        assert alone is not None
        share = cpu_share.trial_share(alone)
        assert share is not None and share.workers == 1
        assert share.threads == cpu_share.host_threads()


def test_odd_cores_and_a_workers_own_setting() -> None:
    # Three cores, two sharing workers: the first in the registry's order takes the remainder.
    assert [cpu_share.share_for(i, [None, None], 3).threads for i in range(2)] == [2, 1]
    # A worker with OMP_NUM_THREADS=4 keeps its 4; the two others share the 4 left of 8.
    assert [cpu_share.share_for(i, [4, None, None], 8).threads for i in (1, 2)] == [2, 2]
    # More workers than cores: one thread each, never none.
    assert cpu_share.share_for(0, [None, 4, 4], 8).threads == 1


def test_a_worker_with_its_own_thread_count_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with cpu_share.registered(tmp_path) as entry:
        assert entry is not None
        assert cpu_share.live_workers(tmp_path) == [(entry.name, 3)]
        assert cpu_share.trial_share(entry) is None  # the user's setting stands


def test_a_dead_workers_entry_is_ignored_and_removed(tmp_path: Path) -> None:
    # A worker that died long ago (its pid may be anyone's now): its file, unlocked.
    dead = tmp_path / "999999-0123456789ab.worker"
    dead.write_text("auto")
    with cpu_share.registered(tmp_path) as entry:
        assert entry is not None
        assert cpu_share.live_workers(tmp_path) == [(entry.name, None)]
        share = cpu_share.trial_share(entry)
        assert share is not None and share.workers == 1
    assert not dead.exists()


def test_a_killed_workers_entry_is_ignored(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from hpo.trial import cpu_share\n"
        "with cpu_share.registered(Path(sys.argv[1])):\n"
        "    print('registered', flush=True); time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_share.THREAD_ENVS}
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "registered\n"
        assert [count for _, count in cpu_share.live_workers(tmp_path)] == [None]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    # Its file is still there (no cleanup ran), but no process holds its lock.
    assert len(list(tmp_path.glob("*.worker"))) == 1
    assert cpu_share.live_workers(tmp_path) == []
    assert list(tmp_path.glob("*.worker")) == []


def test_an_unusable_registry_folder_runs_unshared(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with cpu_share.registered(blocker / "workers") as entry:
        assert entry is None


@pytest.mark.skipif(cpu_share.host_threads() < 2, reason="one core: nothing to share")
def test_two_workers_started_separately_each_use_half_the_cores(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    """Two `hpo run` started one after the other on one host, on two studies: while both run,
    each trains with half the host's threads, and records it beside samples_per_s."""
    # The trials train in their workers (trial_isolation: none), which share the cores as trial
    # processes do (the share is taken per trial), without a fork server's seconds of imports.
    raw = tiny_config(
        *easy_data,
        study={"pruner": {"type": "none"}, "trial_isolation": "none"},
        training={"max_steps": 2, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'host.db'}"
    registry = cpu_share.workers_dir()  # the tests' own cache folder (conftest)
    # The first worker runs trials until stopped; the second runs two while the first runs.
    first = start_hpo(
        "run",
        "--study",
        "long",
        "--config",
        str(config),
        "--storage",
        url,
        "--n-trials",
        "1000",
        "--quiet",
        cwd=tmp_path,
    )
    try:
        _wait_for(lambda: len(cpu_share.live_workers(registry)) == 1, first)
        second = start_hpo(
            "run",
            "--study",
            "short",
            "--config",
            str(config),
            "--storage",
            url,
            "--n-trials",
            "2",
            "--quiet",
            cwd=tmp_path,
        )
        _, stderr = second.communicate(timeout=600)
        assert second.returncode == 0, stderr[-3000:]
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    half = cpu_share.host_threads() // 2
    short = optuna.load_study(study_name="short", storage=url).get_trials()
    assert [(t.user_attrs["cpu_threads"], t.user_attrs["cpu_workers"]) for t in short] == [
        (half, 2),
        (half, 2),
    ]
    assert short[0].user_attrs["device_name"] == (
        f"cpu ({half} of {cpu_share.host_threads()} threads: 2 hpo workers on this host)"
    )
    # The first worker's trials that started while the second ran took half too.
    long = optuna.load_study(study_name="long", storage=url).get_trials()
    shared = [t for t in long if t.user_attrs.get("cpu_workers") == 2]
    assert shared and all(t.user_attrs["cpu_threads"] == half for t in shared)
    for trial in long:  # alone or not, never more threads than its share of the cores
        if "cpu_workers" in trial.user_attrs:
            workers = trial.user_attrs["cpu_workers"]
            shares = [
                cpu_share.share_for(i, [None] * workers, cpu_share.host_threads()).threads
                for i in range(workers)
            ]
            assert trial.user_attrs["cpu_threads"] in shares
    assert cpu_share.live_workers(registry) == []  # both gone, both entries with them


def _wait_for(condition: object, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"hpo ended early: {process.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError("the first worker never registered")
