"""The artifact store (storage.artifacts) and a trial's background uploads to it
(hpo.trial.uploads): URLs, manifests, verified fetches, cut uploads, removal, supersede and
backoff. Fast: a folder as the store, and an S3 API served by moto on 127.0.0.1."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import optuna
import pytest
from optuna.trial import TrialState

from hpo.storage.artifacts import (
    ArtifactStore,
    ArtifactStoreError,
    ArtifactTarget,
    FileBackend,
    UntrustedArtifact,
    resolve_artifact_url,
    validated_artifact_url,
)
from hpo.trial.folders import study_folder_name
from hpo.trial.uploads import BackgroundUploader, Backoff
from tests.conftest import (
    hold_env,
    holding_metrics,
    run_hpo,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
)

STUDY, FOLDER = "s-0123456789ab", "trial-0"


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("s3://AKIAKEY:wJalrSECRET@bucket/x", "never put keys in the URL"),
        ("gs://bucket/x", "gs:// is not supported yet"),
        ("http://example.com/x", "use file:///mnt/shared/hpo or s3://bucket/prefix"),
        ("file://relative/path", "absolute path"),
        ("file:///no/such/folder", "is not a folder"),
        ("s3://Bad_Bucket/x", "no valid bucket"),
        ("s3://bucket/../x", "prefix hpo will not use"),
        ("s3://bucket/x?endpoint=http://evil", "$AWS_ENDPOINT_URL"),
        ("s3://bucket/x?X-Amz-Signature=wJalrSECRET", "a query or fragment ('s3://bucket/x?***')"),
        ("s3://bucket/x#wJalrSECRET", "a query or fragment"),
        (" s3://bucket/x", "spaces or control characters"),
    ],
)
def test_a_bad_store_url_is_one_line_that_says_why_and_never_shows_a_secret(
    url: str, said: str
) -> None:
    with pytest.raises(ArtifactStoreError) as caught:
        validated_artifact_url(url, "--artifact-store")
    message = str(caught.value)
    assert said in message and "\n" not in message
    assert "wJalr" not in message and message.startswith("artifact store URL from --artifact")


def test_store_urls_are_normalised_and_taken_by_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert validated_artifact_url("s3://my.bucket/a/b/") == "s3://my.bucket/a/b"
    assert validated_artifact_url(f"file://{tmp_path}/") == f"file://{tmp_path.resolve()}"
    monkeypatch.delenv("HPO_ARTIFACT_STORE", raising=False)
    assert resolve_artifact_url(None, None) is None
    assert resolve_artifact_url(None, "s3://cfg", "s3://recorded").origin == "config"  # type: ignore[union-attr]
    monkeypatch.setenv("HPO_ARTIFACT_STORE", "s3://env")
    assert resolve_artifact_url(None, "s3://cfg").url == "s3://env"  # type: ignore[union-attr]
    assert resolve_artifact_url("s3://cli", "s3://cfg").url == "s3://cli"  # type: ignore[union-attr]


def _model_folder(path: Path, weights: bytes = b"weights" * 1000) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "bert"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_published_folder_comes_back_whole_with_its_manifest(tmp_path: Path) -> None:
    store = ArtifactStore(f"file://{tmp_path / 'store'}", FileBackend(tmp_path / "store"))
    model = _model_folder(tmp_path / "model")
    manifest = store.publish(STUDY, FOLDER, "best-model", model)
    assert sorted(f.path for f in manifest.files) == ["config.json", "model.safetensors"]
    raw = json.loads((tmp_path / "store" / STUDY / FOLDER / "best-model.manifest.json").read_text())
    assert raw["size"] == 7000 + 22 and len(raw["files"][1]["sha256"]) == 64 and raw["written_at"]

    fetched = store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    assert fetched is not None and fetched.version == manifest.version
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"weights" * 1000
    assert store.fetch(STUDY, "trial-9", "best-model", tmp_path / "none") is None
    assert not (tmp_path / "none").exists()


def test_a_changed_file_in_the_store_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    store = ArtifactStore("file://store", FileBackend(tmp_path / "store"))
    manifest = store.publish(STUDY, FOLDER, "best-model", _model_folder(tmp_path / "model"))
    weights = next(f for f in manifest.files if f.path == "model.safetensors")
    (tmp_path / "store" / weights.key).write_bytes(b"weightz" * 1000)  # same size, other bytes
    with pytest.raises(UntrustedArtifact, match="does not match its manifest"):
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_manifest_naming_keys_outside_its_version_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore("file://store", FileBackend(tmp_path / "store"))
    store.publish(STUDY, FOLDER, "best-model", _model_folder(tmp_path / "model"))
    path = tmp_path / "store" / STUDY / FOLDER / "best-model.manifest.json"
    raw = json.loads(path.read_text())
    raw["files"][0]["path"] = raw["files"][0]["key"] = "../../../etc/passwd"
    path.write_text(json.dumps(raw))
    with pytest.raises(UntrustedArtifact, match="outside its version"):
        store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out")


class CutAfter:
    """A backend whose uploads fail after `puts` of them: the connection cut mid-upload."""

    def __init__(self, inner: FileBackend, puts: int) -> None:
        self.inner, self.puts, self.deletes_fail = inner, puts, False

    def put(self, key: str, source: BinaryIO) -> None:
        if self.puts <= 0:
            source.read(10)  # some bytes went before the cut
            raise ArtifactStoreError("cannot upload: connection reset")
        self.puts -= 1
        self.inner.put(key, source)

    def __getattr__(self, name: str) -> object:
        if name == "delete" and self.deletes_fail:
            raise ArtifactStoreError("store gone")
        return getattr(self.inner, name)


@pytest.mark.parametrize("store_gone_after_cut", [False, True])
def test_an_upload_cut_midway_leaves_the_previous_version_for_every_reader(
    tmp_path: Path, store_gone_after_cut: bool
) -> None:
    files = FileBackend(tmp_path / "store")
    ArtifactStore("file://s", files).publish(
        STUDY, FOLDER, "best-model", _model_folder(tmp_path / "v1", b"one" * 100)
    )
    cut = CutAfter(files, puts=1)
    cut.deletes_fail = store_gone_after_cut
    writer = ArtifactStore("file://s", cut)  # type: ignore[arg-type]
    with pytest.raises(ArtifactStoreError, match="connection reset"):
        writer.publish(STUDY, FOLDER, "best-model", _model_folder(tmp_path / "v2", b"two" * 100))

    reader = ArtifactStore("file://s", files)
    assert reader.fetch(STUDY, FOLDER, "best-model", tmp_path / "out") is not None
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"one" * 100
    listed = {f.key for f in reader.manifest(STUDY, FOLDER, "best-model").files}  # type: ignore[union-attr]
    stored = {key for key, _ in files.list(STUDY) if not key.endswith(".manifest.json")}
    leftover = stored - listed  # the cut version's first object, when the store cannot delete it
    assert len(leftover) == (1 if store_gone_after_cut else 0)
    assert not list((tmp_path / "store").rglob("*.part"))  # nothing half-written


def test_removal_deletes_what_the_manifests_list_and_nothing_else(tmp_path: Path) -> None:
    files = FileBackend(tmp_path / "store")
    store = ArtifactStore("file://s", files)
    store.publish(STUDY, FOLDER, "best-model", _model_folder(tmp_path / "m"))
    (tmp_path / "state.pt").write_bytes(b"state")
    store.publish(STUDY, FOLDER, "state", tmp_path / "state.pt")
    mine = tmp_path / "store" / STUDY / FOLDER / "notes.txt"
    mine.write_text("a user's file under hpo's prefix")
    assert store.folders(STUDY) == {FOLDER: ["state", "best-model"]}
    assert store.size(STUDY) > 7000

    store.remove(STUDY, FOLDER, ("state",))
    assert store.folders(STUDY) == {FOLDER: ["best-model"]}
    store.remove(STUDY, FOLDER)
    assert store.folders(STUDY) == {}
    assert mine.read_text() == "a user's file under hpo's prefix"
    assert sorted(p.name for p in (tmp_path / "store" / STUDY / FOLDER).iterdir()) == ["notes.txt"]


class Gate:
    """A backend whose first upload waits for the test, counting what was published."""

    def __init__(self, inner: FileBackend, failures: int = 0) -> None:
        self.inner, self.failures = inner, failures
        self.started, self.release = threading.Event(), threading.Event()
        self.published: list[bytes] = []

    def put(self, key: str, source: BinaryIO) -> None:
        self.started.set()
        self.release.wait(10)
        if self.failures:
            self.failures -= 1
            raise ArtifactStoreError("cannot upload: Could not connect to the endpoint URL")
        data = source.read()
        self.published.append(data)
        self.inner.put(key, io.BytesIO(data))

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture
def target(tmp_path: Path) -> ArtifactTarget:
    return ArtifactTarget(f"file://{tmp_path / 'store'}", STUDY, FOLDER)


def test_the_newest_state_supersedes_one_still_queued(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    gate = Gate(FileBackend(tmp_path / "store"))
    uploader = BackgroundUploader(ArtifactStore(target.url, gate), target)  # type: ignore[arg-type]
    states = [tmp_path / f"state-{n}.pt" for n in range(4)]
    for n, path in enumerate(states):
        path.write_bytes(f"state {n}".encode())
    uploader.submit("state", states[0])
    assert gate.started.wait(5)  # state 0 is uploading; 1, 2, 3 come meanwhile
    for path in states[1:]:
        uploader.submit("state", path)
    gate.release.set()
    assert uploader.close(timeout_s=10)
    assert gate.published == [b"state 0", b"state 3"]
    assert uploader.stats.uploads == 2 and not uploader.stats.errors


def test_a_failed_upload_is_retried_with_backoff_and_recorded(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    assert [Backoff(1.0, 30.0).delay(n) for n in (1, 2, 3, 6, 9)] == [1, 2, 4, 30, 30]
    gate = Gate(FileBackend(tmp_path / "store"), failures=2)
    gate.release.set()
    store = ArtifactStore(target.url, gate)  # type: ignore[arg-type]
    uploader = BackgroundUploader(store, target, Backoff(0.05, 0.2))
    (tmp_path / "checkpoint.pt").write_bytes(b"state")
    uploader.submit("state", tmp_path / "checkpoint.pt")
    assert uploader.close(timeout_s=10)
    assert len(uploader.stats.errors) == 2 and uploader.stats.uploads == 1
    assert "Could not connect" in uploader.stats.errors[0]
    assert store.manifest(STUDY, FOLDER, "state") is not None


def test_uploads_still_failing_at_close_are_given_up_with_the_reason(
    tmp_path: Path, target: ArtifactTarget, caplog: pytest.LogCaptureFixture
) -> None:
    gate = Gate(FileBackend(tmp_path / "store"), failures=1000)
    gate.release.set()
    uploader = BackgroundUploader(
        ArtifactStore(target.url, gate),
        target,
        Backoff(0.05, 0.1),  # type: ignore[arg-type]
    )
    (tmp_path / "checkpoint.pt").write_bytes(b"state")
    uploader.submit("state", tmp_path / "checkpoint.pt")
    assert not uploader.close(timeout_s=0.5)
    assert uploader.stats.errors[-1].startswith("state not uploaded after 0.5 s: state not")
    assert "Could not connect" in uploader.stats.errors[-1]
    last = [r.getMessage() for r in caplog.records if r.name == "hpo.trial.uploads"][-1]
    assert last.endswith("; the trial ends without it")  # not "training goes on": it has ended


# -- S3, served by moto on 127.0.0.1 -----------------------------------------------------------


class CuttableLink:
    """A TCP relay to the S3 server that drops every connection for good, and refuses new
    ones, once `cut_after_bytes` have gone upstream: the store lost in the middle of an upload."""

    def __init__(self, target: tuple[str, int], cut_after_bytes: int) -> None:
        self.target, self.left = target, cut_after_bytes
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.lock = threading.Lock()
        self.cut_done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            self.cut_done.set()
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self) -> None:
        while not self.cut_done.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if counted:
                    with self.lock:
                        self.left -= len(data)
                    if self.left <= 0:
                        self.cut()
                        return
                sink.sendall(data)


def test_s3_publish_fetch_size_and_remove(tmp_path: Path, s3: dict[str, str]) -> None:
    store = ArtifactStore("s3://hpo/studies")
    store.publish(STUDY, FOLDER, "best-model", _model_folder(tmp_path / "model"))
    assert store.uri(STUDY, FOLDER, "best-model") == f"s3://hpo/studies/{STUDY}/{FOLDER}/best-model"
    assert store.folders(STUDY) == {FOLDER: ["best-model"]}
    assert store.fetch(STUDY, FOLDER, "best-model", tmp_path / "out") is not None
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"weights" * 1000
    assert store.size(STUDY) > 7000
    store.remove(STUDY, FOLDER)
    assert store.size(STUDY) == 0


def test_s3_errors_name_the_problem_without_the_secret(tmp_path: Path, s3: dict[str, str]) -> None:
    state = tmp_path / "checkpoint.pt"
    state.write_bytes(b"state")
    with pytest.raises(ArtifactStoreError) as caught:
        ArtifactStore("s3://no-such-bucket").publish(STUDY, FOLDER, "state", state)
    assert "NoSuchBucket" in str(caught.value) or "does not exist" in str(caught.value)
    assert "testing-secret" not in str(caught.value)


# -- end to end: workers on two "hosts" (two working directories) sharing one store ------------


def _store_url(kind: str, tmp_path: Path) -> str:
    if kind == "s3":
        return "s3://hpo/studies"
    (tmp_path / "shared").mkdir()
    return f"file://{tmp_path / 'shared'}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_trial_stopped_on_one_host_resumes_on_another_from_the_store(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    kind: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    if kind == "s3":
        request.getfixturevalue("s3")
    store_url = _store_url(kind, tmp_path)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 1, "pruner": {"type": "none"}, "artifact_store": store_url},
        # 384 steps, an evaluation every 32: the first holds until the SIGTERM arrives (a tiny
        # trial may otherwise finish training before it)
        training={"epochs": 12, "evals_per_epoch": 1},
    )
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    host_a.mkdir(), host_b.mkdir()
    raw["metrics"] = holding_metrics(tmp_path)  # held on host A only: no HPO_TEST_HELD here
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "nli/1", "--config", str(config), "--storage", url)
    held = tmp_path / "held"
    worker = start_hpo(*args, cwd=host_a, env=hold_env(held), own_group=True)
    study = wait_until_training(url, "nli/1", [worker])
    wait_until_held(held, [worker])
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr[-3000:]

    # Another host, its local folder empty: hpo's main in this process, the trial in itself
    # (the resume from the store is the subject here, not the trial process).
    raw["study"]["trial_isolation"] = "none"
    other = write_config(tmp_path / "host-b.yaml", raw)
    monkeypatch.chdir(host_b)
    assert hpo_main(["run", "--study", "nli/1", "--config", str(other), "--storage", url]) == 0
    finished = capsys.readouterr().err
    assert "Traceback" not in finished, finished[-3000:]
    interrupted, retry = study.get_trials()
    assert interrupted.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    uri = f"{store_url}/{study_folder_name('nli/1')}/trial-0"
    assert retry.user_attrs["resumed_from"] == f"{uri}/state"
    assert retry.user_attrs["resumed_at_step"] > 32  # SIGTERM checkpointed after evaluation 1
    assert sorted(retry.intermediate_values) == list(range(1, 13))  # the curve continues
    assert "checkpoint_error" not in retry.user_attrs, retry.user_attrs["checkpoint_error"]
    assert retry.user_attrs["best_model_uri"] == f"{uri}/best-model"
    store = ArtifactStore(store_url)
    assert store.folders(study_folder_name("nli/1")) == {"trial-0": ["best-model"]}  # state gone
    if kind == "file":
        return  # what follows reads the store the same way whatever it is

    # Anywhere else: `hpo best` names the model in the store and fetches it, checked.
    elsewhere = tmp_path / "laptop"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # hpo's main in this process, as the CLI calls it
    best = ["best", "--study", "nli/1", "--storage", url]
    assert hpo_main(best) == 0
    said = capsys.readouterr()
    assert f"model: {uri}/best-model" in said.out, said.err[-2000:]
    code = hpo_main([*best, "--download", "model"])
    said = capsys.readouterr()
    assert code == 0 and "sha256 checked" in said.out, said.err[-2000:]
    monkeypatch.chdir(elsewhere / "model")
    assert hpo_main([*best, "--download", ""]) == 2
    empty = capsys.readouterr().err
    assert "name a new (or empty) folder" in empty, empty
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(elsewhere / "model")
    assert model.config.num_labels == 2
    AutoTokenizer.from_pretrained(elsewhere / "model")
    monkeypatch.chdir(elsewhere)
    assert hpo_main(["status", "--study", "nli/1", "--storage", url]) == 0
    status = capsys.readouterr()
    assert f"artifact store {store_url}: " in status.out, status.err[-2000:]
    assert "MB in 1 trial folders" in status.out


@pytest.mark.slow
def test_a_store_lost_mid_upload_never_stops_the_trial_and_leaves_nothing_half_written(
    tmp_path: Path, easy_data: tuple[Path, Path], s3: dict[str, str]
) -> None:
    endpoint = s3["AWS_ENDPOINT_URL"].rpartition(":")
    # The tiny model is 8 MB, its state (with AdamW's moments) 24 MB: cut in the first state.
    link = CuttableLink(("127.0.0.1", int(endpoint[2])), cut_after_bytes=14_000_000)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study_settings = {
        "n_trials": 1,
        "pruner": {"type": "none"},
        "checkpoint_interval": 0,
        "artifact_store": "s3://hpo/studies",
        "artifact_patience": 3,
    }
    raw = tiny_config(*easy_data, study=study_settings, training={"epochs": 2})
    config = write_config(tmp_path / "c.yaml", raw)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{link.port}"}
    done = run_hpo(
        "run", "--study", "cut", "--config", str(config), "--storage", url, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert link.cut_done.is_set()
    trial = optuna.load_study(study_name="cut", storage=url).get_trials()[0]
    assert trial.state == TrialState.COMPLETE and len(trial.intermediate_values) == 4
    error = trial.user_attrs["checkpoint_error"]
    assert "not uploaded" in error and "s3://hpo" in error, error
    assert "Could not connect" in error or "Connection was closed" in error, error
    assert s3["AWS_SECRET_ACCESS_KEY"] not in error and "testing-secret" not in done.stderr
    assert "best_model_uri" not in trial.user_attrs  # never claimed while it is not there
    # What is in the store (read past the cut link): every object a manifest lists, verified.
    store = ArtifactStore("s3://hpo/studies")
    study = study_folder_name("cut")
    listed = set()
    for folder, kinds in store.folders(study).items():
        for kind in kinds:
            manifest = store.fetch(study, folder, kind, tmp_path / "check" / folder / kind)
            listed |= {f.key for f in manifest.files} if manifest else set()
    objects = {key for key, _ in store.backend.list(study) if not key.endswith(".manifest.json")}
    assert objects == listed


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("--artifact-store", "artifact store URL from --artifact-store has 'gs'"),
        ("config", "study.artifact_store: got 's3://AKIA:***@bucket/x'"),
        ("$AWS_PROFILE", "cannot set up S3: The config profile (no-such-profile) could not be"),
    ],
)
def test_a_bad_store_url_at_start_is_one_line_and_exit_2(
    tmp_path: Path, easy_data: tuple[Path, Path], where: str, said: str
) -> None:
    study = {"artifact_store": "s3://AKIA:wJalrXUtn@bucket/x"} if where == "config" else {}
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data, study=study))
    args = ["run", "--study", "s", "--config", str(config), "--storage", "sqlite:///s.db"]
    if where == "--artifact-store":
        args += ["--artifact-store", "gs://bucket/x"]
    env = {}
    if where == "$AWS_PROFILE":
        env = {"HPO_ARTIFACT_STORE": "s3://bucket/x", "AWS_PROFILE": "no-such-profile"}
    result = run_hpo(*args, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert said in result.stderr and "wJalr" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(
    ("local", "fetched"),
    [
        ("none", True),  # another host's trial
        ("older, of another host's attempt", True),  # this host ran an earlier attempt
        ("the stored one", False),  # this host uploaded it: no download
        ("newer than the stored one", False),  # its upload never finished: the local one wins
    ],
)
def test_a_retry_takes_the_newest_state_local_or_stored(
    tmp_path: Path, local: str, fetched: bool
) -> None:
    import os

    from hpo.trainer.checkpoint import CheckpointStore
    from hpo.trial.uploads import fetch_resume_state

    files = FileBackend(tmp_path / "store")
    store = ArtifactStore("file://s", files)
    host_a = tmp_path / "a" / FOLDER
    host_a.mkdir(parents=True)
    target = ArtifactTarget("file://s", STUDY, FOLDER)
    uploader = BackgroundUploader(store, target)
    (host_a / "checkpoint.pt").write_bytes(b"stored state")
    uploader.submit("state", host_a / "checkpoint.pt")
    assert uploader.close(timeout_s=10)

    retry = CheckpointStore(tmp_path / "b" / FOLDER if local == "none" else host_a, resume=True)
    retry.directory.mkdir(parents=True, exist_ok=True)
    if local == "older, of another host's attempt":
        (host_a / ".hpo-stored-state").unlink()
        (host_a / "checkpoint.pt").write_bytes(b"older state")
        os.utime(host_a / "checkpoint.pt", (1e9, 1e9))
    if local == "newer than the stored one":
        (host_a / "checkpoint.pt").write_bytes(b"newer state")
        (host_a / ".hpo-stored-state").write_text("an older version")
    before = retry.state_path.read_bytes() if retry.state_path.is_file() else None
    assert fetch_resume_state(store, target, retry) is fetched
    assert retry.state_path.read_bytes() == (b"stored state" if fetched else before)
    assert not retry.errors


def test_abandoned_uploads_are_dropped_without_an_error(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    gate = Gate(FileBackend(tmp_path / "store"))
    uploader = BackgroundUploader(ArtifactStore(target.url, gate), target)  # type: ignore[arg-type]
    (tmp_path / "a.pt").write_bytes(b"a")
    (tmp_path / "b.pt").write_bytes(b"b")
    uploader.submit("state", tmp_path / "a.pt")
    assert gate.started.wait(5)
    uploader.submit("state", tmp_path / "b.pt")
    assert not uploader.abandon(wait_s=0.2)  # "a" is in flight: waited for, in vain
    threading.Timer(0.3, gate.release.set).start()
    assert uploader.abandon(wait_s=10)  # a trial process that lives on: "a" is finished, not cut
    assert gate.published == [b"a"] and not uploader.stats.errors
    assert not list((tmp_path / "store").rglob("*.part"))


def test_the_workers_remove_old_artifacts_under_the_rules_of_local_folders(tmp_path: Path) -> None:
    from optuna.distributions import FloatDistribution
    from optuna.study import StudyDirection
    from optuna.trial import create_trial

    from hpo.study.kept_models import remove_unneeded_artifacts

    def trial(number: int, state: TrialState, value: float | None = None, **attrs: int) -> object:
        made = create_trial(
            state=state,
            value=value,
            params={"x": 0.5},
            user_attrs=attrs,
            distributions={"x": FloatDistribution(0, 1)},
        )
        made.number = number
        return made

    trials = [
        trial(0, TrialState.COMPLETE, 0.9),  # the best: its model stays, its state goes
        trial(1, TrialState.COMPLETE, 0.5),
        trial(2, TrialState.RUNNING),
        trial(3, TrialState.FAIL),  # handed back: its retry (4) resumes from trial-3
        trial(4, TrialState.WAITING, first_attempt=3),
    ]
    files = FileBackend(tmp_path / "store")
    store = ArtifactStore("file://s", files)
    study = study_folder_name("s")
    (tmp_path / "state.pt").write_bytes(b"state")
    for number in range(4):
        store.publish(study, f"trial-{number}", "state", tmp_path / "state.pt")
        model = _model_folder(tmp_path / f"m{number}")
        store.publish(study, f"trial-{number}", "best-model", model)
    foreign = tmp_path / "store" / study / "trial-7" / "state.manifest.json.bak"
    foreign.parent.mkdir()
    foreign.write_text("not hpo's")
    # A trial started after the cleanup read the trials: its first upload landed meanwhile.
    store.publish(study, "trial-4", "state", tmp_path / "state.pt")

    removed = remove_unneeded_artifacts(store, "s", trials, [StudyDirection.MAXIMIZE])  # type: ignore[arg-type]
    assert removed == ["trial-0/state", "trial-1/state", "trial-1/best-model"]
    assert store.folders(study) == {
        "trial-0": ["best-model"],
        "trial-2": ["state", "best-model"],
        "trial-3": ["state", "best-model"],
        "trial-4": ["state"],  # not in the trials read: left alone
    }
    assert foreign.read_text() == "not hpo's"


def test_retrain_takes_a_winner_trained_on_another_host_from_the_store(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    from hpo.commands.retrain import winner_model
    from hpo.config.loader import load_config

    (tmp_path / "shared").mkdir()
    store_url = f"file://{tmp_path / 'shared'}"
    raw = tiny_config(*easy_data, study={"artifact_store": store_url})
    config = load_config(write_config(tmp_path / "c.yaml", raw))
    study = optuna.create_study(study_name="s.retrain", direction="maximize")
    elsewhere = {"best_model": "/elsewhere/trial-0/best-model"}  # another host's disk
    study.add_trial(
        create_trial(
            value=0.9,
            params={"x": 0.5},
            user_attrs=elsewhere,
            distributions={"x": FloatDistribution(0, 1)},
        )
    )
    store = ArtifactStore(store_url)
    model = _model_folder(tmp_path / "model")
    store.publish(study_folder_name("s.retrain"), "trial-0", "best-model", model)

    with winner_model(study, 0, config, tmp_path / "final") as folder:
        assert (folder / "model.safetensors").read_bytes() == b"weights" * 1000
    assert not folder.exists()  # the fetched copy goes once the final model is saved


def test_a_state_dropped_at_the_end_of_a_trial_is_not_waited_for(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    gate = Gate(FileBackend(tmp_path / "store"), failures=1)  # the upload in flight fails
    store = ArtifactStore(target.url, gate)  # type: ignore[arg-type]
    uploader = BackgroundUploader(store, target, Backoff(0.05, 0.1))
    (tmp_path / "old.pt").write_bytes(b"old")
    (tmp_path / "new.pt").write_bytes(b"new")
    uploader.submit("state", tmp_path / "old.pt")
    assert gate.started.wait(5)
    uploader.submit("state", tmp_path / "new.pt")
    uploader.discard("state")  # the trial completed: its state files go
    (tmp_path / "old.pt").unlink()
    (tmp_path / "new.pt").unlink()
    gate.release.set()
    assert uploader.close(timeout_s=5)
    assert gate.published == [] and store.manifest(STUDY, FOLDER, "state") is None


def test_status_says_when_the_store_is_not_reachable_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from hpo.reports.text import artifact_line
    from hpo.services import artifact_summary

    monkeypatch.delenv("HPO_ARTIFACT_STORE", raising=False)
    study = optuna.create_study(study_name="s")
    study.set_user_attr("artifact_store", "file:///mnt/not-mounted-here")
    summary = artifact_summary(study, None)
    assert summary is not None
    assert artifact_line(summary).startswith(
        "artifact store file:///mnt/not-mounted-here: unreachable ("
    )
    with pytest.raises(ArtifactStoreError, match="not a folder"):  # asked for: an error
        artifact_summary(study, "file:///mnt/not-mounted")


def test_a_disk_full_mid_copy_leaves_no_file_on_the_shared_mount(tmp_path: Path) -> None:
    import errno

    class FillsTheDisk(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            if self.tell() > 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().read(4)

    files = FileBackend(tmp_path / "store")
    with pytest.raises(ArtifactStoreError, match="No space left on device"):
        files.put(f"{STUDY}/{FOLDER}/state/v1/checkpoint.pt", FillsTheDisk(b"0123456789"))
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []


def test_best_download_into_a_link_or_out_of_reach_leaves_nothing_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    main = hpo_main
    (tmp_path / "store").mkdir()
    store_url = f"file://{tmp_path / 'store'}"
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    study.set_user_attr("artifact_store", store_url)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ArtifactStore(store_url).publish(study_folder_name("s"), "trial-0", "best-model", model)

    def download(to: Path) -> int:
        return main(["best", "--study", "s", "--storage", url, "--download", str(to)])

    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    assert download(tmp_path / "to-empty") == 0  # the empty folder behind the link gets it
    assert (tmp_path / "empty" / "config.json").is_file()
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    assert download(tmp_path / "dangling") == 2
    assert download(Path("/proc/hpo-model")) == 2
    err = capsys.readouterr().err
    assert "a link to nothing" in err and "--download /proc/hpo-model: cannot write" in err
    assert not list(tmp_path.glob(".*download")) and "Traceback" not in err


def test_a_discarded_upload_that_fails_in_flight_is_not_tried_again(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    """The trial ended while its state was uploading: the state file stays until the worker
    records the end, but nobody needs it; the best model's upload is not held up by it."""
    gate = Gate(FileBackend(tmp_path / "store"), failures=1)
    uploader = BackgroundUploader(ArtifactStore(target.url, gate), target, Backoff(0.05, 0.1))  # type: ignore[arg-type]
    (tmp_path / "checkpoint.pt").write_bytes(b"state")
    uploader.submit("state", tmp_path / "checkpoint.pt")
    assert gate.started.wait(5)
    uploader.discard("state")
    gate.release.set()
    assert uploader.close(timeout_s=5)  # nothing left to do: the failed state is not retried
    assert gate.published == [] and len(uploader.stats.errors) == 1


def _sharded_run_folder(folder: Path, step: int) -> Path:
    """A sharded run's checkpoint folder as DCP and rank 0 leave it: its state file names
    `sharded-state.<step>`, which holds the ranks' shares and DCP's metadata."""
    import torch

    shares = folder / f"sharded-state.{step}"
    shares.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (shares / name).write_bytes(f"{name} of step {step}".encode())
    torch.save({"sharded": shares.name, "run": {"step": step}}, folder / "checkpoint.pt")
    return folder / "checkpoint.pt"


def test_a_sharded_state_travels_with_every_share_under_its_own_names(
    tmp_path: Path, target: ArtifactTarget
) -> None:
    """DCP's names (`__0_0.distcp`, `.metadata`) are no names the store takes: stored under
    others, they come back as they were, in a fresh folder on another host."""
    from hpo.trainer.checkpoint import CheckpointStore
    from hpo.trial.uploads import fetch_resume_state

    host_a = tmp_path / "a" / FOLDER
    state = _sharded_run_folder(host_a, 5)
    uploader = BackgroundUploader(ArtifactStore(target.url), target)
    uploader.submit("state", state)
    assert uploader.close(timeout_s=10), uploader.stats.errors
    assert not list(host_a.glob(".upload-stage-*"))  # the links are gone with the upload
    manifest = ArtifactStore(target.url).manifest(STUDY, FOLDER, "state")
    assert manifest is not None
    assert sorted(f.path for f in manifest.files) == [
        "checkpoint.pt",
        "sharded-state.5/dcp.metadata",
        "sharded-state.5/dcp__0_0.distcp",
        "sharded-state.5/dcp__1_0.distcp",
    ]
    host_b = CheckpointStore(tmp_path / "b" / FOLDER, resume=True)
    host_b.directory.mkdir(parents=True)
    (host_b.directory / "sharded-state.2").mkdir()  # an older attempt's, on this host
    assert fetch_resume_state(ArtifactStore(target.url), target, host_b), host_b.errors
    fetched = host_b.directory / "sharded-state.5"
    assert sorted(p.name for p in host_b.directory.glob("sharded-state.*")) == [fetched.name]
    assert (fetched / ".metadata").read_bytes() == b".metadata of step 5"
    assert (fetched / "__1_0.distcp").read_bytes() == b"__1_0.distcp of step 5"
    assert host_b.state_path.read_bytes() == state.read_bytes()


def test_a_sharded_state_superseded_before_its_upload_is_not_stored_half(
    tmp_path: Path,
) -> None:
    """The run wrote its next checkpoint and removed the folder the queued state named: the
    upload fails (and is tried again with the newest state), leaving no folder of links."""
    import shutil

    from hpo.trial.sharded_upload import staged_state

    folder = tmp_path / FOLDER
    state = _sharded_run_folder(folder, 5)
    stage = staged_state(state)
    assert os.path.samefile(
        stage / "sharded-state.5" / "dcp__0_0.distcp", folder / "sharded-state.5" / "__0_0.distcp"
    )
    stage_files = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    assert stage_files[0] == "checkpoint.pt" and len(stage_files) == 4
    shutil.rmtree(folder / "sharded-state.5")
    (folder / "sharded-state.6").mkdir()  # the next one, still being written
    with pytest.raises(OSError):
        staged_state(state)
    assert not list(folder.glob(".upload-stage-*"))  # the earlier stage too: nothing uploads it
