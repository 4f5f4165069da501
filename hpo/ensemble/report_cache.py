"""A cache of fitted ensembles beside the feature cache: the honest scores, the greedy selection
and the chosen meta-learner (skops), keyed by the sha256 of the members' features and labels and
of every option that changes the result, so a second ensemble over the same members fits nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from hpo.ensemble.cache import FeatureCache
from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.honest import CV_FOLDS, ChosenBy, EnsembleReport, Split, evaluate_ensemble
from hpo.ensemble.learners import (
    CLASSIFIER_LEARNERS,
    REGRESSION_LEARNERS,
    Learner,
    learner,
    resolve_learners,
)
from hpo.ensemble.scoring import metric_for
from hpo.ensemble.selection import DEFAULT_ROUNDS, Selection
from hpo.ensemble.stacking import PREDICTIONS, FeatureSettings, StackedModel

log = logging.getLogger("hpo")

# Raise when what is stored, or how a result is computed, changes: it is part of every key, so
# an older entry is never read (its ensemble is fitted again). 2: `chosen_by`, the choice made
# out of fold on the evaluation split. 3: its standard error (stacking must win by more).
FORMAT = 3
REPORT = "report.json"
META_LEARNER = "meta_learner.skops"
FOLDER = "ensembles"  # inside the feature cache's folder


class ReportCache:
    """Fitted ensembles under `folder`, one zip file each (the report as JSON, the meta-learner
    as skops), written aside and renamed in: a reader never sees half a file, and a file that
    does not read back whole is ignored (computed again and replaced), never an error."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def beside(cls, features: FeatureCache) -> ReportCache:
        """In the feature cache's folder: one cache directory to keep or clear."""
        return cls(features.folder / FOLDER)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.zip"

    def get(self, key: str) -> EnsembleReport | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return _read(path, key)
        except Exception as e:  # zipfile and json raise many kinds on a damaged file
            # A damaged entry (a disk that filled, a copy cut short) costs a fit, not the run;
            # the fit then replaces it.
            log.info("ensemble cache: %s unreadable (%r); fitting again", path.name, e)
            return None

    def put(self, key: str, report: EnsembleReport) -> Path | None:
        """Store `report`, with its meta-learner when stacking is the choice (skops loads all of
        scikit-learn: seconds, spent only when the stack is saved anyway). None when nothing
        could be stored (a meta-learner skops refuses, a folder that cannot be written): the
        next run fits again."""
        try:
            entry = _entry_bytes(key, report)
        except (EnsembleError, TypeError, ValueError) as e:  # skops refused; not JSON
            log.info("ensemble cache: not stored (%s)", e)
            return None
        path = self.path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, aside = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".zip", dir=self.folder)
        except OSError as e:  # a cache that cannot be written costs the next run a fit
            log.info("ensemble cache: not stored in %s (%s)", self.folder, e)
            return None
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(entry)
            os.replace(aside, path)
        except OSError as e:  # a full disk, say
            Path(aside).unlink(missing_ok=True)
            log.info("ensemble cache: not stored in %s (%s)", self.folder, e)
            return None
        except BaseException:
            Path(aside).unlink(missing_ok=True)
            raise
        return path


def evaluate_cached(
    task: str,
    evaluation: Split,
    test: Split | None,
    cache: ReportCache | None,
    metric: str | None = None,
    learners: Sequence[str | Learner] | None = None,
    settings: FeatureSettings = PREDICTIONS,
    folds: int = CV_FOLDS,
    max_rounds: int = DEFAULT_ROUNDS,
    seed: int = 0,
) -> EnsembleReport:
    """`evaluate_ensemble`, read from `cache` when these features and options were fitted
    before; else fitted and stored. Learners other than hpo's own are never cached."""
    options = (metric, learners, settings, folds, max_rounds, seed)
    key = None if cache is None else report_key(task, evaluation, test, *options)
    if cache is not None and key is not None:
        cached = cache.get(key)
        # Stored without its meta-learner (stacking was not the choice then): fitted again
        # if this run would save the stack.
        if cached is not None and (cached.choice != "stacking" or _has_fit(cached)):
            log.info("ensemble cache: read %s (nothing fitted)", cache.path(key))
            return cached
    report = evaluate_ensemble(task, evaluation, test, *options)
    if cache is not None and key is not None:
        cache.put(key, report)
    return report


def report_key(
    task: str,
    evaluation: Split,
    test: Split | None,
    metric: str | None = None,
    learners: Sequence[str | Learner] | None = None,
    settings: FeatureSettings = PREDICTIONS,
    folds: int = CV_FOLDS,
    max_rounds: int = DEFAULT_ROUNDS,
    seed: int = 0,
) -> str | None:
    """The sha256 of everything the result depends on; None for learners hpo cannot name (a
    Learner of the caller's: its code is not part of any key)."""
    chosen = resolve_learners(task, learners)
    if any(lr.name not in _BUILT_IN or lr != learner(lr.name) for lr in chosen):
        return None
    digest = hashlib.sha256()
    options = {
        "format": FORMAT,
        "task": task,
        "metric": metric_for(task, metric),
        "learners": [[lr.name, repr(sorted(lr.grid.items()))] for lr in chosen],
        "settings": settings.to_json(),
        "folds": folds,
        "max_rounds": max_rounds,
        "seed": seed,
        "versions": [_version(p) for p in ("scikit-learn", "numpy")],
    }
    digest.update(json.dumps(options, sort_keys=True).encode())
    for name, split in (("evaluation", evaluation), ("test", test)):
        digest.update(f"\n{name}\n".encode())
        if split is not None:
            _update_split(digest, split)
    return digest.hexdigest()


_BUILT_IN = (*CLASSIFIER_LEARNERS, *REGRESSION_LEARNERS)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def _update_split(digest: Any, split: Split) -> None:
    """Members' names and arrays in their order, the labels, the stacking features."""
    arrays: list[tuple[str, Any]] = [(f"member {n}", p) for n, p in split.predictions.items()]
    arrays.append(("labels", split.labels))
    if split.features is not None:
        arrays.append(("features", split.features))
    for name, array in arrays:
        values = np.ascontiguousarray(array)
        digest.update(f"{name} {values.dtype.str} {values.shape}\n".encode())
        digest.update(values.tobytes())


# -- the entry: a zip of the report's JSON and the meta-learner's skops file -----------------


def _has_fit(report: EnsembleReport) -> bool:
    return report.stacked is not None and report.stacked.skops_bytes is not None


def _entry_bytes(key: str, report: EnsembleReport) -> bytes:
    stacked = report.stacked
    keep = stacked is not None and report.choice == "stacking"
    skops = stacked.skops_file() if stacked is not None and keep else b""
    text = json.dumps({"format": FORMAT, "key": key, "report": _report_json(report)})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as entry:
        entry.writestr(REPORT, text)
        entry.writestr(META_LEARNER, skops)
    return buffer.getvalue()


def _read(path: Path, key: str) -> EnsembleReport:
    with zipfile.ZipFile(path) as entry:
        damaged = entry.testzip()  # every member's CRC: a file cut short or flipped fails here
        if damaged is not None:
            raise EnsembleError(f"{damaged} is damaged")
        stored = json.loads(entry.read(REPORT))
        skops = entry.read(META_LEARNER)
    if stored.get("format") != FORMAT or stored.get("key") != key:
        raise EnsembleError("written by another hpo, or under another key")
    return _report_from_json(stored["report"], skops or None)


def _report_json(report: EnsembleReport) -> dict[str, Any]:
    stacked = report.stacked
    return {
        "task": report.task,
        "metric": report.metric,
        "measured_on": report.measured_on,
        "folds": report.folds,
        "member_scores": report.member_scores,
        "best_member": report.best_member,
        "best_member_score": report.best_member_score,
        "soft_voting_score": report.soft_voting_score,
        "selection": {
            "counts": report.selection.counts,
            "metric": report.selection.metric,
            "scores": report.selection.scores,
        },
        "selection_score": report.selection_score,
        "stacking_scores": report.stacking_scores,
        "best_learner": report.best_learner,
        "chosen_by": {
            "stacking": report.chosen_by.stacking,
            "best_member": report.chosen_by.best_member,
            "folds": report.chosen_by.folds,
            "standard_error": report.chosen_by.standard_error,
        },
        "stacked": None
        if stacked is None
        else {
            "task": stacked.task,
            "learner": stacked.learner,
            "members": stacked.members,
            "settings": stacked.settings.to_json(),
            "num_outputs": stacked.num_outputs,
            "params": stacked.params,
        },
        "notes": report.notes,
    }


def _report_from_json(data: Mapping[str, Any], skops: bytes | None) -> EnsembleReport:
    stacked = data["stacked"]
    model = None
    if stacked is not None:
        model = StackedModel(
            str(stacked["task"]),
            str(stacked["learner"]),
            list(stacked["members"]),
            FeatureSettings(**stacked["settings"]),
            [],  # loaded from skops_bytes only if the model predicts (None: not stored)
            int(stacked["num_outputs"]),
            list(stacked["params"]),
            skops_bytes=skops,
        )
    selection, chosen_by = data["selection"], data["chosen_by"]
    return EnsembleReport(
        str(data["task"]),
        str(data["metric"]),
        data["measured_on"],
        data["folds"],
        {str(k): float(v) for k, v in data["member_scores"].items()},
        str(data["best_member"]),
        float(data["best_member_score"]),
        float(data["soft_voting_score"]),
        Selection(dict(selection["counts"]), str(selection["metric"]), list(selection["scores"])),
        float(data["selection_score"]),
        {str(k): float(v) for k, v in data["stacking_scores"].items()},
        data["best_learner"],
        ChosenBy(
            float(chosen_by["stacking"]),
            float(chosen_by["best_member"]),
            int(chosen_by["folds"]),
            float(chosen_by["standard_error"]),
        ),
        model,
        list(data["notes"]),
    )
