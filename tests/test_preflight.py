"""`hpo run`'s checks before the first trial (issue 23): the artifact store tried once, a model
folder's weights read, the study database reached before the data is prepared, a device file
refused as an SQLite file; each a line and exit 2 with nothing written. And a store's refusal
met mid-study, not retried as if it could pass."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import sqlalchemy as sa

from hpo.storage.artifacts import (
    ArtifactStore,
    ArtifactStoreError,
    ArtifactTarget,
    FileBackend,
    StoreRefused,
    is_refusal,
    validated_artifact_url,
)
from hpo.trial.uploads import BackgroundUploader, Backoff
from tests.conftest import TINY_BERT, run_hpo, tiny_config, write_config

Main = Callable[[list[str]], int]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # what a run would write beside it lands here, and is seen


@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data is never prepared: a check that comes after it fails the test."""
    import hpo.trainer.tasks
    import hpo.trainer.token_cache

    def prepare_data(*args: Any) -> None:
        raise AssertionError("the data was prepared before the check")

    monkeypatch.setattr(hpo.trainer.tasks, "prepare_data", prepare_data)
    monkeypatch.setattr(hpo.trainer.token_cache, "prepare_splits", prepare_data)


def run(main: Main, config: Path, storage: str, *more: str) -> int:
    return main(["run", "--study", "s", "--config", str(config), "--storage", storage, *more])


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hpo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- the artifact store ------------------------------------------------------------------------


@pytest.fixture
def no_aws_credentials(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no wait on an instance role


def test_a_store_without_credentials_is_one_line_and_exit_2_before_the_data(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    no_aws_credentials: None,
    no_data: None,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    started = time.monotonic()
    code = run(hpo_main, config, f"sqlite:///{tmp_path / 's.db'}", "--artifact-store", "s3://hpo/x")
    assert code == 2
    line = one_line_error(capsys)
    assert "artifact store s3://hpo/x: cannot write .hpo-probe-" in line, line
    assert "Unable to locate credentials" in line and "$AWS_ACCESS_KEY_ID" in line, line
    assert time.monotonic() - started < 30  # not study.artifact_patience per trial
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "data"]


def test_a_missing_bucket_is_refused_and_the_probe_leaves_nothing(s3: dict[str, str]) -> None:
    with pytest.raises(StoreRefused, match="NoSuchBucket|does not exist") as caught:
        ArtifactStore("s3://no-such-bucket/x").check()
    assert "check the bucket's name" in str(caught.value) and "\n" not in str(caught.value)
    assert "testing-secret" not in str(caught.value)
    store = ArtifactStore("s3://hpo/studies")
    store.check()
    assert list(store.backend.list("")) == []  # the probe was deleted


def test_which_store_errors_are_permanent() -> None:
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    def answer(code: str, status: int) -> ClientError:
        meta: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(meta, "PutObject")

    assert is_refusal(NoCredentialsError())
    assert is_refusal(answer("AccessDenied", 403)) and is_refusal(answer("NoSuchBucket", 404))
    assert is_refusal(answer("InvalidAccessKeyId", 403)) and is_refusal(answer("Odd", 403))
    assert is_refusal(OSError(errno.EACCES, "Permission denied"))
    assert is_refusal(OSError(errno.EROFS, "Read-only file system"))
    assert not is_refusal(answer("SlowDown", 503)) and not is_refusal(answer("InternalError", 500))
    assert not is_refusal(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert not is_refusal(OSError(errno.ENOSPC, "No space left on device"))  # may be freed


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys")
def test_a_folder_that_cannot_be_written_is_refused() -> None:
    with pytest.raises(StoreRefused, match="let this user write to the folder"):
        ArtifactStore("file:///sys/hpo-store").check()  # /sys: EPERM (root) or EACCES


def test_a_missing_folder_is_made_by_the_run_not_by_the_check(tmp_path: Path) -> None:
    folder = tmp_path / "shared" / "hpo"
    with pytest.raises(ArtifactStoreError, match="nor is"):  # a mount missing: not made
        validated_artifact_url(f"file://{folder}")
    (tmp_path / "shared").mkdir()
    store = ArtifactStore(validated_artifact_url(f"file://{folder}"))
    store.check()
    assert not folder.exists()  # the check leaves nothing behind
    with pytest.raises(ArtifactStoreError, match="is not a folder"):  # `hpo status` says so
        store.size("s-0123456789ab")
    store.create()
    assert folder.is_dir() and store.size("s-0123456789ab") == 0


class Refuses:
    """A backend that refuses every upload, as S3 does without credentials."""

    def __init__(self, inner: FileBackend) -> None:
        self.inner, self.puts = inner, 0

    def put(self, key: str, source: BinaryIO) -> None:
        self.puts += 1
        raise StoreRefused("cannot upload (s3://hpo): Unable to locate credentials")

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_refusal_mid_study_is_not_retried_for_the_whole_patience(tmp_path: Path) -> None:
    backend = Refuses(FileBackend(tmp_path / "store"))
    target = ArtifactTarget(f"file://{tmp_path / 'store'}", "s-0123456789ab", "trial-0")
    store = ArtifactStore(target.url, backend)  # type: ignore[arg-type]
    uploader = BackgroundUploader(store, target, Backoff(0.05, 0.1))
    (tmp_path / "checkpoint.pt").write_bytes(b"state")
    uploader.submit("state", tmp_path / "checkpoint.pt")
    assert not uploader.flush(timeout_s=5)  # refused: not in the store, and nothing pending
    uploader.submit("state", tmp_path / "checkpoint.pt")  # a later checkpoint: not tried
    started = time.monotonic()
    assert not uploader.close(timeout_s=120)  # study.artifact_patience's default
    assert time.monotonic() - started < 5
    assert backend.puts == 1 and len(uploader.stats.errors) == 1
    assert "Unable to locate credentials" in uploader.stats.errors[0]


# -- the model folder --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    settings = dict(TINY_BERT)
    folder = tmp_path_factory.mktemp("model") / "tiny-bert"
    config = AutoConfig.for_model(settings.pop("model_type"), num_labels=2, **settings)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return folder


def model_config(tmp_path: Path, easy_data: tuple[Path, Path], folder: Path) -> Path:
    raw = tiny_config(*easy_data)
    raw["model"] = {"name_or_path": str(folder), "tokenizer": raw["model"]["tokenizer"]}
    return write_config(tmp_path / "c.yaml", raw)


def damaged(saved: Path, into: Path, damage: str) -> Path:
    import shutil

    folder = shutil.copytree(saved, into)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "missing":
        weights.unlink()
    else:  # a shard index naming a shard that is not there
        weights.rename(folder / "model-00001-of-00002.safetensors")
        shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    return folder


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("truncated", "model.safetensors is damaged (Error while deserializing header: incompl"),
        ("missing", "has a config.json but no weights (model.safetensors or pytorch_model.bin)"),
        ("shard missing", "has no model-00002-of-00002.safetensors, which model.safetensors.in"),
    ],
)
def test_a_model_folder_with_bad_weights_is_one_line_before_the_data(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    saved_model: Path,
    damage: str,
    said: str,
    no_data: None,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = damaged(saved_model, tmp_path / "model", damage)
    config = model_config(tmp_path, easy_data, folder)
    assert run(hpo_main, config, f"sqlite:///{tmp_path / 's.db'}") == 2
    line = one_line_error(capsys)
    assert said in line and str(folder) in line, line
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "checkpoints").exists()


def test_whole_weights_pass_the_check(saved_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hpo.trainer.config import ModelConfig
    from hpo.trainer.model import check_model_config

    check_model_config(ModelConfig(name_or_path=str(saved_model)), 32)
    model = AutoModelForSequenceClassification.from_pretrained(saved_model)
    legacy = tmp_path / "legacy"  # pytorch_model.bin, as older transformers saved it
    legacy.mkdir()
    (legacy / "config.json").write_bytes((saved_model / "config.json").read_bytes())
    torch.save(model.state_dict(), legacy / "pytorch_model.bin")
    check_model_config(ModelConfig(name_or_path=str(legacy)), 32)


# -- the study database ------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_wrong_database_name_is_said_before_the_data_is_prepared(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    no_data: None,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = postgres_url.rsplit("/", 1)[0].replace("postgres@", "postgres:Zq9secret@") + "/no_such"
    assert run(hpo_main, config, url) == 2
    line = one_line_error(capsys)
    assert 'database "no_such" does not exist' in line and "createdb -h 127.0.0.1" in line, line
    assert "Zq9secret" not in line


@pytest.fixture
def plain_user(postgres_url: str) -> Iterator[str]:
    """A user without CREATE on the schema public of a fresh database (PostgreSQL 15's rule for
    anyone but the owner); dropped afterwards."""
    name = f"hpo_plain_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN"))
        conn.execute(sa.text(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {name}"))
    try:
        yield postgres_url.replace("postgres@", f"{name}@", 1)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {name}"))
        admin.dispose()
        from tests.conftest import PG_ADMIN_URL

        server = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with server.connect() as conn:
            conn.execute(sa.text(f"DROP ROLE IF EXISTS {name}"))
        server.dispose()


@pytest.mark.postgres
def test_a_user_who_may_not_create_the_tables_is_told_before_the_data(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    plain_user: str,
    no_data: None,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    assert run(hpo_main, config, plain_user) == 2
    line = one_line_error(capsys)
    assert "may not create Optuna's tables" in line and "GRANT CREATE ON SCHEMA public" in line
    engine = sa.create_engine(plain_user)
    try:
        assert sa.inspect(engine).get_table_names() == []  # nothing written
    finally:
        engine.dispose()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_sqlite_file_where_no_file_can_be_made_is_refused_before_the_data(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    no_data: None,
    hpo_main: Main,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/proc passes the permission bits for root, yet takes no new file: tried, not assumed."""
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    assert run(hpo_main, config, "sqlite:////proc/hpo.db") == 2
    line = one_line_error(capsys)
    assert "the folder /proc of the study database cannot be written" in line, line
    assert "creating a file there fails" in line and "name a file in another folder" in line


def test_the_sqlite_folder_check_leaves_nothing_in_a_writable_folder(tmp_path: Path) -> None:
    from hpo.storage.preflight import check_database
    from hpo.storage.url import StorageURL

    folder = tmp_path / "db"
    folder.mkdir()
    check_database(StorageURL(f"sqlite:///{folder / 'hpo.db'}", "--storage"))
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_device_or_a_pipe_as_the_sqlite_file_is_refused_and_nothing_is_left(
    tmp_path: Path, kind: str, hpo_main: Main, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path("/dev/null")
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    beside = [Path(f"{path}.hpo-lock"), Path(f"{path}-journal")]
    if any(p.exists() for p in beside):
        pytest.skip(f"left by an earlier run: {beside}")
    assert hpo_main(["run", "--study", "s", "--storage", f"sqlite:///{path}"]) == 2
    line = one_line_error(capsys)
    assert "which is not a regular file (a device, a pipe or a socket)" in line, line
    assert not any(p.exists() for p in beside)


# -- as a user runs it -------------------------------------------------------------------------


def test_a_store_without_credentials_stops_hpo_run_in_seconds(
    tmp_path: Path, easy_data: tuple[Path, Path], no_aws_credentials: None
) -> None:
    """The report's case: two trials took 272 s, each waiting out the store's patience."""
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    started = time.monotonic()
    result = run_hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        "sqlite:///s.db",
        "--artifact-store",
        "s3://hpo/studies",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Unable to locate credentials" in result.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "checkpoints").exists()


def test_a_missing_store_folder_is_created_when_the_run_starts(
    tmp_path: Path, easy_data: tuple[Path, Path], hpo_main: Main
) -> None:
    folder = tmp_path / "shared" / "hpo"
    folder.parent.mkdir()
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 1, "artifact_store": f"file://{folder}"},
        training={"epochs": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    assert run(hpo_main, config, f"sqlite:///{tmp_path / 's.db'}") == 0
    assert [p.name for p in folder.iterdir()] != []  # the best model went there
    assert not list(folder.glob(".hpo-probe-*"))
