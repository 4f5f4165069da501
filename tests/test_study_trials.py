"""The life of a trial on a shared study, unit by unit: the budget count, heartbeats, the sweep
that fails and re-queues a dead or paused worker's trial, a worker that finds its trial taken
over, worker seeds, and the one private Optuna name hpo uses."""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from hpo.config.schema import SamplerConfig
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.heartbeats import heartbeats
from hpo.storage.url import StorageURL
from hpo.study.sampling import build_sampler, worker_seed
from hpo.study.trials import StudyTrials, counted_trials

X = {"x": FloatDistribution(0, 1)}


def _storage(tmp_path: Path) -> StudyStorage:
    return open_storage(StorageURL(f"sqlite:///{tmp_path / 'study.db'}", "test"))


def _trials(
    storage: StudyStorage, worker: str, budget: int | None = 3, grace_s: float = 2
) -> StudyTrials:
    study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    return StudyTrials(study, storage, worker, budget, (1, grace_s, 2))


def _start(trials: StudyTrials) -> optuna.Trial:
    """A trial of `trials`' worker, running, with its one parameter sampled."""
    trial = trials.next_trial()
    assert trial is not None
    trial.suggest_float("x", 0, 1)
    return trial


def _last_beat(storage: StudyStorage, seconds_ago: int) -> None:
    """Every heartbeat row as if its worker last beat `seconds_ago` (the database's clock)."""
    with storage.engine.begin() as conn:
        conn.execute(
            heartbeats.update().values(
                beat_at=sa.text(f"datetime('now', '-{seconds_ago} seconds')")
            )
        )


def test_the_budget_counts_started_trials_and_a_retry_takes_its_failed_trials_place(
    tmp_path: Path,
) -> None:
    trials = _trials(_storage(tmp_path), "w1", budget=2)
    first = _start(trials)
    trials.hand_back(first, "interrupted")  # FAIL and a WAITING retry, which fits in the budget
    study = trials.study
    assert counted_trials(study.get_trials()) == 0
    retry = trials.next_trial()
    assert retry is not None and retry.number == 1 and retry.params == first.params
    trials.tell(retry, TrialState.COMPLETE, 1.0)
    second = trials.next_trial()
    assert second is not None
    trials.tell(second, TrialState.PRUNED)
    assert trials.next_trial() is None  # 2 counted: FAIL+retry, and the pruned one
    assert [t.state for t in study.get_trials()] == [
        TrialState.FAIL,
        TrialState.COMPLETE,
        TrialState.PRUNED,
    ]


def test_a_trial_whose_heartbeats_stopped_is_failed_with_its_reason_and_queued_again(
    tmp_path: Path,
) -> None:
    storage = _storage(tmp_path)
    paused = _trials(storage, "host-a:1", grace_s=1)
    trial = _start(paused)
    other = _trials(storage, "host-b:2", grace_s=1)
    assert other.sweep() == []  # beat just now
    _last_beat(storage, 30)  # the last beat, 30 s ago on the database's clock
    assert other.sweep() == [trial.number]
    stale, retry = other.study.get_trials()
    assert stale.state == TrialState.FAIL
    # 30 s, plus however long the sweep took to run on a loaded machine (31 s was seen in CI).
    reason = re.fullmatch(
        r"stale: no heartbeat from its worker host-a:1 for (\d+) s \(grace period 1 s\); .*",
        stale.user_attrs["fail_reason"],
    )
    assert reason is not None and 30 <= int(reason[1]) < 40, stale.user_attrs["fail_reason"]
    assert retry.state == TrialState.WAITING and retry.params == stale.params
    assert retry.system_attrs["failed_trial"] == trial.number
    assert other.sweep() == []  # failed once, by one worker


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata", "America/Los_Angeles"])
def test_a_running_trial_that_never_beat_is_swept_once_it_is_old(
    tmp_path: Path, zone: str, local_time_zone: Any
) -> None:
    # Optuna hands trials' start times out in local time: a worker east of UTC once took a
    # trial created a moment ago for one hours old.
    local_time_zone(zone)
    storage = _storage(tmp_path)
    study = optuna.create_study(study_name="s", storage=storage)
    # RUNNING without a heartbeat row, as a worker lost between creation and its first beat.
    old, new = study.ask(X), study.ask(X)
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name("s"), old.number
    )
    with storage.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE trials SET datetime_start = '2000-01-01' WHERE trial_id = :id"),
            {"id": trial_id},
        )
    assert _trials(storage, "w").sweep() == [old.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states[old.number] == TrialState.FAIL and states[new.number] == TrialState.RUNNING


def test_a_worker_that_wakes_after_its_trial_was_taken_over_drops_its_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = _storage(tmp_path)
    sleeper = _trials(storage, "host-a:1", grace_s=1)
    trial = _start(sleeper)
    with sleeper.heartbeat(trial) as beat:
        _last_beat(storage, 9)
        _trials(storage, "host-b:2", grace_s=1).sweep()  # the sleeper was paused past grace
        deadline = time.monotonic() + 10
        while not beat.lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.lost.is_set()  # its next beat found the trial gone
    with caplog.at_level(logging.WARNING):
        assert sleeper.tell(trial, TrialState.COMPLETE, 0.9) is False
    assert "was taken over by another worker" in caplog.text
    stale, retry = sleeper.study.get_trials()
    assert stale.state == TrialState.FAIL and stale.value is None
    assert retry.state == TrialState.WAITING


def test_only_one_worker_fails_a_stale_trial_when_many_sweep_at_once(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    trial = _start(_trials(storage, "dead:1", grace_s=1))
    _last_beat(storage, 9)
    results: list[list[int]] = []
    sweepers = [_trials(_storage(tmp_path), f"w:{i}", grace_s=1) for i in range(4)]
    threads = [threading.Thread(target=lambda t=t: results.append(t.sweep())) for t in sweepers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(n for found in results for n in found) == [trial.number]
    states = [t.state for t in sweepers[0].study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]  # one retry, not four
    # Its time until its last beat, for device-hours (its worker could not record it).
    assert sweepers[0].study.get_trials()[0].user_attrs["wall_s"] == 0.0  # beat "before" start


def test_a_stale_trial_ran_from_its_start_to_its_last_heartbeat() -> None:
    from hpo.study.trials import _time_until_silent

    started = dt.datetime.now() - dt.timedelta(seconds=100)
    assert _time_until_silent(started, 30.0) == pytest.approx(70.0, abs=1)
    assert _time_until_silent(None, 30.0) is None


def test_each_worker_gets_its_own_seed_and_the_first_keeps_the_configured_one() -> None:
    assert worker_seed(0, 0) == 0 and worker_seed(None, 3) is None
    seeds = {worker_seed(0, i) for i in range(64)}
    assert len(seeds) == 64
    draws = []
    for index in range(4):
        sampler = build_sampler(SamplerConfig(type="random", seed=0), index)
        study = optuna.create_study(sampler=sampler)
        study.optimize(lambda t: t.suggest_float("lr", 1e-5, 1e-1, log=True), n_trials=3)
        draws.append(tuple(t.params["lr"] for t in study.trials))
    assert len(set(draws)) == 4  # no two workers draw the same random trials
    again = optuna.create_study(sampler=build_sampler(SamplerConfig(type="random", seed=0), 0))
    again.optimize(lambda t: t.suggest_float("lr", 1e-5, 1e-1, log=True), n_trials=3)
    assert tuple(t.params["lr"] for t in again.trials) == draws[0]  # reproducible alone


def test_the_trial_cache_reads_finished_trials_once_and_sees_other_workers_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.storage import study_queries

    storage = _storage(tmp_path)
    assert storage.cache is not None
    study = optuna.create_study(storage=storage, study_name="c")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    reads: list[tuple[int, list[int]]] = []
    real = study_queries.study_trials

    def counted(engine: Any, study_id: int, after_id: int, also: list[int]) -> Any:
        reads.append((after_id, also))
        return real(engine, study_id, after_id, also)

    monkeypatch.setattr(study_queries, "study_trials", counted)
    # Another worker (another process: its own storage) runs a trial and leaves one running.
    other = optuna.load_study(study_name="c", storage=storage.rdb)
    other.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    running = other.ask()
    running.suggest_float("x", 0, 1)
    seen = study.get_trials()
    assert [t.state for t in seen] == [TrialState.COMPLETE] * 3 + [TrialState.RUNNING]
    other.tell(running, 0.5)
    assert study.get_trials()[-1].state == TrialState.COMPLETE  # the running one, read again
    assert [t.state for t in study.get_trials(states=(TrialState.RUNNING,))] == []
    # Finished trials were read once: each read asks only for newer or unfinished ones.
    # (trial ids 1 and 2 are this worker's: 1 was read finished while 2 was being asked)
    assert reads[:3] == [(1, [2]), (3, [4]), (4, [])]
    cached = study.get_trials()
    assert [t.params for t in cached] == [t.params for t in storage.rdb.get_all_trials(1)]
    held = storage.get_all_trials(storage.get_study_id_from_name("c"), deepcopy=False)
    assert storage.get_trial(4) is held[3]  # a finished trial comes from the cache
    with pytest.raises(KeyError):
        storage.get_all_trials(99)


def test_cleanup_waits_for_a_sweep_so_a_retry_keeps_its_checkpoint_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.study import trials as trials_module
    from hpo.trial.folders import folder_name, prepare_trial_folder

    storage = _storage(tmp_path)
    trial = _start(_trials(storage, "dead:1", grace_s=1))
    root = tmp_path / "checkpoints"
    folder = prepare_trial_folder(root, "s", folder_name(trial))
    _last_beat(storage, 9)
    failed = threading.Event()
    real_retry = trials_module.retry_trial

    def slow_retry(*args: object, **kwargs: object) -> int | None:
        failed.set()  # the trial is FAIL now, its retry not yet queued
        time.sleep(1.0)
        return real_retry(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trials_module, "retry_trial", slow_retry)
    cleaner = _trials(_storage(tmp_path), "w:2")
    sweeper = threading.Thread(target=_trials(storage, "w:1", grace_s=1).sweep)
    sweeper.start()
    assert failed.wait(10)
    cleaner.remove_stale_checkpoints(root)  # another worker, meanwhile
    sweeper.join()
    assert folder.is_dir()  # the retry (first_attempt = the failed trial) resumes from it


def test_two_workers_creating_one_study_with_different_search_spaces_cannot_both_succeed(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.config.loader import parse_config
    from hpo.errors import ConfigError
    from hpo.study.join import open_study
    from tests.conftest import tiny_config

    configs = []
    for high in (5e-3, 9e-3):
        raw = tiny_config(*easy_data)
        raw["search_space"]["learning_rate"]["high"] = high
        configs.append(parse_config(raw, tmp_path))
    read_attrs = StudyStorage.get_study_user_attrs

    def slow_read(self: StudyStorage, study_id: int) -> dict[str, object]:
        attrs = read_attrs(self, study_id)
        time.sleep(0.3)  # a wide window between checking the study's space and recording one
        return attrs

    monkeypatch.setattr(StudyStorage, "get_study_user_attrs", slow_read)
    outcomes: list[str] = []
    start = threading.Barrier(len(configs) * 2)

    def join(config: object) -> None:
        start.wait()
        try:
            open_study(_storage(tmp_path), "race", config)  # type: ignore[arg-type]
            outcomes.append("joined")
        except ConfigError:
            outcomes.append("refused")

    threads = [threading.Thread(target=join, args=(c,)) for c in configs * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["joined", "joined", "refused", "refused"]


class _QuickObjective:
    """Stands in for hpo.trial.objective.Objective: each trial completes at once."""

    def __init__(self) -> None:
        from hpo.stopping import StopRequest

        self.stop = StopRequest()
        self.task = SimpleNamespace(config=SimpleNamespace(study=SimpleNamespace(objectives=["a"])))

    def __call__(self, trial: optuna.Trial, lost: threading.Event) -> float:
        return trial.suggest_float("x", 0, 1)


def _loop(trials: StudyTrials, objective: Any) -> int:
    from hpo.study.loop import _trial_loop

    return _trial_loop(trials, objective, objective.stop, (None, None), None, collect=False)


def test_a_worker_restarted_at_once_after_a_crash_takes_the_dead_workers_trial_over(
    tmp_path: Path,
) -> None:
    """Found by a hostile try: a worker killed mid-trial and restarted at once ran its one
    trial, found the budget spent and exited 0, the dead worker's trial left RUNNING: the study
    one short until a worker started past the grace period. Its last beat is recent, so it is
    not silent yet; the restarted worker waits for it to go stale and runs it again."""
    storage = _storage(tmp_path)
    liveness = (2, 3, 2)  # beats every 2 s, stale after 3
    dead = StudyTrials(
        optuna.create_study(study_name="s", storage=storage), storage, "dead:1", 2, liveness
    )
    lost = _start(dead)  # its worker killed now: no beat ever again
    restarted = StudyTrials(dead.study, _storage(tmp_path), "new:2", 2, liveness)
    started = time.monotonic()
    assert _loop(restarted, _QuickObjective()) == 2
    assert time.monotonic() - started < 3 + 2 + 10  # within the grace, an interval, a margin
    failed, second, retry = dead.study.get_trials()
    assert failed.state == TrialState.FAIL and "stale" in failed.user_attrs["fail_reason"]
    assert (second.state, retry.state) == (TrialState.COMPLETE, TrialState.COMPLETE)
    assert retry.params == lost.params and retry.user_attrs["retry_of"] == lost.number


def test_a_worker_done_with_the_budget_leaves_a_live_workers_long_trial_to_it(
    tmp_path: Path,
) -> None:
    storage = _storage(tmp_path)
    liveness = (1, 5, 2)  # beats every second, stale after 5
    live = StudyTrials(
        optuna.create_study(study_name="s", storage=storage), storage, "live:1", 1, liveness
    )
    trial = _start(live)
    other = StudyTrials(live.study, _storage(tmp_path), "new:2", 1, liveness)
    with live.heartbeat(trial):
        started = time.monotonic()
        assert _loop(other, _QuickObjective()) == 0
        waited_s = time.monotonic() - started
    assert waited_s < 4, waited_s  # one heartbeat seen, not the grace period waited out
    assert live.study.get_trials()[0].state == TrialState.RUNNING  # not taken over
    assert 0 in other.seen_beating


def test_a_worker_waiting_for_a_silent_trial_stops_at_once_when_asked(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    liveness = (5, 30, 2)
    dead = StudyTrials(
        optuna.create_study(study_name="s", storage=storage), storage, "dead:1", 1, liveness
    )
    _start(dead)
    waiting = StudyTrials(dead.study, _storage(tmp_path), "new:2", 1, liveness)
    objective = _QuickObjective()
    threading.Timer(1.0, objective.stop.note, args=("SIGTERM",)).start()
    started = time.monotonic()
    assert _loop(waiting, objective) == 0
    assert time.monotonic() - started < 3
    assert dead.study.get_trials()[0].state == TrialState.RUNNING


class _FailingObjective:
    """Stands in for hpo.trial.objective.Objective: each trial ends with `error`."""

    def __init__(self, error: BaseException) -> None:
        from hpo.stopping import StopRequest

        self.error = error
        self.stop = StopRequest()

    def __call__(self, trial: optuna.Trial, lost: threading.Event) -> float:
        trial.suggest_float("x", 0, 1)
        if isinstance(self.error, KeyboardInterrupt):
            self.stop.note("SIGTERM")  # as the signal handler would, during the trial
        raise self.error

    @staticmethod
    def mark_interrupted(trial: optuna.Trial, signal_name: str) -> None:
        pass  # the real one records a reason: here the loop's own must be there


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ValueError("bad batch"), "ValueError: bad batch"),
        # The trial process stopped (SIGSTOP) past the grace period, killed and handed back:
        # recorded with no reason before (hpo status: "1 x no reason recorded").
        ("hand_back", "its trial process was stopped (SIGSTOP, a debugger) for 6 s"),
        ("taken_over", "taken over by another worker"),
        ("interrupted", "interrupted: the worker got SIGTERM"),
    ],
)
def test_every_way_a_worker_fails_its_trial_records_why(
    tmp_path: Path, error: Any, reason: str
) -> None:
    from hpo.stopping import HandBack, Interrupted, TakenOver
    from hpo.study.loop import _trial_loop

    raised = {
        "hand_back": HandBack(
            "its trial process was stopped (SIGSTOP, a debugger) for 6 s, "
            "past study.grace_period; killed"
        ),
        "taken_over": TakenOver(),
        "interrupted": Interrupted("SIGTERM"),
    }.get(error, error)
    trials = _trials(_storage(tmp_path), "w1", budget=1)
    objective: Any = _FailingObjective(raised)
    _trial_loop(trials, objective, objective.stop, (None, None), None, collect=False)
    failed = trials.study.get_trials()[0]
    assert failed.state == TrialState.FAIL
    assert failed.user_attrs.get("fail_reason", "").startswith(reason), failed.user_attrs
