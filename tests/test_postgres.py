"""The same `hpo run` on PostgreSQL (fails in CI when the server is unreachable)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from tests.conftest import tiny_config, write_config
from tests.study_checks import check_small_study, run_small_study

pytestmark = pytest.mark.postgres


def test_study_on_postgres(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    study = run_small_study(tmp_path, easy_data, postgres_url, "cli-postgres", hpo_main, capsys)
    check_small_study(study)


def test_bad_config_writes_no_study(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    raw = tiny_config(*easy_data, training={"epochs": 0})
    config = write_config(tmp_path / "bad.yaml", raw)
    args = ["run", "--study", "s", "--config", str(config), "--storage", postgres_url]
    assert hpo_main(args) == 2
    assert "training.epochs: got 0" in capsys.readouterr().err
    assert optuna.study.get_all_study_names(storage=postgres_url) == []
