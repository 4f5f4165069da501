"""Fault injection on real PostgreSQL: the database drops out under several workers, a worker is
stopped during evaluation. With the SIGKILL test (test_workers), the SIGTERM tests
(test_stopping) and the resume-equality tests (test_checkpoint), every fault test tallies what it
injected and what its study holds afterwards; the totals are printed at the end of the run."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from optuna.trial import TrialState
from sqlalchemy.engine import make_url

from tests.conftest import (
    easy_rows,
    hold_env,
    holding_metrics,
    record_faults,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
    write_csv,
)
from tests.tcp_proxy import CuttableProxy

OUTAGE_S = 8


@pytest.mark.postgres
def test_workers_ride_out_a_database_outage(
    tmp_path: Path, easy_data: tuple[Path, Path], postgres_url: str
) -> None:
    url = make_url(postgres_url)
    proxy = CuttableProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    budget = 2  # one trial per worker, both training through the outage
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": budget,
            "pruner": {"type": "none"},
            "heartbeat_interval": 2,
            "grace_period": 60,
            "database_patience": 120,
        },
        # 12 evaluations; each trial's first holds until the outage began: both train, and
        # report, through it (a tiny trial may otherwise finish before the cut)
        training={"epochs": 6, "evals_per_epoch": 2},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "outage", "--config", str(config), "--storage", proxied)
    held, cut = tmp_path / "held", tmp_path / "cut"
    env = hold_env(held, release=cut, holds=budget)
    workers = [start_hpo(*args, cwd=tmp_path, env=env) for _ in range(2)]
    try:
        study = wait_until_training(postgres_url, "outage", workers, trials=2)
        wait_until_held(held, workers, count=2)
        proxy.cut()  # every connection dropped, new ones refused: a server restart
        cut.touch()
        time.sleep(OUTAGE_S)  # the outage's length, not a wait for something to happen
        proxy.restore()
        outputs = [w.communicate(timeout=600) for w in workers]
    finally:
        for worker in workers:
            worker.kill()
        proxy.close()
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-3000:]
    assert any("study database unreachable" in err for _, err in outputs)
    record_faults(study, faults=1, budget=budget)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * budget, [
        (t.number, t.state.name, t.user_attrs.get("fail_reason")) for t in trials
    ]
    for trial in trials:  # reports made during the outage were written once it was back
        assert sorted(trial.intermediate_values) == list(range(1, 13))


@pytest.mark.postgres
def test_sigterm_during_evaluation_checkpoints_and_the_retry_resumes(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big_eval = write_csv(tmp_path / "big-eval.csv", easy_rows(3000, 7))
    raw = tiny_config(
        easy_data[0],
        big_eval,
        study={"n_trials": 1, "pruner": {"type": "none"}, "stop_timeout": 20},
        # 12 evaluations of 3000 examples, 8 steps apart: the second holds until the SIGTERM
        # arrives, which lands in it however long the 8 steps before it take.
        training={"epochs": 3, "evals_per_epoch": 4},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "eval", "--config", str(config), "--storage", postgres_url)
    held = tmp_path / "held"
    worker = start_hpo(*args, cwd=tmp_path, env=hold_env(held, at=2))
    study = wait_until_training(postgres_url, "eval", [worker], evaluations=1)
    wait_until_held(held, [worker])
    sent = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr[-3000:]
    took = time.monotonic() - sent
    assert took < 20 + 10, f"stopped after {took:.1f} s:\n{stderr[-3000:]}"  # stop_timeout + DB
    # The retry: hpo's main in this process, in the folder of the stopped worker's checkpoints
    # (a second worker process would spend seconds importing torch, its fork server as many).
    monkeypatch.chdir(tmp_path)
    assert hpo_main(list(args)) == 0, capsys.readouterr().err[-3000:]
    record_faults(study, faults=1, budget=1)
    stopped, retry = study.get_trials()
    assert stopped.state == TrialState.FAIL and stopped.user_attrs["interrupted"] == "SIGTERM"
    # It checkpointed on its way out and said what that cost before the worker handed it back.
    assert stopped.user_attrs.get("checkpoint_s", 0) > 0, (stopped.user_attrs, stderr[-3000:])
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_at_step"] >= 8
    assert sorted(retry.intermediate_values) == list(range(1, 13))
