"""The study-wide batch-size cache, and `hpo` choosing, reusing and lowering physical batches."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
import torch
import yaml

from hpo.storage.batch_cache import BatchCacheRequests, BatchSizeCache, RelayedBatchCache
from hpo.storage.errors import StorageError
from hpo.trainer.memory import BUDGET_ENV
from tests.batch_cache_race import KEY, open_cache
from tests.conftest import (
    REPO,
    long_rows,
    start_hpo,
    tiny_config,
    write_config,
    write_csv,
)


def check_cache(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        cache = BatchSizeCache(engine)
        BatchSizeCache(engine)  # a second worker finds the table there
        assert cache.get(KEY) is None
        assert cache.record(KEY, 96, {"limit": 107}) == 96
        assert cache.record(KEY, 120, {"limit": 134}) == 96  # first search wins
        cache.lower(KEY, 120)
        assert cache.get(KEY) == 96  # never raised
        cache.lower(KEY, 48)
        assert cache.get(KEY) == 48
        assert cache.get({**KEY, "max_length": 512}) is None
    finally:
        engine.dispose()


def test_cache_on_sqlite(tmp_path: Path) -> None:
    check_cache(f"sqlite:///{tmp_path / 'cache.db'}")


@pytest.mark.postgres
def test_cache_on_postgres(postgres_url: str) -> None:
    check_cache(postgres_url)


def test_workers_starting_together_on_a_new_sqlite_file_all_open_the_cache(
    tmp_path: Path,
) -> None:
    # Found by CI: two workers raced to create the table and one trial failed with it.
    url = f"sqlite:///{tmp_path / 'race.db'}"
    context = multiprocessing.get_context("spawn")
    for _ in range(3):
        (tmp_path / "race.db").unlink(missing_ok=True)
        start = time.time() + 2.0
        with context.Pool(6) as pool:  # raises what any process raised
            stored = pool.starmap(open_cache, [(url, start, size) for size in range(10, 16)])
        # Every process opened the one table and agrees on the one size recorded first.
        assert len(set(stored)) == 1 and stored[0] in range(10, 16), stored
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text("SELECT physical_batch_size FROM hpo_batch_sizes"))
                assert [row[0] for row in rows] == stored[:1]
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_one_worker_searches_while_the_others_wait(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    cache = BatchSizeCache(engine)
    searches: list[str] = []
    results: dict[str, int] = {}

    def worker(name: str) -> None:
        with cache.searching(KEY):
            found = cache.get(KEY)
            if found is None:
                searches.append(name)
                time.sleep(0.5)  # a search takes a while; the other worker must wait
                found = cache.record(KEY, 64, {})
            results[name] = found

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    engine.dispose()
    assert len(searches) == 1 and results == {"a": 64, "b": 64, "c": 64}


def long_text_config(tmp_path: Path, n_trials: int, **study: Any) -> Path:
    """A tiny study on long sequences, so activations decide what fits a memory budget."""
    rows = long_rows(32)
    data = write_csv(tmp_path / "long.csv", rows)
    raw = tiny_config(data, data, study={"n_trials": n_trials, **study})
    raw["model"]["attn_implementation"] = "eager"
    raw["model"]["config"]["max_position_embeddings"] = 256
    raw["data"]["max_length"] = 256
    raw["training"].update(
        {
            "physical_batch_size": "auto",
            "batch_search_start": 2,
            "batch_search_max": 16,
            "max_steps": 2,
            "evals_per_epoch": 1,
        }
    )
    return write_config(tmp_path / "long.yaml", raw)


def run_in_worker(
    main: Callable[[list[str]], int], config: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hpo run` of study "s" by hpo's main in this process: with the config's trial_isolation
    none, its trials train here too, under this process's simulated memory budget."""
    assert main(["run", "--study", "s", "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]


def test_found_once_then_reused_by_every_trial(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    config = long_text_config(tmp_path, n_trials=3, trial_isolation="none")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    monkeypatch.setenv(BUDGET_ENV, str(60_000_000))
    monkeypatch.chdir(tmp_path)
    run_in_worker(hpo_main, config, url, capsys)
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    sources = [t.user_attrs["batch_size_source"] for t in trials]
    assert sources == ["search", "cache", "cache"]
    search = trials[0].user_attrs["batch_search"]
    assert 1 <= search["chosen"] < 16 and any(not fits for _, fits in search["probes"])
    assert {t.user_attrs["physical_batch_size"] for t in trials} == {min(search["chosen"], 8)}
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert hpo_main(["batch-size", "--config", str(config)]) == 0
    finder = capsys.readouterr().out
    assert f"chosen {search['chosen']}" in finder and "OOM" in finder


def test_out_of_memory_at_batch_one_prunes_and_the_worker_goes_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    config = long_text_config(tmp_path, n_trials=2, trial_isolation="none")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    monkeypatch.setenv(BUDGET_ENV, "100000")
    monkeypatch.chdir(tmp_path)
    run_in_worker(hpo_main, config, url, capsys)
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    assert all(t.user_attrs["prune_reason"].startswith("oom:") for t in trials)


def test_an_oom_in_a_trial_lowers_the_cached_size(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    from hpo.config.loader import load_config
    from hpo.config.search_paths import with_params
    from hpo.trainer.batch_finder import batch_key
    from hpo.trainer.model import load_tokenizer
    from hpo.trainer.tasks import prepare_data
    from tests.test_batch_finder import training_peak

    config_path = long_text_config(tmp_path, n_trials=1, trial_isolation="none")
    config = load_config(config_path)
    job = with_params(config, {})  # the trial's job: its search bounded by the study's batch
    data = prepare_data(job.data, load_tokenizer(job.model))
    # The study's effective batch is 8: one micro-batch of 8 does not fit, two of 4 do.
    peaks = [training_peak(job, data, physical, effective=8) for physical in (4, 8)]
    budget = str(sum(peaks) // 2)
    monkeypatch.setenv(BUDGET_ENV, budget)  # the key of a search includes the budget
    key = batch_key(job, torch_cpu(), "fp32")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    engine = sa.create_engine(url)
    cache = BatchSizeCache(engine)
    cache.record(key, 16, {"note": "stale: more than fits"})
    monkeypatch.chdir(tmp_path)
    run_in_worker(hpo_main, config_path, url, capsys)
    (trial,) = optuna.load_study(study_name="s", storage=url).get_trials()
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.user_attrs["batch_size_source"] == "cache"
    assert trial.user_attrs["oom_recoveries"] >= 1
    lowered = cache.get(key)
    engine.dispose()
    assert lowered == trial.user_attrs["physical_batch_size"] == 4


def torch_cpu() -> torch.device:
    return torch.device("cpu")


@pytest.mark.postgres
def test_a_trial_process_asks_its_worker_who_takes_search_locks_without_blocking(
    postgres_url: str,
) -> None:
    # Two workers' sides of the relay (issue 13: a trial process opens no connection).
    engine = sa.create_engine(postgres_url)
    try:
        first, second = (
            BatchCacheRequests(BatchSizeCache(engine)),
            BatchCacheRequests(BatchSizeCache(engine)),
        )
        assert first.answer(("lock", KEY)) == ("ok", True)
        assert second.answer(("lock", KEY)) is None  # not ready: asked again at the next poll
        assert second.answer(("lock", {**KEY, "max_length": 64})) == ("ok", True)  # other key
        relayed = RelayedBatchCache(first.answer)  # the trial process's calls, answered
        assert relayed.get(KEY) is None and relayed.record(KEY, 48, {"by": "first"}) == 48
        first.answer(("unlock", KEY))
        assert second.answer(("lock", KEY)) == ("ok", True)
        assert RelayedBatchCache(second.answer).get(KEY) == 48
        second.end_trial()  # the trial died holding both: released with it
        assert first.answer(("lock", KEY)) == ("ok", True)
        assert first.answer(("lock", {**KEY, "max_length": 64})) == ("ok", True)
        first.end_trial()
        with engine.connect() as conn:  # no lock left behind on pooled connections
            held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            assert conn.execute(sa.text(held)).scalar() == 0
    finally:
        engine.dispose()


def test_a_cache_error_reaches_the_trial_as_one_storage_error(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'cache.db'}")
    requests = BatchCacheRequests(BatchSizeCache(engine))
    assert requests.answer(("lock", KEY)) == ("ok", True)  # SQLite: no lock to wait for
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE hpo_batch_sizes"))
    status, reason = requests.answer(("get", KEY))
    assert status == "error" and "no such table" in reason
    with pytest.raises(StorageError, match="the batch-size cache: OperationalError"):
        RelayedBatchCache(requests.answer).get(KEY)
    engine.dispose()


@pytest.mark.postgres
def test_a_worker_and_its_trial_process_hold_at_most_two_connections(
    tmp_path: Path, postgres_url: str
) -> None:
    # Issue 13: PostgreSQL's stock 100 connections must serve many workers. The trial process
    # searches its batch size (a lock, a record) and later trials read the cache, all through
    # the worker; heartbeats, the study lock and Optuna share the worker's pool of 2.
    config = long_text_config(tmp_path, n_trials=3)
    worker = start_hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        postgres_url,
        cwd=tmp_path,
        env={BUDGET_ENV: str(60_000_000)},
    )
    database = sa.engine.make_url(postgres_url).database
    watcher = sa.create_engine(postgres_url, poolclass=sa.pool.NullPool)
    seen: dict[str, int] = {}
    query = sa.text(
        "SELECT application_name, count(*) FROM pg_stat_activity "
        "WHERE datname = :db AND application_name LIKE 'hpo %' GROUP BY application_name"
    )
    while worker.poll() is None:
        with watcher.connect() as conn:
            for name, count in conn.execute(query, {"db": database}):
                seen[name] = max(seen.get(name, 0), count)
        time.sleep(0.02)
    watcher.dispose()
    _, stderr = worker.communicate()
    assert worker.returncode == 0, stderr[-3000:]
    assert set(seen) == {f"hpo {worker.pid}"}, seen  # the trial process opened none
    assert max(seen.values()) <= 2, seen
    trials = optuna.load_study(study_name="s", storage=postgres_url).get_trials()
    assert [t.user_attrs["batch_size_source"] for t in trials] == ["search", "cache", "cache"]


def test_the_search_stops_at_the_largest_batch_the_study_can_use(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # Issue 42: on an H200 the first trial probed up to 2,836 for a space whose largest batch
    # was 256. A study of effective batches up to 2 probes no further than ceil(2 / 0.9) = 3;
    # a later study of larger batches on the same database searches again, further.
    config = long_text_config(tmp_path, n_trials=1, trial_isolation="none")
    raw = yaml.safe_load(config.read_text())
    raw["search_space"]["effective_batch_size"]["choices"] = [1, 2]
    small = write_config(tmp_path / "small.yaml", raw)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    monkeypatch.setenv(BUDGET_ENV, str(60_000_000))
    monkeypatch.chdir(tmp_path)
    assert hpo_main(["run", "--study", "small", "--config", str(small), "--storage", url]) == 0
    (trial,) = optuna.load_study(study_name="small", storage=url).get_trials()
    probes = trial.user_attrs["batch_search"]["probes"]
    assert max(size for size, _ in probes) == 3 and all(fits for _, fits in probes), probes
    assert trial.user_attrs["batch_search"]["chosen"] == 2
    run_in_worker(hpo_main, config, url, capsys)  # study "s": effective batch 8
    (trial,) = optuna.load_study(study_name="s", storage=url).get_trials()
    assert trial.user_attrs["batch_size_source"] == "search"
    assert max(size for size, _ in trial.user_attrs["batch_search"]["probes"]) > 3


def test_the_bound_holds_the_largest_batch_after_the_margin() -> None:
    from hpo.config.loader import load_config
    from hpo.config.search_paths import batch_search_bound, with_params

    config = load_config(REPO / "bench/configs/bert-base-nli.yaml")
    assert batch_search_bound(config) == 285  # choices up to 256, margin 0.9: floor(285 * 0.9)
    assert with_params(config, {"effective_batch_size": 32}).training.batch_search_max == 285
    config.training.batch_search_max = 100  # the config's own limit is lower: it stands
    assert batch_search_bound(config) == 100
    config.search_space.pop("effective_batch_size")
    config.training.batch_search_max, config.training.effective_batch_size = 4096, 50
    assert batch_search_bound(config) == 56
    config.training.physical_batch_size = 16  # no search: nothing to bound
    assert with_params(config, {}).training.batch_search_max == 4096
