"""Who `hpo ensemble` combines and on which data: the study's top trials' kept models (on this
host, else fetched from its artifact store, a LoRA adapter repointed at its base model as this
host finds it) or hpo retrain's folders; the evaluation file, and the test file that scores them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hpo.errors import HPOError

log = logging.getLogger("hpo")


class EnsembleRequest(Protocol):
    """What of hpo.commands.ensemble.EnsembleRequest the members and data depend on."""

    @property
    def study(self) -> str | None: ...
    @property
    def storage(self) -> str | None: ...
    @property
    def config(self) -> str | None: ...
    @property
    def top(self) -> int: ...
    @property
    def from_retrain(self) -> tuple[str, ...]: ...
    @property
    def test_file(self) -> str | None: ...


@dataclass
class DataFiles:
    """The files members predict, and how their labels read."""

    task: str
    evaluation: Path
    test: Path | None
    label_column: str
    label_separator: str = ","
    # Why a test file the study recorded is not used (changed or gone): said in the report.
    test_note: str | None = None


@dataclass
class Members:
    """The member folders by name; `sources`: where each fetched one came from in the store
    (its trial, store URI and weights' sha256), shown on the model card instead of the
    temporary folder it was fetched into."""

    folders: dict[str, Path]
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)


def members_and_data(
    request: EnsembleRequest, study: Any, fetched: Path
) -> tuple[Members, DataFiles]:
    """The members the request names and the data they are scored on (--test-file, else the
    config's data.test_file, else the one the study recorded, when it is unchanged)."""
    given = None if request.test_file is None else checked_test_file(request.test_file)
    members, data = _members_and_data(request, study, fetched)
    if given is not None:
        data.test, data.test_note = given, None
    return members, data


def checked_test_file(given: str) -> Path:
    path = Path(given)
    if not path.is_file() or path.suffix.lower() not in (".csv", ".jsonl"):
        why = "not a .csv or .jsonl file" if path.is_file() else "no such file"
        raise HPOError(f"--test-file {given}: {why}; give the held-out split's .csv or .jsonl")
    return path


def _members_and_data(
    request: EnsembleRequest, study: Any, fetched: Path
) -> tuple[Members, DataFiles]:
    if request.from_retrain and (request.study or study is not None):
        raise HPOError("give --study or --from-retrain, not both")
    if request.from_retrain:
        if request.config is None:
            raise HPOError("--from-retrain needs --config: the config the study ran with")
        return Members(_given_folders(request.from_retrain)), data_of_config(request.config)
    if not request.study and study is None:
        raise HPOError("give --study NAME (its top trials' models) or --from-retrain DIR ...")
    if request.top < 2:
        raise HPOError(f"--top {request.top}: an ensemble needs at least 2 members")
    from hpo import services
    from hpo.study.setup_record import SETUP_ATTR

    if study is None:
        storage, url = services.open_storage_to_read(request.storage)
        study = services.load_existing_study(storage, str(request.study), url.masked)
    config = None
    if request.config is not None:
        from hpo.config.loader import load_config

        config = load_config(request.config)
    base = config.model.name_or_path if config is not None else None
    members = _top_models(study, request.top, fetched, base)
    if config is not None:
        return members, _data_of(config)
    setup = study.user_attrs.get(SETUP_ATTR) or {}
    return members, data_of_setup(setup, study.study_name, study.user_attrs)


def _given_folders(given: tuple[str, ...]) -> dict[str, Path]:
    """--from-retrain's folders by name: the folder's own name, or where two share it (every
    kept trial model is a `best-model`) as many of its parents' names as tell them apart."""
    resolved: dict[Path, str] = {}
    for text in given:
        folder = Path(text)
        if not (folder / "config.json").is_file():
            raise HPOError(
                f"--from-retrain {text}: not a model folder (no config.json); give the "
                "folder hpo retrain --out wrote"
            )
        real = folder.resolve()
        if real in resolved:
            raise HPOError(
                f"--from-retrain {text}: the same folder as {resolved[real]}; give each member once"
            )
        resolved[real] = text
    paths = list(resolved)
    names = member_names(paths)
    return {name: Path(resolved[path]) for name, path in zip(names, paths, strict=True)}


def labels_by_id(folder: Path) -> list[str]:
    """The label names of a member's config.json in id order; read before any member loads,
    so a config that has none is said here in one line."""
    try:
        config = json.loads((folder / "config.json").read_text())
        id2label = config.get("id2label") or {}
        return [id2label[k] for k in sorted(id2label, key=int)]
    # Not JSON, not an object, ids that are not numbers.
    except (OSError, ValueError, AttributeError, TypeError, KeyError, IndexError) as e:
        raise HPOError(
            f"member {folder}: config.json has no labels by id ({e!r:.100}); give a model "
            "folder hpo saved"
        ) from e


def member_names(paths: list[Path]) -> list[str]:
    """A distinct name per resolved folder, made of its last path parts joined by "-" (names
    become folder names in the saved ensemble: no separators, never "" or "..")."""
    depth = [1] * len(paths)
    while True:
        names = [
            "-".join(part for part in p.parts[-d:] if part != p.anchor) or "member"
            for p, d in zip(paths, depth, strict=True)
        ]
        clashing = [i for i, n in enumerate(names) if names.count(n) > 1]
        if not clashing:
            return names
        if all(depth[i] >= len(paths[i].parts) for i in clashing):
            return [f"{n}-{i + 1}" if i in clashing else n for i, n in enumerate(names)]
        for i in clashing:
            depth[i] += 1


# -- the study's top models ----------------------------------------------------------------------


def _top_models(study: Any, top: int, fetched: Path, base: str | None) -> Members:
    """The best `top` completed trials that kept a model: on this host, else fetched from the
    study's artifact store into `fetched` (every file checked against its sha256). `base`: the
    config's model.name_or_path, the base a fetched LoRA adapter is put on (default: the one
    the study recorded, as this host resolves it)."""
    import optuna

    if len(study.directions) > 1:
        raise HPOError("a multi-objective study has no single order of its trials to ensemble")
    reverse = study.direction == optuna.study.StudyDirection.MAXIMIZE
    done = [
        t
        for t in study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.COMPLETE])
        if t.value is not None
    ]
    members = Members({})
    for trial in sorted(done, key=lambda t: t.value, reverse=reverse):
        name = f"trial-{trial.number}"
        kept = trial.user_attrs.get("best_model")
        if kept and (Path(kept) / "config.json").is_file():
            members.folders[name] = Path(kept)
        elif kept or trial.user_attrs.get("best_model_uri"):
            found = _fetch(study, trial, fetched / name, base)
            if found is not None:
                members.folders[name], members.sources[name] = found
            else:
                log.info("trial #%d: its model is not on this host nor in a store", trial.number)
        if len(members.folders) == top:
            break
    return members


def _fetch(
    study: Any, trial: Any, into: Path, base: str | None
) -> tuple[Path, dict[str, Any]] | None:
    from hpo.ensemble import weights_sha256
    from hpo.services import study_artifact_store
    from hpo.storage.artifacts import ArtifactStoreError, masked_artifact_url
    from hpo.trial.folders import folder_name, study_folder_name

    try:
        store = study_artifact_store(study, None)
        if store is None:
            return None
        slug, folder = study_folder_name(study.study_name), folder_name(trial)
        if store.fetch(slug, folder, "best-model", into) is None:
            return None
    except ArtifactStoreError as e:
        raise HPOError(f"trial #{trial.number}'s model not fetched from the store: {e}") from e
    if not (into / "config.json").is_file():
        return None
    _repoint_adapter(study, trial, into, base)
    source = {
        "trial": trial.number,
        "store": masked_artifact_url(store.uri(slug, folder, "best-model")),
        "sha256": weights_sha256(into),
    }
    return into, source


def _repoint_adapter(study: Any, trial: Any, folder: Path, base: str | None) -> None:
    """A fetched LoRA adapter names the base model by the path of the host that trained it:
    point it at the base as this host finds it (`base`, the config's; the trial's record,
    resolved here, without one or when the trial searched the model), which must be there. A
    whole model is left as it is."""
    from hpo.config.paths import looks_local
    from hpo.study.join import trial_adapter
    from hpo.trainer.errors import ModelError
    from hpo.trainer.model import resolve_location
    from hpo.trainer.peft_adapters import is_adapter_folder, point_at_base

    if not is_adapter_folder(folder):
        return
    if base is None or "model.name_or_path" in trial.params:  # the trial's own base
        recorded = trial_adapter(study.user_attrs, trial.user_attrs) or {}
        base = recorded.get("base_model")
    try:
        location = resolve_location(base) if isinstance(base, str) and base else None
    except ModelError as e:
        raise HPOError(f"trial #{trial.number}'s LoRA adapter: {e}") from e
    location = point_at_base(folder, location)
    if looks_local(location) and not (Path(location).expanduser() / "config.json").is_file():
        raise HPOError(
            f"trial #{trial.number} is a LoRA adapter on the base model {location}, which is "
            "not on this host; give --config with model.name_or_path where this host has it"
        )


# -- the data ------------------------------------------------------------------------------------


def data_of_config(path: str) -> DataFiles:
    from hpo.config.loader import load_config

    return _data_of(load_config(path))


def _data_of(config: Any) -> DataFiles:
    data = config.data
    test = getattr(data, "test_file", None)
    return DataFiles(
        config.task,
        Path(data.eval_file),
        Path(test) if test else None,
        data.label_column,
        data.label_separator or ",",
    )


def data_of_setup(
    setup: dict[str, Any], study: str, attrs: dict[str, Any] | None = None
) -> DataFiles:
    """The data the study recorded: its evaluation file, and its test file (TEST_FILE_ATTR, not
    part of the setup a worker must match) when that file is still there, unchanged."""
    entry = setup.get("data.eval_file")
    if not isinstance(entry, dict) or not entry.get("path"):
        raise HPOError(
            f"study {study!r} recorded no evaluation file; give --config, the config it ran with"
        )
    test, note = recorded_test_file(attrs or {})
    return DataFiles(
        str(setup.get("task") or "sequence_classification"),
        Path(entry["path"]),
        test,
        str(setup.get("data.label_column") or "label"),
        str(setup.get("data.label_separator") or ","),
        note,
    )


def recorded_test_file(attrs: dict[str, Any]) -> tuple[Path | None, str | None]:
    """The study's recorded test file when it is there with the sha256 recorded; else None and
    why not ("the study's test file X changed" / "is missing" / is not a file members read)."""
    from hpo.study.setup_record import TEST_FILE_ATTR
    from hpo.trainer.digests import content_sha256

    entry = attrs.get(TEST_FILE_ATTR)
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return None, None
    path = Path(entry["path"])
    if not path.exists():
        return None, f"the study's test file {path} is missing"
    if not path.is_file() or path.suffix.lower() not in (".csv", ".jsonl"):
        return None, (
            f"the study's test file {path} is not a .csv or .jsonl file, which the members "
            "predict; give one with --test-file"
        )
    if content_sha256(path) != entry.get("sha256"):
        return None, f"the study's test file {path} changed since the study recorded it"
    return path, None
