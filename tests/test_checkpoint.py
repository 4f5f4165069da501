"""Checkpoints: a run stopped mid-way and resumed ends with exactly the weights of an
uninterrupted run (CPU, dropout on); a failed write never stops training."""

from __future__ import annotations

import errno
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_trainer import tiny_job
from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointStore
from trainer.config import TrainJob
from trainer.data import PreparedData, prepare_data
from trainer.loop import Evaluation, Trainer, TrainResult
from trainer.model import load_tokenizer


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
    leftovers = [p.name for p in store.directory.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # atomic writes leave no temporary files


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
