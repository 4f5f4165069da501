"""Storage URL precedence, validation and password masking."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpo.errors import StorageError
from storage import mask_url, open_storage, resolve_storage_url
from storage.url import mask_text


def test_precedence_cli_env_config_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_storage_url(None, None).url == f"sqlite:///{tmp_path / 'hpo.db'}"
    assert resolve_storage_url(None, None).origin == "default"
    assert resolve_storage_url(None, "sqlite:///cfg.db").origin == "config"
    monkeypatch.setenv("HPO_STORAGE", "sqlite:///env.db")
    assert resolve_storage_url(None, "sqlite:///cfg.db").url == "sqlite:///env.db"
    chosen = resolve_storage_url("postgresql+psycopg2://u:pw@h/db", "sqlite:///cfg.db")
    assert (chosen.url, chosen.origin) == ("postgresql+psycopg2://u:pw@h/db", "--storage")


def test_default_describes_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        resolve_storage_url(None, None).describe()
        == f"SQLite file {tmp_path / 'hpo.db'} (from default)"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "is not a database URL"),
        ("mysql://u:secret@h/db", "'mysql', which hpo does not support"),
        ("sqlite://", "names no SQLite file"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as caught:
        resolve_storage_url(url, None)
    assert "secret" not in str(caught.value)


def test_masking() -> None:
    assert (
        mask_url("postgresql+psycopg2://alice:s3cr%40t@db:5432/hpo")
        == "postgresql+psycopg2://alice:***@db:5432/hpo"
    )
    assert mask_url("sqlite:///hpo.db") == "sqlite:///hpo.db"
    text = 'connection to "postgresql://bob:hunter2@10.0.0.1/x" failed'
    assert mask_text(text) == 'connection to "postgresql://bob:***@10.0.0.1/x" failed'


def test_unreachable_server_fails_fast_without_the_password() -> None:
    # Port 1 on loopback refuses at once; the message must still be one masked line.
    url = resolve_storage_url("postgresql+psycopg2://alice:topsecret@127.0.0.1:1/hpo", None)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        open_storage(url)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "topsecret" not in message and "alice:***@127.0.0.1:1/hpo" in message
    assert "\n" not in message


def test_sqlite_in_a_missing_folder(tmp_path: Path) -> None:
    url = resolve_storage_url(f"sqlite:///{tmp_path}/absent/folder/hpo.db", None)
    with pytest.raises(StorageError, match="cannot open the study database"):
        open_storage(url)


def test_a_running_trial_that_never_sent_a_heartbeat_is_failed_and_retried(
    tmp_path: Path,
) -> None:
    import optuna
    import sqlalchemy as sa
    from optuna.trial import TrialState

    from storage.engine import Liveness
    from storage.url import StorageURL

    url = StorageURL(f"sqlite:///{tmp_path / 'silent.db'}", "test")
    storage = open_storage(url, liveness=Liveness(1, 2, max_retries=1))
    study = optuna.create_study(study_name="silent", storage=storage)
    # Two RUNNING trials without a heartbeat, as a creation whose reply an outage lost leaves.
    with pytest.warns(UserWarning, match="Heartbeat of storage"):
        old, new = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), study.ask()
    with storage.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE trials SET datetime_start = '2000-01-01' WHERE trial_id = :id"),
            {"id": old._trial_id},
        )
    optuna.storages.fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[old.number] == TrialState.FAIL  # silent for years
    assert states[new.number] == TrialState.RUNNING  # just started: not yet
    retry = [t for t in study.get_trials() if t.state == TrialState.WAITING]
    assert len(retry) == 1 and retry[0].params == {"x": old.params["x"]}
