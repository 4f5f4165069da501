"""hpo copy: a study moved between databases with every trial, value, intermediate value,
parameter, attribute and batch-size record equal; refused in one line when it cannot be, and
never half-written (an error, Ctrl-C, SIGTERM or SIGKILL mid-copy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from tests.conftest import REPO, exit_code, run_hpo, run_study, tiny_config, write_config

Main = Callable[[list[str]], int]
STUDY = "moving"


@pytest.fixture(autouse=True)
def _quiet_optuna() -> Iterator[None]:
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(level)


def rich_study(url: str, name: str = STUDY, running: bool = True) -> optuna.Study:
    """A study with a trial in every state, every kind of distribution, NaN and infinite
    intermediate values, user and system attributes, hpo's batch-size records and a heartbeat."""
    from hpo.storage.batch_cache import BatchSizeCache
    from hpo.storage.heartbeats import Heartbeats

    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_metric_names(["accuracy"])  # a study system attribute
    storage.set_study_system_attr(storage.get_study_id_from_name(name), "hpo:kept", [1, "a"])
    study.set_user_attr("search_space", {"lr": {"type": "float", "low": 1e-5, "high": 1e-3}})
    distributions = {
        "lr": FloatDistribution(1e-5, 1e-3, log=True),
        "layers": IntDistribution(1, 9, step=2),
        "optimizer": CategoricalDistribution(["adamw", None, True, 1.5]),
        "dropout": FloatDistribution(0.0, 0.5, step=0.1),
    }
    params = {"lr": 3e-4, "layers": 5, "optimizer": None, "dropout": 0.2}
    study.add_trial(
        create_trial(
            value=0.875,
            params=params,
            distributions=distributions,
            user_attrs={"physical_batch_size": 16, "metrics": {"f1": [0.5, 0.7]}, "wall_s": 1.5},
            system_attrs={"hpo:note": "kept"},
            intermediate_values={0: 0.5, 1: math.nan, 2: math.inf, 3: -math.inf, 4: 0.875},
        )
    )
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={**params, "optimizer": "adamw"},
            distributions=distributions,
            user_attrs={"prune_reason": "below the median at step 1"},
            intermediate_values={0: 0.1, 1: 0.2},
        )
    )
    study.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params={**params, "optimizer": True},
            distributions=distributions,
            user_attrs={"fail_reason": "CUDA out of memory at batch 1"},
        )
    )
    study.add_trial(create_trial(value=-math.inf, params=params, distributions=distributions))
    engine = sa.create_engine(url)
    BatchSizeCache(engine).record({"model": "tiny", "max_length": 32}, 24, {"probes": [[32, 0]]})
    BatchSizeCache(engine).record({"model": "tiny", "max_length": 64}, 8, {"probes": []})
    if running:
        trial = study.ask()
        trial.report(0.25, 0)
        Heartbeats(engine, study._study_id).start(trial.number, "worker-1")
    study.enqueue_trial({"lr": 1e-4, "layers": 3}, user_attrs={"queued_by": "test"})
    engine.dispose()
    return study


def trial_view(trial: Any) -> dict[str, Any]:
    """Every field a copy keeps; NaN compares equal as text."""
    return {
        "number": trial.number,
        "state": trial.state,
        "values": json.dumps(trial.values),
        "datetime_start": trial.datetime_start,
        "datetime_complete": trial.datetime_complete,
        "params": json.dumps(trial.params),
        "distributions": trial.distributions,
        "user_attrs": trial.user_attrs,
        "system_attrs": trial.system_attrs,
        "intermediate_values": json.dumps(trial.intermediate_values, sort_keys=True),
    }


def study_view(url: str, name: str) -> dict[str, Any]:
    storage = optuna.storages.RDBStorage(url)
    study = optuna.load_study(study_name=name, storage=storage)
    return {
        "directions": study.directions,
        "metric_names": study.metric_names,
        "user_attrs": study.user_attrs,
        "system_attrs": storage.get_study_system_attrs(storage.get_study_id_from_name(name)),
        "trials": [trial_view(t) for t in study.get_trials(deepcopy=False)],
    }


def rows(url: str, table: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(url)
    try:
        if not sa.inspect(engine).has_table(table):
            return []
        reflected = sa.Table(table, sa.MetaData(), autoload_with=engine)  # typed columns
        with engine.connect() as conn:
            found = conn.execute(sa.select(reflected).order_by(*reflected.primary_key))
            return [dict(row) for row in found.mappings()]
    finally:
        engine.dispose()


def names(url: str) -> list[str]:
    return sorted(optuna.study.get_all_study_names(storage=url))


def copy_args(source: str, target: str, *extra: str, study: str = STUDY) -> list[str]:
    return ["copy", "--study", study, "--from", source, "--to", target, *extra]


def sqlite(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name}"


@pytest.mark.postgres
def test_sqlite_to_postgres_and_back(
    tmp_path: Path, postgres_url: str, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    laptop, back = sqlite(tmp_path, "laptop.db"), sqlite(tmp_path, "back.db")
    rich_study(laptop)
    before = study_view(laptop, STUDY)
    assert hpo_main(copy_args(laptop, postgres_url, "--allow-running")) == 0
    out = capsys.readouterr().out
    assert (
        "6 trials (2 COMPLETE, 1 FAIL, 1 PRUNED, 1 RUNNING, 1 WAITING)" in out
        and "2 batch-size records" in out
    ), out
    assert study_view(postgres_url, STUDY) == before
    assert hpo_main(copy_args(postgres_url, back, "--allow-running")) == 0
    assert study_view(back, STUDY) == before
    assert rows(back, "hpo_batch_sizes") == rows(laptop, "hpo_batch_sizes") != []
    assert rows(postgres_url, "hpo_batch_sizes") == rows(laptop, "hpo_batch_sizes")
    # Heartbeats stay behind: no worker runs the copy's RUNNING trial.
    assert len(rows(laptop, "hpo_heartbeats")) == 1
    assert rows(postgres_url, "hpo_heartbeats") == rows(back, "hpo_heartbeats") == []


@pytest.mark.postgres
def test_a_password_in_the_urls_is_never_printed(
    tmp_path: Path, postgres_url: str, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    # The test server trusts its clients: a password in the URL is accepted and ignored.
    with_password = postgres_url.replace("postgres@", "postgres:hunter2@")
    assert with_password != postgres_url
    laptop = sqlite(tmp_path, "laptop.db")
    rich_study(laptop, running=False)
    assert hpo_main(copy_args(laptop, with_password)) == 0
    assert hpo_main(copy_args(with_password, laptop, study="nope")) == 2
    assert hpo_main(copy_args(laptop, with_password)) == 2  # the name is taken
    out, err = capsys.readouterr()
    assert "--storage URL (the --to URL)" in out and "postgres:***@" in out, out
    assert "no study 'nope' in postgresql+psycopg2://postgres:***@" in err, err
    assert "hunter2" not in out + err


def test_copy_keeps_everything_between_sqlite_files(
    tmp_path: Path,
    hpo_main: Main,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source)
    monkeypatch.setattr("hpo.commands.copy.PROGRESS_EVERY_S", 0.0)
    assert hpo_main(copy_args(source, target, "--allow-running", "--to-study", "renamed")) == 0
    err = capsys.readouterr().err
    assert "copying: 6 of 6 trials written" in err and "1 RUNNING trial (#4)" in err, err
    assert "hpo-copy-" not in err  # Optuna's line about the temporary study is not shown
    assert study_view(target, "renamed") == study_view(source, STUDY)
    assert names(target) == ["renamed"]  # no temporary study left
    assert rows(target, "hpo_batch_sizes") == rows(source, "hpo_batch_sizes")


def test_several_objectives(tmp_path: Path, hpo_main: Main) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    study = optuna.create_study(
        study_name=STUDY, storage=source, directions=["maximize", "minimize"]
    )
    study.optimize(lambda t: (t.suggest_float("x", 0, 1), t.suggest_int("n", 1, 4)), n_trials=4)
    assert hpo_main(copy_args(source, target)) == 0
    assert study_view(target, STUDY) == study_view(source, STUDY)


def test_an_empty_study(tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    optuna.create_study(study_name=STUDY, storage=source, direction="minimize")
    assert hpo_main(copy_args(source, target)) == 0
    assert "0 trials (none), 0 batch-size records" in capsys.readouterr().out
    assert study_view(target, STUDY) == study_view(source, STUDY)


def test_running_trials_refused_unless_allowed(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = sqlite(tmp_path, "a.db"), tmp_path / "b.db"
    rich_study(source)
    assert hpo_main(copy_args(source, f"sqlite:///{target}")) == 2
    err = capsys.readouterr().err
    assert "1 RUNNING trial (#4)" in err and "--allow-running" in err
    assert len(err.strip().splitlines()) == 1
    assert not target.exists()  # refused before the target was opened


def test_target_that_holds_the_name_is_refused(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    optuna.create_study(study_name=STUDY, storage=target).optimize(
        lambda t: t.suggest_float("y", 0, 1), n_trials=1
    )
    assert hpo_main(copy_args(source, target)) == 2
    err = capsys.readouterr().err
    assert "already holds a study 'moving'" in err and len(err.strip().splitlines()) == 1
    assert len(optuna.load_study(study_name=STUDY, storage=target).trials) == 1
    assert names(target) == [STUDY]
    assert hpo_main(copy_args(source, target, "--to-study", "")) == 2
    assert "--to-study: the study name is empty" in capsys.readouterr().err
    # A look-alike name (another case) is refused too: `hpo studies` would print them alike.
    assert hpo_main(copy_args(source, target, "--to-study", "MOVING")) == 2
    assert "differs only in case" in capsys.readouterr().err


def test_unknown_study_lists_the_sources(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = sqlite(tmp_path, "a.db"), tmp_path / "b.db"
    rich_study(source, running=False)
    optuna.create_study(study_name="other", storage=source)
    assert hpo_main(copy_args(source, f"sqlite:///{target}", study="nope")) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("it holds 'moving', 'other'") and len(err.splitlines()) == 1, err
    assert not target.exists()


@pytest.mark.parametrize(
    ("source", "target", "says"),
    [
        ("sqlite:///{tmp}/missing.db", "sqlite:///{tmp}/b.db", "no study database at"),
        ("sqlite:///{tmp}/a.db", "mysql://u:hunter2@h/db", "which hpo does not support"),
        ("sqlite:///{tmp}/a.db", "postgres://u:hunter2@h/db", "postgresql+psycopg2://"),
        ("sqlite:///{tmp}/a.db", "", "--to is empty"),
        (" ", "sqlite:///{tmp}/b.db", "--from is empty"),
        ("sqlite:///{tmp}/a.db", "sqlite:///{tmp}/no/such/folder/b.db", "folder"),
        ("sqlite:///{tmp}/a.db", "postgresql+psycopg2://u:hunter2@127.0.0.1:1/db", "u:***@"),
    ],
)
def test_bad_urls_are_one_line_without_the_password(
    tmp_path: Path,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
    source: str,
    target: str,
    says: str,
) -> None:
    rich_study(sqlite(tmp_path, "a.db"), running=False)
    args = copy_args(source.format(tmp=tmp_path), target.format(tmp=tmp_path))
    assert hpo_main(args) == 2
    err = capsys.readouterr().err
    assert says in err and "hunter2" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b.db").exists()


def test_same_database(tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]) -> None:
    source = sqlite(tmp_path, "a.db")
    rich_study(source, running=False)
    other_spelling = f"sqlite:///{tmp_path}/./a.db"
    assert hpo_main(copy_args(source, other_spelling)) == 2
    assert "same database" in capsys.readouterr().err
    assert hpo_main(copy_args(source, other_spelling, "--to-study", "fork")) == 0
    assert "0 batch-size records" in capsys.readouterr().out  # one table: nothing to bring
    assert study_view(source, "fork") == study_view(source, STUDY)
    assert len(rows(source, "hpo_batch_sizes")) == 2


def _failing_after(calls: int, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpo.storage.resilient import ResilientStorage

    original = ResilientStorage.create_new_trial
    made: list[int] = []

    def create_new_trial(self: Any, study_id: int, template_trial: Any = None) -> int:
        if len(made) == calls:
            raise error
        made.append(study_id)
        return original(self, study_id, template_trial)

    monkeypatch.setattr(ResilientStorage, "create_new_trial", create_new_trial)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (KeyboardInterrupt(), 130),
        (sa.exc.OperationalError("insert", {}, Exception("server closed the connection")), 2),
    ],
)
def test_failure_mid_copy_leaves_nothing(
    tmp_path: Path,
    hpo_main: Main,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
    code: int,
) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    optuna.create_study(study_name="already-there", storage=target)
    _failing_after(3, error, monkeypatch)
    assert hpo_main(copy_args(source, target)) == code
    err = capsys.readouterr().err
    if code == 2:
        assert "nothing was copied" in err and len(err.strip().splitlines()) == 1, err
    assert names(target) == ["already-there"]  # neither the study nor its temporary copy
    assert rows(target, "hpo_batch_sizes") == []


def test_source_changed_while_copied_is_not_published(
    tmp_path: Path,
    hpo_main: Main,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hpo.storage.resilient import ResilientStorage

    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    original = ResilientStorage.create_new_trial

    def create_new_trial(self: Any, study_id: int, template_trial: Any = None) -> int:
        if template_trial is not None and template_trial.number == 0:
            # A worker of the source finishes a trial while the copy is written.
            worker = optuna.load_study(study_name=STUDY, storage=source)
            worker.tell(worker.ask(), 0.5)
        return original(self, study_id, template_trial)

    monkeypatch.setattr(ResilientStorage, "create_new_trial", create_new_trial)
    assert hpo_main(copy_args(source, target)) == 2
    assert "changed while it was copied" in capsys.readouterr().err
    assert names(target) == []


def test_a_study_of_the_name_made_during_the_copy_wins(
    tmp_path: Path,
    hpo_main: Main,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import hpo.storage.study_copy

    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    checked = hpo.storage.study_copy._check_copy

    def check_then_race(*args: Any) -> None:
        checked(*args)
        # Another copy (or a worker) creates the study before this one is published.
        optuna.create_study(study_name=STUDY, storage=target).optimize(
            lambda t: t.suggest_float("y", 0, 1), n_trials=1
        )

    monkeypatch.setattr(hpo.storage.study_copy, "_check_copy", check_then_race)
    assert hpo_main(copy_args(source, target)) == 2
    err = capsys.readouterr().err
    assert "appeared in the target during the copy" in err and len(err.strip().splitlines()) == 1
    assert names(target) == [STUDY]  # the other one, untouched; the copy deleted
    assert len(optuna.load_study(study_name=STUDY, storage=target).trials) == 1
    assert rows(target, "hpo_batch_sizes") == []


KILLER = """
import os, signal, sys
from hpo.storage.resilient import ResilientStorage
original = ResilientStorage.create_new_trial
made = []
def create_new_trial(self, study_id, template_trial=None):
    if len(made) == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    made.append(1)
    return original(self, study_id, template_trial)
ResilientStorage.create_new_trial = create_new_trial
from hpo.cli.app import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_killed_mid_copy_publishes_nothing(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str], signal_name: str
) -> None:
    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLER), signal_name, *copy_args(source, target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert STUDY not in names(target), killed.stderr
    if signal_name == "SIGTERM":  # stopped: the unfinished copy deleted on the way out
        assert killed.returncode == 143, killed.stderr  # not 0: a script must not go on
        assert "stopped by SIGTERM: nothing was copied" in killed.stderr
        assert names(target) == []
        return
    assert killed.returncode == -9
    leftovers = names(target)  # killed outright: a temporary study, never the study's name
    assert len(leftovers) == 1 and leftovers[0].startswith("hpo-copy-")
    assert rows(target, "hpo_batch_sizes") == []
    # The next copy goes through, and says what the killed one left.
    assert hpo_main(copy_args(source, target)) == 0
    assert "unfinished copies" in capsys.readouterr().err
    assert study_view(target, STUDY) == study_view(source, STUDY)


def test_batch_sizes_merge_keeps_the_smaller(tmp_path: Path, hpo_main: Main) -> None:
    from hpo.storage.batch_cache import BatchSizeCache

    source, target = sqlite(tmp_path, "a.db"), sqlite(tmp_path, "b.db")
    rich_study(source, running=False)
    engine = sa.create_engine(target)
    cache = BatchSizeCache(engine)
    cache.record({"model": "tiny", "max_length": 32}, 12, {})  # smaller than the source's 24
    cache.record({"model": "tiny", "max_length": 64}, 32, {})  # larger than the source's 8
    assert hpo_main(copy_args(source, target)) == 0
    assert cache.get({"model": "tiny", "max_length": 32}) == 12
    assert cache.get({"model": "tiny", "max_length": 64}) == 8
    engine.dispose()


@pytest.mark.postgres
def test_a_real_study_moved_to_postgres_reads_the_same_and_runs_on(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`hpo run` on a laptop's SQLite file, `hpo copy` (the real CLI) to PostgreSQL: status
    and best agree there, and a worker on the copy adds trials to it."""
    raw = tiny_config(*easy_data, training={"physical_batch_size": "auto"})
    config = write_config(tmp_path / "study.yaml", raw)
    laptop = sqlite(tmp_path, "laptop.db")
    ran = run_study(config, laptop, tmp_path, study=STUDY)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert rows(laptop, "hpo_batch_sizes") != []  # the batch finder's record, to be kept
    copied = run_hpo(*copy_args(laptop, postgres_url), cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert "2 trials (2 COMPLETE)" in copied.stdout
    capsys.readouterr()

    def read(command: str, url: str) -> Any:
        assert hpo_main([command, "--study", STUDY, "--storage", url, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    for command in ("status", "best"):
        assert read(command, postgres_url) == read(command, laptop), command
    assert rows(postgres_url, "hpo_batch_sizes") == rows(laptop, "hpo_batch_sizes")
    args = ["run", "--study", STUDY, "--config", str(config), "--storage", postgres_url]
    assert hpo_main([*args, "--n-trials", "3"]) == 0
    trials = optuna.load_study(study_name=STUDY, storage=postgres_url).trials
    assert [t.number for t in trials] == [0, 1, 2]
    assert trials[2].state == TrialState.COMPLETE
    assert trials[2].user_attrs["batch_size_source"] == "cache"  # the copied record, reused
    assert len(optuna.load_study(study_name=STUDY, storage=laptop).trials) == 2


def test_the_flags_become_a_copy_request(
    hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpo.cli.app import copy_request
    from hpo.cli.parser import build_parser
    from hpo.commands.copy import CopyRequest

    argv = [*copy_args("sqlite:///a.db", "sqlite:///b.db"), "--to-study", "b", "--allow-running"]
    request = copy_request(build_parser().parse_args(argv))
    assert request == CopyRequest(STUDY, "sqlite:///a.db", "sqlite:///b.db", "b", True)
    assert exit_code(hpo_main, ["copy", "--study", STUDY, "--to", "sqlite:///b.db"]) == 2
    assert "the following arguments are required: --from" in capsys.readouterr().err
    assert exit_code(hpo_main, ["copy", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "published whole at its end, or not at all" in text and "--allow-running" in text


def test_hpo_tables_of_another_layout_are_refused_before_a_write(
    tmp_path: Path, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = sqlite(tmp_path, "a.db"), tmp_path / "b.db"
    rich_study(source, running=False)
    engine = sa.create_engine(source)
    with engine.begin() as conn:
        conn.execute(sa.text("update hpo_schema_version set version = 99"))
    engine.dispose()
    assert hpo_main(copy_args(source, f"sqlite:///{target}")) == 2
    err = capsys.readouterr().err
    assert "layout version 99, made by a newer hpo" in err and len(err.strip().splitlines()) == 1
    assert not target.exists()
