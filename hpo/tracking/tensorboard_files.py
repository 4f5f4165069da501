"""Trials as TensorBoard event files: a folder per study, one per trial below it (a retry writes
into its first attempt's), the scalars of every evaluation at step = samples trained, and the
HParams plugin's records (the trial's parameters, the study's metrics, how it ended), so that
TensorBoard's HParams dashboard (its parallel-coordinates view) compares the trials. Runs on
the background thread of hpo.tracking.background; writes through torch's SummaryWriter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hpo.tracking.background import GiveUp
from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart

# The HParams plugin's session status per end (its api.proto Status).
END_STATUS = {"complete": "STATUS_SUCCESS", "pruned": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}


def study_folder(root: str | Path, study: str) -> Path:
    return Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", study)


class TensorboardFiles:
    def __init__(self, root: str, study: str, objectives: list[str]) -> None:
        self.folder = study_folder(root, study)
        self.metrics = [*objectives, "eval_loss"] if "eval_loss" not in objectives else objectives
        self.writers: dict[int, Any] = {}

    def start_study(self, start: StudyStart) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "study.json").write_text(
            json.dumps({"params": start.params, "config": start.config}, indent=1, default=str),
            encoding="utf-8",
        )

    def start_trial(self, start: TrialStart) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        writer: Any = SummaryWriter(log_dir=str(self.folder / f"trial-{start.first_attempt}"))
        self.writers[start.number] = writer
        values = {k: _hparam(v) for k, v in start.params.items() if v is not None}
        experiment, session_start, _ = hparams(values, {m: 0.0 for m in self.metrics})
        for summary in (experiment, session_start):
            writer.file_writer.add_summary(summary)
        writer.add_text("hpo/worker", start.worker)
        writer.flush()

    def evaluation(self, number: int, step: int, metrics: dict[str, float]) -> None:
        writer = self._writer(number)
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()

    def end_trial(self, end: TrialEnd) -> None:
        """The run's own figures (final/...), its end as text and as the HParams session's
        status (a failed trial shows as such in the dashboard)."""
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
        from torch.utils.tensorboard.summary import hparams

        writer = self._writer(end.number)
        for key, value in end.metrics.items():
            writer.add_scalar(f"final/{key}", value, global_step=end.samples)
        writer.add_text("hpo/state", end.state + (f": {end.reason}" if end.reason else ""))
        _, _, session_end = hparams({}, {})
        plugin = session_end.value[0].metadata.plugin_data
        data = plugin_data_pb2.HParamsPluginData.FromString(plugin.content)
        data.session_end_info.status = api_pb2.Status.Value(END_STATUS[end.state])
        plugin.content = data.SerializeToString()
        writer.file_writer.add_summary(session_end)
        writer.close()
        del self.writers[end.number]

    def interrupt_trial(self, end: TrialInterrupted) -> None:
        """This worker's trial handed back: its file closed (a retry writes on in the same
        folder). Another worker's trial needs nothing here."""
        writer = self.writers.pop(end.number, None)
        if writer is not None:
            reason = end.reason.removeprefix("interrupted: ")
            writer.add_text("hpo/state", f"interrupted: {reason}")
            writer.close()

    def _writer(self, number: int) -> Any:
        if number not in self.writers:
            raise GiveUp("the trial's event file could not be opened")
        return self.writers[number]

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()


def _hparam(value: Any) -> Any:
    """The HParams plugin takes numbers, strings and booleans."""
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, default=str)
