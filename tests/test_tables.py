"""hpo's own tables (storage/tables.py): created with their layout version on first use, the
version of a database from before it was recorded read as the first, and a database whose
tables another version of hpo laid out refused in one line before anything is written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from hpo.storage.heartbeats import Heartbeats
from hpo.storage.tables import (
    SCHEMA_VERSION,
    SchemaVersionError,
    batch_sizes,
    ensure_tables,
    heartbeats,
    metadata,
    recorded_version,
    schema_version,
)
from tests.conftest import easy_rows, tiny_config, write_config, write_csv


def _engine(path: Path) -> sa.Engine:
    return sa.create_engine(f"sqlite:///{path}")


def test_first_use_creates_every_table_with_the_version(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "hpo.db")
    assert recorded_version(engine) is None
    ensure_tables(engine)
    names = set(sa.inspect(engine).get_table_names())
    assert {t.name for t in metadata.sorted_tables} <= names
    assert recorded_version(engine) == SCHEMA_VERSION
    ensure_tables(_engine(tmp_path / "hpo.db"))  # a second worker: one row still
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schema_version)).scalar() == 1
    engine.dispose()


def test_tables_from_before_the_version_was_recorded_are_the_first_layout(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "hpo.db")
    heartbeats.create(engine)
    batch_sizes.create(engine)
    assert recorded_version(engine) == 1
    ensure_tables(engine)
    assert recorded_version(engine) == 1
    engine.dispose()


def _from_another_hpo(path: Path, version: int) -> sa.Engine:
    engine = _engine(path)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(schema_version.insert().values(id=1, version=version))
    return engine


def test_another_layout_is_refused_naming_both_versions(tmp_path: Path) -> None:
    engine = _from_another_hpo(tmp_path / "hpo.db", SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match=f"version {SCHEMA_VERSION + 1}, made by a newer"):
        Heartbeats(engine, study_id=1)
    engine.dispose()


def test_a_worker_on_a_newer_database_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    database = tmp_path / "hpo.db"
    url = f"sqlite:///{database}"
    _from_another_hpo(database, SCHEMA_VERSION + 1).dispose()
    optuna.create_study(study_name="other", storage=url)  # the database is in use
    train = write_csv(tmp_path / "train.csv", easy_rows(32, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    config = write_config(tmp_path / "c.yaml", tiny_config(train, evaluation))
    code = hpo_main(["run", "--study", "s", "--config", str(config), "--storage", url])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("hpo: error")]
    assert len(lines) == 1, err
    assert f"layout version {SCHEMA_VERSION + 1}" in lines[0]
    assert f"version {SCHEMA_VERSION}." in lines[0]
    assert "Traceback" not in err
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert names == ["other"]
