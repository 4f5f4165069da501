"""Checkpoints: a run stopped mid-way and resumed ends with exactly the weights of an
uninterrupted run (CPU, dropout on); a failed write never stops training."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpo.trainer import checkpoint as ckpt
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.loop import Evaluation, Trainer, TrainResult
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.tasks import prepare_data
from tests.test_trainer import tiny_job


@pytest.fixture
def prepared(easy_data: tuple[Path, Path]) -> tuple[TrainJob, PreparedData]:
    # 256 examples / 8 = 32 steps an epoch, evaluations at steps 16, 32, 48, 64.
    job = tiny_job(*easy_data)
    return job, prepare_data(job.data, load_tokenizer(job.model))


def _fit(
    prepared: tuple[TrainJob, PreparedData], store: CheckpointStore | None = None, **kw: Any
) -> tuple[Trainer, TrainResult]:
    trainer = Trainer(*prepared)
    return trainer, trainer.fit(checkpoints=store, **kw)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    reference, expected = _fit(prepared)
    steps: list[int] = []
    stopper, stopped = _fit(
        prepared,
        CheckpointStore(tmp_path / "t"),
        should_stop=lambda: len(steps) >= 1,
        on_evaluation=lambda e: steps.append(e.optimizer_step) or None,
    )
    assert stopped.status == "interrupted" and stopped.optimizer_steps == 17  # after eval 1
    assert (tmp_path / "t" / "checkpoint.pt").is_file()
    reported: list[Evaluation] = []
    resumed, result = _fit(
        prepared,
        CheckpointStore(tmp_path / "t", resume=True),
        on_evaluation=lambda e: reported.append(e) or None,
    )
    assert result.resumed_at_step == 17 and result.status == "completed"
    _assert_same_weights(_weights(reference), _weights(resumed))
    assert result.curve == expected.curve
    # The curve of the new attempt continues: evaluation 1 is reported again, then 2..4.
    assert [e.index for e in reported] == [1, 2, 3, 4]


def test_a_run_that_crashed_resumes_from_its_last_evaluation(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    reference, expected = _fit(prepared)

    def crash_at_third(evaluation: Evaluation) -> None:
        if evaluation.index == 3:
            raise RuntimeError("the worker died")

    with pytest.raises(RuntimeError):
        _fit(prepared, CheckpointStore(tmp_path / "t"), on_evaluation=crash_at_third)
    resumed, result = _fit(prepared, CheckpointStore(tmp_path / "t", resume=True))
    assert result.resumed_at_step == 32  # evaluation 2, the last checkpoint before the crash
    _assert_same_weights(_weights(reference), _weights(resumed))
    assert result.curve == expected.curve


def test_the_best_evaluation_is_kept_as_a_loadable_model(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "t")
    _, result = _fit(prepared, store)
    assert result.best is not None
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(store.best_model_path)
    assert model.config.id2label == {0: "neg", 1: "pos"}
    names = sorted(p.name for p in store.directory.iterdir())
    assert not [n for n in names if n.endswith((".tmp", ".link"))]  # no temporary files left
    # best-model points at the newest version; only the version before it is kept besides.
    versions = [n for n in names if n.startswith(".best-model.v")]
    assert 1 <= len(versions) <= 2
    assert store.best_model_path.is_symlink()
    assert store.best_model_path.resolve().name == max(versions, key=lambda n: int(n[13:]))


def test_a_full_disk_loses_the_checkpoint_not_the_run(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    _, result = _fit(prepared, CheckpointStore(tmp_path / "t"))
    assert result.status == "completed" and len(result.evaluations) == 4
    assert any("No space left on device" in e for e in result.checkpoint_errors)
    assert not (tmp_path / "t" / "checkpoint.pt").exists()


def test_an_unusable_checkpoint_folder_loses_the_checkpoint_not_the_run(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    _, result = _fit(prepared, CheckpointStore(blocker / "t"))
    assert result.status == "completed"
    assert result.checkpoint_errors and "not written to" in result.checkpoint_errors[0]


def test_a_checkpoint_of_another_job_is_not_resumed(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    asked = itertools.count()
    _fit(prepared, CheckpointStore(tmp_path / "t"), should_stop=lambda: next(asked) >= 3)
    assert (tmp_path / "t" / "checkpoint.pt").is_file()  # after step 2
    job, data = prepared
    job.training.learning_rate = 1e-4
    _, result = _fit((job, data), CheckpointStore(tmp_path / "t", resume=True))
    assert result.resumed_at_step is None and result.optimizer_steps == 64


def test_with_an_interval_evaluations_write_nothing_and_the_best_model_comes_at_the_end(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "t", interval_s=3600)
    trainer = Trainer(*prepared)
    at_evaluation: dict[int, dict[str, torch.Tensor]] = {}
    written: list[bool] = []

    def look(evaluation: Evaluation) -> None:
        at_evaluation[evaluation.index] = _weights(trainer)
        written.append(store.state_path.exists() or store.best_model_path.exists())

    result = trainer.fit(checkpoints=store, on_evaluation=look)
    assert written == [False] * 4 and not store.state_path.exists()
    assert result.best is not None
    assert result.best.index < 4  # so the final weights would not pass for the best ones
    from transformers import AutoModelForSequenceClassification

    best = AutoModelForSequenceClassification.from_pretrained(store.best_model_path)
    _assert_same_weights(at_evaluation[result.best.index], best.state_dict())
    assert store.seconds > 0


def test_a_stop_before_the_first_step_trains_and_writes_nothing(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    trainer, result = _fit(prepared, CheckpointStore(tmp_path / "t"), should_stop=lambda: True)
    assert result.status == "interrupted" and result.optimizer_steps == 0
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").iterdir())


class _RunsCode:
    """Unpickling this runs code: what a hostile checkpoint in a shared folder would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_checkpoint_that_would_run_code_is_refused_and_the_run_starts_over(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job, data = prepared
    job.training.max_steps = 2
    trainer = Trainer(job, data)
    folder, marker = tmp_path / "t", tmp_path / "code-ran"
    folder.mkdir()
    state = {"fingerprint": trainer.fingerprint(), "run": _RunsCode(marker)}
    torch.save(state, folder / ckpt.STATE_FILE)
    with caplog.at_level(logging.WARNING, logger="hpo.trainer.checkpoint"):
        result = trainer.fit(checkpoints=CheckpointStore(folder, resume=True))
    assert not marker.exists()
    assert "refused" in caplog.text and "starting over" in caplog.text
    assert result.resumed_at_step is None
    assert result.status == "completed" and result.optimizer_steps == 2


def test_rng_states_survive_a_weights_only_load(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    torch.manual_seed(3)
    saved = ckpt.rng_state()
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))
    torch.save(saved, tmp_path / "rng.pt")
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert random.random() == expected[0]
    assert np.random.standard_normal() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_best_model_is_never_missing_while_it_is_replaced(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, data = prepared
    model = build_model(job.model, data.label_names, seed=0)
    store = CheckpointStore(tmp_path / "t")
    assert store.save_best_model(model)
    # A slow file system: each rename takes a while, so a gap between two of them shows.
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def slow(*args: Any, real: Any = real, **kwargs: Any) -> None:
            real(*args, **kwargs)
            time.sleep(0.002)

        monkeypatch.setattr(os, name, slow)
    misses: list[str] = []
    reads = 0
    saves = 0
    done = threading.Event()

    def read_continuously() -> None:
        # The promise is for a reader in flight during one swap (the version before stays); a
        # reader starved of the GIL for two whole saves (back to back here, minutes apart in a
        # trial) may find its version gone: such reads do not count.
        nonlocal reads
        while not done.is_set():
            began = saves
            try:
                json.loads((store.best_model_path / "config.json").read_text())
                missing = "config.json" not in os.listdir(store.best_model_path)
                miss = "config.json not listed" if missing else None
            except (OSError, ValueError) as e:
                miss = repr(e)
            if saves - began <= 1:
                reads += 1
                if miss is not None:
                    misses.append(miss)

    reader = threading.Thread(target=read_continuously)
    reader.start()
    try:
        for _ in range(20):
            assert store.save_best_model(model)
            saves += 1
    finally:
        done.set()
        reader.join()
    assert misses == [] and reads > 20
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(store.best_model_path)
    _assert_same_weights(model.state_dict(), loaded.state_dict())
    versions = [p for p in store.directory.iterdir() if p.name.startswith(".best-model.v")]
    assert len(versions) == 2  # the current one and the one before, for readers in flight
    store.drop_old_versions()  # the trial ended: one copy of the best model is enough
    versions = [p for p in store.directory.iterdir() if p.name.startswith(".best-model.v")]
    assert len(versions) == 1 and (store.best_model_path / "config.json").is_file()


def test_a_best_model_folder_of_an_older_version_is_replaced(
    prepared: tuple[TrainJob, PreparedData], tmp_path: Path
) -> None:
    job, data = prepared
    model = build_model(job.model, data.label_names, seed=0)
    store = CheckpointStore(tmp_path / "t")
    model.save_pretrained(store.best_model_path)  # type: ignore[operator]
    assert not store.best_model_path.is_symlink()
    assert store.save_best_model(model)
    assert store.best_model_path.is_symlink()
    assert (store.best_model_path / "config.json").is_file()
