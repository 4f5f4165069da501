"""The saved ensemble, a folder: ensemble.json (kind, members with their folders and weights'
sha256, feature settings, scores and how each was measured) and, for stacking, the meta-learner
saved with skops, which loads without running code (never a pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.honest import EnsembleReport
from hpo.ensemble.skops_files import meta_learner_from_bytes
from hpo.ensemble.stacking import FeatureSettings, StackedModel
from hpo.trainer.digests import file_sha256

RECORD = "ensemble.json"
META_LEARNER = "meta_learner.skops"
MEMBERS = "members"  # the folder members are copied into
FORMAT = 1
# The weight files a member folder may hold (transformers, PEFT adapters, a soup).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
KINDS = ("stacking", "best_member", "average")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class SavedEnsemble:
    """A loaded ensemble: what to predict with, and its record."""

    kind: str  # "stacking" or "best_member"
    task: str
    members: dict[str, Path]  # name -> member folder, its weights checked
    model: StackedModel | None
    record: dict[str, Any]


def weights_sha256(folder: Path) -> str:
    """The sha256 of a member's weights: of its weight files' names and sha256s, in name order."""
    # Files only: a link to /dev/zero named model.bin would be read for ever.
    found = {p for pattern in WEIGHT_PATTERNS for p in Path(folder).glob(pattern)}
    files = sorted(p for p in found if p.is_file())
    if not files:
        raise EnsembleError(
            f"member folder {folder} holds no weights (*.safetensors, *.bin); "
            "point at a saved model folder"
        )
    listing = "".join(f"{p.name} {file_sha256(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def features_sha256(folder: Path) -> str:
    """The sha256 of what a member's features depend on (the feature cache's key): its weights
    and every other file beside them, which turn rows into inputs and outputs (the tokenizer,
    config.json, hpo_inference.json's max_length and threshold); not a model card (*.md)."""
    weights = set(WEIGHT_PATTERNS)
    beside = sorted(
        p
        for p in Path(folder).iterdir()
        if p.is_file() and p.suffix != ".md" and not any(p.match(w) for w in weights)
    )
    listing = "".join(f"{p.name} {file_sha256(p)}\n" for p in beside)
    return hashlib.sha256(f"{weights_sha256(folder)}\n{listing}".encode()).hexdigest()


def save_ensemble(
    folder: Path,
    report: EnsembleReport,
    members: Mapping[str, Path],
    copy_members: bool = False,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write the ensemble `report` chose into a new `folder` (written aside, then renamed in).
    `copy_members`: each member used is copied into folder/members/NAME (the folder then holds
    all it needs); `extra_files`: name -> text written beside the record (a model card)."""
    folder = Path(folder)
    if folder.exists():
        raise EnsembleError(f"{folder} already exists; choose another folder or remove it")
    missing = [n for n in report.member_scores if n not in members]
    if missing:
        raise EnsembleError(f"member {missing[0]!r} has no folder; give every member's folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        if copy_members:
            used = [report.best_member] if report.choice == "best_member" else report.member_scores
            for name in used:
                copy_member(Path(members[name]), staging / MEMBERS / name)
            members = {name: folder / MEMBERS / name for name in used}
            record = _record(report, members, folder, staging)
        else:
            record = _record(report, members, folder)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        if report.choice == "stacking" and report.stacked is not None:
            _dump_meta_learner(report.stacked, staging / META_LEARNER)
        (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        rename_in(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def copy_member(source: Path, target: Path) -> None:
    """A member's folder copied to `target` (a link inside it copied as what it points to);
    refused in one line when a link in it leads out of it: a link to / would copy the host's
    whole tree, one to ~/.ssh its keys into a folder that is then shared."""
    root = Path(source).resolve()
    for here, folders, files in os.walk(source):  # links to folders listed, not followed
        for name in (*folders, *files):
            path = Path(here) / name
            if not path.is_symlink():
                continue
            try:
                inside = path.resolve().is_relative_to(root)
            except (OSError, RuntimeError):  # a link loop
                inside = False
            if not inside:
                raise EnsembleError(
                    f"member folder {source}: {path.relative_to(source)} is a link that leads "
                    "out of it; copy what it points to into the folder, or remove the link"
                )
    shutil.copytree(source, target)


def rename_in(staged: Path, folder: Path) -> None:
    """The folder written aside, renamed to `folder`: refused in one line when `folder` was
    made meanwhile (another hpo ensemble writing the same --out), never merged into it."""
    try:
        staged.rename(folder)
    except OSError as e:
        raise EnsembleError(
            f"{folder} cannot be written ({e.strerror or e}): it was made while the ensemble "
            "was built; choose another folder"
        ) from e


def _record(
    report: EnsembleReport, members: Mapping[str, Path], folder: Path, staged: Path | None = None
) -> dict[str, Any]:
    """`staged`: where `folder`'s files are until it is renamed in (the members' copies)."""

    def on_disk(member: Path) -> Path:
        if staged is None or not member.is_relative_to(folder):
            return member
        return staged / member.relative_to(folder)

    used = list(report.member_scores)
    if report.choice == "best_member":
        used = [report.best_member]
    stacked = report.stacked if report.choice == "stacking" else None
    return {
        "format": FORMAT,
        "kind": report.choice,
        "task": report.task,
        "members": [
            {
                "name": name,
                "folder": _shown_path(Path(members[name]), folder),
                "sha256": weights_sha256(on_disk(Path(members[name]))),
                "score": report.member_scores[name],
            }
            for name in used
        ],
        "learner": stacked.learner if stacked else None,
        "num_outputs": stacked.num_outputs if stacked else None,
        "features": (stacked.settings if stacked else FeatureSettings()).to_json(),
        "meta_learner": META_LEARNER if stacked else None,
        "scores": report.to_json(),
    }


def _shown_path(member: Path, folder: Path) -> str:
    """A member inside the ensemble's folder is recorded relative to it (the folder can move)."""
    if member.is_relative_to(folder):  # a copy not yet renamed in
        return str(member.relative_to(folder))
    resolved, base = member.resolve(), folder.resolve()
    return str(resolved.relative_to(base)) if resolved.is_relative_to(base) else str(resolved)


def _dump_meta_learner(model: StackedModel, path: Path) -> None:
    path.write_bytes(model.skops_file())


def load_ensemble(folder: Path) -> SavedEnsemble:
    """Read a saved ensemble; refuse, in one line, a damaged record, a missing member or one
    whose weights changed, and a meta-learner that is not a skops file of trusted types."""
    folder = Path(folder)
    record = _read_record(folder)
    members: dict[str, Path] = {}
    for entry in record["members"]:
        path = _member_folder(folder, entry)
        if not path.is_dir():
            raise EnsembleError(
                f"{folder}: member {entry['name']!r} is missing (no folder {path}); restore it "
                "or build the ensemble again"
            )
        if weights_sha256(path) != entry["sha256"]:
            raise EnsembleError(
                f"{folder}: member {entry['name']!r} in {path} is not the one this ensemble "
                "was built on (its weights' sha256 differs); restore it or build the ensemble again"
            )
        members[entry["name"]] = path
    model = None
    if record["kind"] == "stacking":
        estimators = _load_meta_learner(folder / META_LEARNER)
        model = StackedModel(
            record["task"],
            record["learner"],
            list(members),
            FeatureSettings(**record["features"]),
            estimators["estimators"],
            record["num_outputs"],
            list(estimators.get("params", [])),
        )
    return SavedEnsemble(record["kind"], record["task"], members, model, record)


def _member_folder(folder: Path, entry: dict[str, Any]) -> Path:
    """A member's folder: an absolute one as recorded (a member not copied), else one inside
    the ensemble's folder; hpo never records a relative one that leads out (by .. or a link)."""
    path = folder / entry["folder"]  # an absolute folder stays absolute
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError, ValueError) as e:  # a link loop, a NUL in the name
        raise EnsembleError(f"{folder}: member {entry['name']!r}: {e}; build it again") from e
    if not Path(entry["folder"]).is_absolute() and not inside:
        raise EnsembleError(
            f"{folder}: member {entry['name']!r} is recorded at {entry['folder']!r}, which "
            "leads out of the ensemble's folder; hpo never writes that: build it again"
        )
    return path


def _read_record(folder: Path) -> dict[str, Any]:
    path = folder / RECORD
    if not path.is_file():
        raise EnsembleError(f"{folder} is not a saved ensemble (no {RECORD}); check the path")
    try:
        record = json.loads(path.read_text())
    # ValueError: not JSON, not UTF-8, or a number of 5,000 digits; RecursionError: [[[[...
    except (ValueError, RecursionError) as e:
        raise EnsembleError(f"{path} is damaged ({e}); build the ensemble again") from e
    # "average": a tagger ensemble, its members' token probabilities averaged (no learner).
    keys = {"format", "kind", "task", "members"}
    if not isinstance(record, dict) or not keys <= set(record) or record["kind"] not in KINDS:
        raise EnsembleError(f"{path} is not an ensemble record hpo wrote; build it again")
    if record["format"] != FORMAT:
        shown = str(record["format"])[:20]
        raise EnsembleError(f"{path} has format {shown}; this hpo reads format {FORMAT}")
    problem = _members_problem(record["members"]) or _stacking_problem(record)
    if problem is not None:
        raise EnsembleError(f"{path} is damaged ({problem}); build the ensemble again")
    return dict(record)


def _members_problem(members: Any) -> str | None:
    """What is wrong with a record's members (an edit, say), or None: each once, with its name,
    folder and weights' sha256."""
    if not isinstance(members, list) or not members:
        return "members: not a list of members"
    names: set[str] = set()
    for entry in members:
        fields = ("name", "folder", "sha256")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in fields):
            return "a member without its name, folder and sha256"
        if entry["name"] in names:
            return f"member {entry['name'][:80]!r} listed twice"
        if not _SHA256.fullmatch(entry["sha256"]):
            return f"member {entry['name'][:80]!r}: its sha256 is not 64 hex digits"
        names.add(entry["name"])
    return None


def _stacking_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with a stacked record's task, learner and features, or None."""
    if not isinstance(record["task"], str):
        return "task: not a task's name"
    if record["kind"] != "stacking":
        return None
    outputs, features = record.get("num_outputs"), record.get("features")
    if type(outputs) is not int or outputs < 1:  # not bool, which is an int too
        return "num_outputs: not a count of outputs"
    if not isinstance(record.get("learner"), str) or record.get("meta_learner") != META_LEARNER:
        return f"learner and meta_learner: not a learner's name and {META_LEARNER}"
    pca = features.get("pca_components") if isinstance(features, dict) else None
    if (
        not isinstance(features, dict)
        or set(features) - set(FeatureSettings.__dataclass_fields__)
        or not isinstance(features.get("kind", ""), str)
        or not isinstance(features.get("scale", False), bool)
        or not (pca is None or type(pca) is int)
    ):
        return "features: not the feature settings hpo writes"
    return None


def _load_meta_learner(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise EnsembleError(f"{path} is missing; the stacked ensemble needs its meta-learner")
    if not zipfile.is_zipfile(path):
        raise EnsembleError(
            f"{path} is not a skops file (a pickle, perhaps); hpo loads only skops files, "
            "which run no code: build the ensemble again"
        )
    return meta_learner_from_bytes(path.read_bytes(), str(path))
