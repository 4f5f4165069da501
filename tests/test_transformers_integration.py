"""hpo.integrations.transformers: the sampled parameters and hpo's batch split on
TrainingArguments, the callback's reports, stop and checkpoints, hyperparameter_search's config,
and examples/trainer_script tuned end to end (pruning, a resume after SIGTERM)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

from tests.conftest import REPO, study_exists

EXAMPLE = REPO / "examples" / "trainer_script"


class RecordingTrial:
    """A trial that keeps what the callback tells it; prunes from its `prune_at`-th report."""

    number = 7

    def __init__(self, prune_at: int = 0) -> None:
        self.attrs: dict[str, Any] = {}
        self.reports: list[tuple[float, int]] = []
        self.prune_at = prune_at

    def set_user_attr(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return bool(self.prune_at) and len(self.reports) >= self.prune_at


def context(
    trial: RecordingTrial,
    params: dict[str, Any] | None = None,
    metric: str = "eval_loss",
    should_stop: Callable[[], bool] = lambda: False,
    **training: Any,
) -> Any:
    from hpo.plugins.context import TrainingContext
    from hpo.trainer.config import TrainingConfig

    return TrainingContext(
        params=params or {},
        device=torch.device("cpu"),
        effective_batch_size=32,
        trial_number=trial.number,
        metric=metric,
        _trial=trial,
        _training=TrainingConfig(**training),
        _should_stop=should_stop,
    )


def test_exact_split_gives_equal_passes_that_make_the_effective_batch() -> None:
    from hpo.integrations.transformers import exact_split

    assert exact_split(64, 36) == (32, 2)  # 36 fit; two passes of 32, not 36 + 28
    assert exact_split(64, 64) == (64, 1)
    assert exact_split(16, 100) == (16, 1)
    assert exact_split(100, 36) == (25, 4)  # 3 passes cannot split 100 evenly
    assert exact_split(97, 36) == (1, 97)  # a prime: passes of one
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        exact_split(64, 0)


def test_trial_arguments_set_sampled_fields_and_hpos_batch_split(tmp_path: Path) -> None:
    from transformers import TrainingArguments
    from transformers.trainer_utils import SchedulerType

    from hpo.integrations.transformers import trial_arguments

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none"
    )
    trial = RecordingTrial()
    params = {
        "learning_rate": 0.01,
        "num_train_epochs": 2,
        "lr_scheduler_type": "cosine",
        "effective_batch_size": 64,
        "dropout": 0.1,
    }
    ctx = context(trial, params, physical_batch_size=24)
    tuned = trial_arguments(args, ctx)
    assert tuned.learning_rate == 0.01
    assert tuned.num_train_epochs == 2.0 and isinstance(tuned.num_train_epochs, float)
    assert tuned.lr_scheduler_type == SchedulerType.COSINE
    # 24 fit: 64 is 4 passes of 16 (3 passes of 24 would make 72, or a short last pass)
    assert (tuned.per_device_train_batch_size, tuned.gradient_accumulation_steps) == (16, 4)
    assert tuned.use_cpu and not hasattr(tuned, "dropout")  # dropout is model_init's
    assert args.learning_rate != 0.01 and args.per_device_train_batch_size == 8  # a copy
    assert (ctx.physical_batch_size, ctx.grad_accum_steps) == (16, 4)
    assert (trial.attrs["physical_batch_size"], trial.attrs["grad_accum_steps"]) == (16, 4)

    # A transformers-style space samples the per-device batch: with the arguments' two
    # accumulation steps, it means 64 examples a step, and all of them fit in one pass.
    ctx = context(RecordingTrial(), {"per_device_train_batch_size": 32})
    args.gradient_accumulation_steps = 2
    tuned = trial_arguments(args, ctx)
    assert ctx.effective_batch_size == 64
    assert (tuned.per_device_train_batch_size, tuned.gradient_accumulation_steps) == (64, 1)

    sizes: list[int] = []  # hpo's batch finder probes the step it is given: 40 fit
    ctx = context(RecordingTrial(), {"effective_batch_size": 128})
    tuned = trial_arguments(args, ctx, probe=lambda size: sizes.append(size) or _oom(size > 40))
    assert sizes and (tuned.per_device_train_batch_size, tuned.gradient_accumulation_steps) == (
        32,
        4,
    )

    with pytest.raises(ValueError, match="the sampled num_train_epochs='many' is no float"):
        trial_arguments(args, context(RecordingTrial(), {"num_train_epochs": "many"}))


def test_probe_step_trains_a_copy_on_a_batch_of_the_size_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch finder's step for a Trainer: the collator's batch, its rows repeated to the
    size probed, through forward, backward and an optimizer step of a copy of the model."""
    from hpo.integrations.transformers import probe_step

    monkeypatch.syspath_prepend(str(EXAMPLE))
    import train_bert

    batch = next(iter(train_bert.make_trainer().get_train_dataloader()))
    model = train_bert.model_init()
    sizes: list[int] = []

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(len(kwargs["input_ids"]))  # the hook goes with the copy

    model.register_forward_pre_hook(record, with_kwargs=True)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    probe_step(model, batch)(40)  # the batch has 16 rows
    assert sizes == [40]
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # a copy trained


def _oom(raise_it: bool) -> None:
    if raise_it:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_callback_reports_each_evaluation_by_its_number_and_prunes() -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hpo.integrations.transformers import HpoCallback

    trial = RecordingTrial(prune_at=3)
    ctx = context(trial, metric="objective")
    callback = HpoCallback(ctx, compute_objective=lambda m: 1 - m["eval_accuracy"])
    state, control = TrainerState(), TrainerControl()
    state.log_history = [{"eval_loss": 0.9, "eval_runtime": 0.1}]  # one before a resume
    args = TrainingArguments(output_dir="unused", report_to="none")

    def evaluate(loss: float, accuracy: float) -> None:
        metrics = {
            "eval_loss": loss,
            "eval_accuracy": accuracy,
            "eval_runtime": 0.1,
            "epoch": 1.0,
            "eval_note": "not a number",
        }
        state.log_history.append({**metrics, "step": 8})  # the Trainer logs, then calls back
        callback.on_evaluate(args, state, control, metrics=metrics)

    evaluate(0.7, 0.6)
    evaluate(0.6, 0.75)
    assert trial.reports == [(pytest.approx(0.4), 2), (0.25, 3)]  # the 2nd and 3rd evaluation
    assert ctx.last_metrics["eval_loss"] == 0.6 and "eval_note" not in ctx.last_metrics
    with pytest.raises(optuna.TrialPruned, match="pruner: objective=0.5000 at step 4"):
        evaluate(0.65, 0.5)
    assert not control.should_training_stop  # pruning ends train() by the exception


def test_callback_stops_with_a_checkpoint_that_the_retry_resumes_from(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hpo.integrations.transformers import HpoCallback, resume_checkpoint
    from hpo.trainer.checkpoint import CheckpointStore

    stop = threading.Event()
    ctx = context(RecordingTrial(), should_stop=stop.is_set)
    ctx._store, ctx._fingerprint = CheckpointStore(tmp_path / "trial"), "f"
    assert resume_checkpoint(ctx, tmp_path / "out") is None  # a first attempt
    callback = HpoCallback(ctx)
    state, control = TrainerState(), TrainerControl()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    callback.on_step_end(args, state, control)
    assert not (control.should_save or control.should_training_stop)
    stop.set()  # SIGTERM: the worker asks the trial to stop
    callback.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop
    state.global_step = 12  # the Trainer saves its checkpoint, then calls back
    written = tmp_path / "out" / "checkpoint-12"
    (written / "sub").mkdir(parents=True)
    (written / "model.safetensors").write_bytes(b"\x00weights")
    (written / "sub" / "trainer_state.json").write_text('{"global_step": 12}')
    callback.on_save(args, state, control)
    # The stopped Trainer still ends its epoch, where eval_strategy and save_strategy "epoch"
    # would evaluate a partial epoch and save the same step again.
    control.should_evaluate = control.should_save = True
    callback.on_epoch_end(args, state, control)
    assert not (control.should_evaluate or control.should_save)

    retry = context(RecordingTrial())
    retry._store, retry._fingerprint = CheckpointStore(tmp_path / "trial", resume=True), "f"
    other_host = tmp_path / "elsewhere"  # the Trainer's own folder is not there
    path = resume_checkpoint(retry, other_host)
    assert path == str(other_host / "hpo-restored" / "checkpoint-12")
    assert (Path(path) / "model.safetensors").read_bytes() == b"\x00weights"
    assert (Path(path) / "sub" / "trainer_state.json").read_text() == '{"global_step": 12}'


def test_hyperparameter_search_names_the_scripts_functions_in_hpos_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpo.commands.run import config_from
    from hpo.errors import ConfigError
    from hpo.integrations.transformers import hyperparameter_search, search_config
    from hpo.plugins.entrypoint import load_entrypoint

    monkeypatch.syspath_prepend(str(EXAMPLE))
    import train_bert

    raw = search_config(
        train_bert.train, train_bert.hp_space, 5, "maximize", "cpu", {"pruner": {"type": "median"}}
    )
    assert raw["training"] == {"entrypoint": "train_bert:train", "device": "cpu"}
    assert raw["search_space"] == "train_bert:hp_space"
    config = config_from(raw)  # hpo's own checks take it
    assert config.study.objectives == ["objective"] and config.study.n_trials == 5
    assert load_entrypoint("train_bert:train", str(EXAMPLE)) is train_bert.train
    default = search_config(train_bert.train, None, 5, "minimize", None, {})
    assert default["search_space"] == "transformers.trainer_utils:default_hp_space_optuna"

    def local_space(trial: optuna.Trial) -> dict[str, Any]:
        return {}

    with pytest.raises(ConfigError, match="hp_space: .*local_space is not a name at the top"):
        search_config(train_bert.train, local_space, 5, "minimize", None, {})
    with pytest.raises(ConfigError, match="backend: got 'ray'; hpo's search is Optuna's"):
        hyperparameter_search(train_bert.train, backend="ray", study="s")
    with pytest.raises(ConfigError, match="train: got function; give what trainer_entrypoint"):
        hyperparameter_search(train_bert.make_trainer, study="s")  # type: ignore[arg-type]


@pytest.mark.slow
def test_trainer_script_is_tuned_pruned_and_resumed_after_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hpo_main: Callable[[list[str]], int]
) -> None:
    """examples/trainer_script through `hpo run`, in this process: SIGTERM once the first trial
    has evaluated; the Trainer checkpoint it saves goes through hpo's store, and the next run's
    retry resumes from it (its evaluations go on counting, none twice); the enqueued tiny
    learning rate is pruned at its second evaluation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    url = f"sqlite:///{tmp_path / 's.db'}"
    args = [
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--study",
        "s",
        "--storage",
        url,
        "--n-trials",
        "3",
    ]
    killer = threading.Thread(target=_sigterm_after_an_evaluation, args=(url,), daemon=True)
    killer.start()
    hpo_main(args)
    killer.join(timeout=5)
    stopped = optuna.load_study(study_name="s", storage=url).trials[0]
    assert stopped.state != optuna.trial.TrialState.COMPLETE
    assert max(stopped.intermediate_values) == 1  # no evaluation of the partial epoch
    assert hpo_main(args) == 0
    trials = optuna.load_study(study_name="s", storage=url).trials
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    resumed = next(t for t in complete if t.params == stopped.params)
    first = min(resumed.intermediate_values)
    # The report of the evaluation it stopped after may not reach the study (the worker stops
    # relaying once it asked the trial to stop): it resumed after the last one recorded or one.
    assert first in (max(stopped.intermediate_values) + 1, max(stopped.intermediate_values) + 2)
    assert sorted(resumed.intermediate_values) == list(range(first, 4))  # 3 epochs, none twice
    assert (
        resumed.user_attrs["grad_accum_steps"] * resumed.user_attrs["physical_batch_size"]
        == resumed.params["effective_batch_size"]
    )
    (pruned,) = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned.params["learning_rate"] == 0.0001 and sorted(pruned.intermediate_values) == [1, 2]
    # The worker's account of the pruner's decision replaces the script's bare "pruner: ...".
    assert pruned.user_attrs["prune_reason"].startswith("median pruner: ")
    assert "objective" in pruned.user_attrs["prune_reason"]
    assert len(complete) == 2 and all(t.value < 0.68 for t in complete), [
        (t.params, t.value) for t in complete
    ]
    assert (tmp_path / "trainer-runs").is_dir()  # the Trainer's own output, where it ran


def _sigterm_after_an_evaluation(url: str) -> None:
    """SIGTERM to this process (as to a worker) once the study's first trial has reported."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if not study_exists(url, "s"):
            continue
        trials = optuna.load_study(study_name="s", storage=url).trials
        if trials and trials[0].intermediate_values:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def test_an_entrypoint_that_uses_the_trainer_has_it_preloaded() -> None:
    """The fork server of a worker whose training function imported transformers' Trainer
    loads it once (not again in each trial process); a plain PyTorch function's does not."""
    from hpo.trial.fork_start import ENTRYPOINT_PRELOAD, TRAINER_PRELOAD, entrypoint_preload

    assert entrypoint_preload({"torch", "optuna"}) == ENTRYPOINT_PRELOAD
    preload = entrypoint_preload({"torch", *TRAINER_PRELOAD})
    assert preload[:-1] == [*ENTRYPOINT_PRELOAD[:-1], *TRAINER_PRELOAD]
    assert preload[-1] == "hpo.trial.fork_server"  # the fork server's exit hook comes last
