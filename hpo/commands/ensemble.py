"""`hpo ensemble` and `Study.ensemble`: the study's top models (or hpo retrain's outputs) combined.
Each member predicts the evaluation split (and the test split, data.test_file) once: the arrays
are cached on disk by the member's weights and the data file's sha256. hpo.ensemble scores every
candidate honestly and fits the stack; the folder saved holds the members' copies, the
meta-learner (skops) and a model card. A stack no better than the best member (out of fold on the
evaluation split: never chosen on the test split) saves that member, a plain model folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.commands.ensemble_members import DataFiles, labels_by_id, members_and_data
from hpo.errors import DataError, HPOError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("hpo")

CARD_JSON = "ensemble_card.json"
CARD_MD = "ENSEMBLE.md"
DEFAULT_TOP = 5  # as --top


@dataclass(frozen=True)
class EnsembleRequest:
    """`hpo ensemble --study S --out DIR` and its options."""

    out: str
    study: str | None = None
    storage: str | None = None
    config: str | None = None
    top: int = DEFAULT_TOP
    from_retrain: tuple[str, ...] = ()
    learners: tuple[str, ...] = ()
    features: str = "predictions"
    pca: int | None = None
    soup: str = "none"
    device: str = "auto"
    batch_size: int = 32
    quiet: bool = False
    cache_dir: str | None = None
    test_file: str | None = None  # scores every candidate (default: the config's, the study's)


@dataclass
class Outcome:
    """What `ensemble_command` built: the report, the folder, the table printed."""

    report: Any
    folder: Path
    table: str
    saved: str  # "stacking" or "best_member"
    members: dict[str, Path] = field(default_factory=dict)


def ensemble_command(request: EnsembleRequest) -> int:
    outcome = build_ensemble(request)
    if not request.quiet:
        print(outcome.table)
    return 0


def _checked_out(request: EnsembleRequest) -> Path:
    out = Path(request.out)
    if out.exists():
        raise HPOError(f"--out {out} already exists; name a new folder")
    if not out.parent.is_dir():
        raise HPOError(f"--out {out}: no such folder {str(out.parent)!r}; create it first")
    if request.features not in ("predictions", "embedding"):
        raise HPOError(f"--features {request.features}: give predictions or embedding")
    if request.soup not in ("none", "uniform", "greedy"):
        raise HPOError(f"--soup {request.soup}: give uniform, greedy or none")
    from hpo.ensemble.errors import require_stacking

    require_stacking("hpo ensemble")  # before any member predicts: hpo[ensemble] installed
    return out


def build_ensemble(request: EnsembleRequest, study: Any = None) -> Outcome:
    """Members, their cached predictions, the honest report, the folder written. `study`: the
    Optuna study already open (the Python API's), else --study in --storage is opened."""
    out = _checked_out(request)
    # Members from the store: a new folder of hpo's own (a name of the pid's, left by a killed
    # run whose pid came back, was fetched into and then removed).
    try:
        fetched = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".members", dir=out.parent))
    except OSError as e:
        raise HPOError(f"--out {out}: cannot write in {out.parent} ({e.strerror or e})") from e
    try:
        return _build(request, study, out, fetched)
    finally:
        shutil.rmtree(fetched, ignore_errors=True)


def _build(request: EnsembleRequest, study: Any, out: Path, fetched: Path) -> Outcome:
    from hpo.ensemble import FeatureSettings, ReportCache, check_stackable, evaluate_cached

    found, data = members_and_data(request, study, fetched)
    members = found.folders
    if len(members) < 2:
        raise HPOError(
            f"an ensemble needs at least 2 members, found {len(members)} model(s) on this host: "
            "a study keeps only its best trial's model unless study.keep_models says more; "
            "give hpo retrain's study (it keeps each configuration's best run), raise --top, "
            "or give --from-retrain folders"
        )
    if data.task == "token_classification":
        from hpo.commands.token_ensemble import token_ensemble

        said, saved = token_ensemble(
            members,
            data.evaluation,
            data.test,
            data.label_column,
            out,
            request.device,
            request.batch_size,
        )
        if data.test_note:
            said += f"\nscored on the evaluation split: {data.test_note}"
        return Outcome(None, out, said, saved, members)
    check_stackable(data.task)
    order = _label_order(next(iter(members.values())), data.task)
    evaluation, eval_rows = _split(members, data.evaluation, data, order, request)
    test, test_rows = (
        _split(members, data.test, data, order, request) if data.test else (None, None)
    )
    settings = FeatureSettings(
        kind="embedding" if request.features == "embedding" else "predictions",
        scale=request.pca is not None or request.features == "embedding",
        pca_components=request.pca,
    )
    report = evaluate_cached(
        data.task,
        evaluation,
        test,
        ReportCache.beside(_feature_cache(request)),
        learners=list(request.learners) or None,
        settings=settings,
    )
    if data.test_note:
        report.notes.append(f"scored by {report.folds}-fold CV: {data.test_note}")
    report.notes += _pca_notes(request.pca, evaluation.stack_features(list(members)))
    soup = _soup(request, members, data.task, report.metric, order, eval_rows, test_rows)
    saved = _save(out, report, members, soup, found.sources)
    return Outcome(report, out, table(report, saved, soup), saved, members)


def _pca_notes(pca: int | None, features: np.ndarray) -> list[str]:
    """PCA keeps at most as many components as the features have columns (and a fit rows):
    a larger --pca is said, not refused."""
    columns = features.shape[1]
    if pca is None or pca <= columns:
        return []
    return [f"--pca {pca}: the features have {columns} columns; {columns} components kept at most"]


def _soup(
    request: EnsembleRequest,
    members: dict[str, Path],
    task: str,
    metric: str,
    order: list[str],
    eval_rows: Any,
    test_rows: Any,
) -> Any:
    if request.soup == "none":
        return None
    from hpo.commands.soup import build_soup

    return build_soup(
        request.soup,
        members,
        task,
        metric,
        order,
        eval_rows,
        test_rows,
        request.device,
        request.batch_size,
    )


# -- predictions, cached ------------------------------------------------------------------------


def _label_order(folder: Path, task: str) -> list[str]:
    """The class (label) names in the first member's id order; members must share them."""
    return [] if task == "regression" else labels_by_id(folder)


def _split(
    members: dict[str, Path],
    path: Path,
    data: DataFiles,
    order: list[str],
    request: EnsembleRequest,
) -> Any:
    from hpo.commands.predict import input_rows
    from hpo.ensemble import Split
    from hpo.ensemble.cache import ordered_kind
    from hpo.ensemble.saving import features_sha256
    from hpo.trainer.digests import file_sha256

    if not path.is_file() or path.suffix.lower() not in (".csv", ".jsonl"):
        raise HPOError(f"{path}: the members predict a .csv or .jsonl file; none there")
    try:
        with input_rows(path) as (_, rows_iter):
            rows = list(rows_iter)
    except DataError as e:
        raise DataError(f"{path}: {e}") from e
    if not rows:
        raise HPOError(f"{path} has no rows; the members need rows with labels to be scored on")
    labels = _labels(rows, data, order, path)
    cache = _feature_cache(request)
    digest = file_sha256(path)
    kinds = ["predictions"] + (["embedding"] if request.features == "embedding" else [])
    found: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in kinds}
    for name, folder in members.items():
        for kind in kinds:

            def compute(folder: Path = folder, kind: str = kind) -> np.ndarray:
                return member_predictions(folder, rows, order, request, kind)

            # Probabilities are in `order`'s columns; embeddings have no labels.
            key = ordered_kind(kind, order if kind == "predictions" else [])
            found[kind][name] = cache.get_or_compute(features_sha256(folder), digest, key, compute)
    from hpo.commands.features import stacked_embeddings
    from hpo.commands.soup import Rows

    features = None
    if request.features == "embedding":
        features = stacked_embeddings(found["embedding"], list(members))
    return Split(found["predictions"], labels, features), Rows(rows, labels)


def _feature_cache(request: EnsembleRequest) -> Any:
    from hpo.ensemble import FeatureCache

    return FeatureCache(Path(request.cache_dir) if request.cache_dir else None)


def member_predictions(
    folder: Path,
    rows: Sequence[dict[str, Any]],
    order: list[str],
    request: EnsembleRequest,
    kind: str = "predictions",
) -> np.ndarray:
    """A member's outputs on `rows`: probabilities in `order`'s class order, or values; with
    `kind` "embedding", its mean-pooled last hidden states."""
    from hpo.commands.predict import answers_array, predict_rows
    from hpo.trainer.device import resolve_device
    from hpo.trainer.inference import Predictor

    predictor = Predictor(folder, resolve_device(request.device, "--device"), request.batch_size)
    check_member(folder, predictor, order)
    if kind == "embedding":
        from hpo.commands.features import member_embeddings

        return member_embeddings(predictor, rows)
    return answers_array(list(predict_rows(predictor, rows)), predictor.settings.task, order)


def check_member(folder: Path, predictor: Any, order: list[str]) -> None:
    """A member predicts the same classes (labels) as the first member, by name."""
    if sorted(predictor.labels) != sorted(order):
        raise HPOError(
            f"member {folder} predicts {', '.join(predictor.labels) or 'values'}, the first "
            f"member {', '.join(order) or 'values'}; members must share their classes"
        )


def _labels(rows: list[dict[str, Any]], data: DataFiles, order: list[str], path: Path) -> Any:
    import numpy as np

    column = data.label_column
    values = []
    for number, row in enumerate(rows, start=1):
        if column not in row:
            raise HPOError(f"{path}: row {number} has no label column {column!r}")
        values.append(row[column])
    if data.task == "regression":
        return np.asarray([_number(v, number, path) for number, v in enumerate(values, 1)])
    index = {name: i for i, name in enumerate(order)}
    if data.task == "multi_label_classification":
        hot = np.zeros((len(values), len(order)), dtype=np.int64)
        for r, value in enumerate(values):
            names = value if isinstance(value, list) else str(value).split(data.label_separator)
            for label in (n.strip() for n in names if str(n).strip()):
                hot[r, _label_id(index, label, path)] = 1
        return hot
    return np.asarray([_label_id(index, str(v), path) for v in values])


def _number(value: Any, row: int, path: Path) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise HPOError(f"{path}: row {row}'s label {value!r} is not a number") from e


def _label_id(index: dict[str, int], label: str, path: Path) -> int:
    if label not in index:
        raise HPOError(f"{path}: label {label!r} is none of the members' ({', '.join(index)})")
    return index[label]


# -- the folder and the table ---------------------------------------------------------------------


def _soup_wins(report: Any, soup: Any) -> bool:
    """The soup against what the report chose, both on the evaluation split (the soup's score
    there, the choice's out-of-fold score): like stacking's, this choice never reads the test
    split."""
    from hpo.ensemble.scoring import direction_of, is_better

    if soup is None or soup.evaluation_score is None:
        return False
    chosen = report.chosen_by.score_of(report.choice)
    return is_better(soup.evaluation_score, chosen, direction_of(report.task, report.metric))


def _saved_kind(report: Any, soup: Any) -> str:
    return "soup" if _soup_wins(report, soup) else str(report.choice)


def _save(
    out: Path,
    report: Any,
    members: dict[str, Path],
    soup: Any = None,
    sources: dict[str, dict[str, Any]] | None = None,
) -> str:
    from hpo.ensemble import save_ensemble
    from hpo.ensemble.saving import copy_member, rename_in

    saved = _saved_kind(report, soup)
    card = card_json(report, members, soup, sources, saved)
    text = card_markdown(report, soup, card["members"], saved)
    files = {CARD_JSON: json.dumps(card, indent=2) + "\n", CARD_MD: text}
    if saved == "soup":
        from hpo.commands.soup import save_soup

        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            folder = save_soup(soup, out, staging)
            for name, content in files.items():
                (folder / name).write_text(content, encoding="utf-8")
            rename_in(folder, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return "soup"
    if saved == "stacking":
        save_ensemble(out, report, members, copy_members=True, extra_files=files)
        return "stacking"
    # Not better than the best member: that member is the model, a plain folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        copy_member(members[report.best_member], staging / "model")
        for name, text in files.items():
            (staging / "model" / name).write_text(text, encoding="utf-8")
        rename_in(staging / "model", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return "best_member"


def card_json(
    report: Any,
    members: dict[str, Path],
    soup: Any = None,
    sources: dict[str, dict[str, Any]] | None = None,
    saved: str | None = None,
) -> dict[str, Any]:
    """`sources`: members fetched from the store, shown by their store reference (the folder
    they were fetched into is gone once the ensemble is built). `saved`: what the folder holds
    (default: the report's choice); its reported score and how it was chosen."""
    sources = sources or {}
    card = {
        "members": {name: sources.get(name, str(folder)) for name, folder in members.items()},
        **report.to_json(),
    }
    if soup is not None:
        card["soup"] = {
            "kind": soup.kind,
            "score": soup.score,
            "evaluation_score": soup.evaluation_score,
            "measured_on": soup.measured_on,
            "members": soup.kept,
            "note": soup.note,
        }
    saved = saved or report.choice
    score = _saved_score(report, saved, soup)
    card["saved"] = {"kind": saved, "score": score, "chosen": _chosen_text(report, saved, soup)}
    return card


def _saved_score(report: Any, saved: str, soup: Any = None) -> Any:
    """The reported score of what the folder holds (`saved`: "soup", or the report's choice)."""
    return soup.score if saved == "soup" else report.saved_score


def _chosen_text(report: Any, saved: str, soup: Any = None) -> str:
    """How what is saved was chosen, in one sentence (never on the test split)."""
    cv = report.chosen_by
    text = (
        f"by {cv.on}: stacking ({report.best_learner}) {cv.stacking:.4f}, the best member "
        f"({report.best_member}) {cv.best_member:.4f} (stacking must win by more than the "
        f"folds' standard error, {cv.standard_error:.4f})"
    )
    if saved != "soup":
        return f"chosen {text}"
    return (
        f"the {soup.kind} soup scored {soup.evaluation_score:.4f} on the evaluation split, "
        f"better than the {report.choice.replace('_', ' ')} chosen {text}"
    )


def _rows(report: Any, soup: Any = None) -> list[tuple[str, float]]:
    rows = [
        (f"best single member ({report.best_member})", report.best_member_score),
        ("soft voting", report.soft_voting_score),
        ("greedy selection", report.selection_score),
    ]
    rows += [(f"stacking: {name}", value) for name, value in report.stacking_scores.items()]
    if soup is not None and soup.score is not None:
        rows.append((f"{soup.kind} soup ({len(soup.kept)} members, one model)", soup.score))
    return rows


def _soup_measured(soup: Any) -> list[str]:
    if soup is None:
        return []
    if soup.score is None:
        return [soup.note or "soup: not built"]
    if soup.measured_on == "test_split":
        return [f"{soup.kind} soup: scored on the test split"]
    greedy = " (chosen there: optimistic)" if soup.kind == "greedy" else ""
    return [f"{soup.kind} soup: scored on the evaluation split{greedy}; no test_file given"]


def _saved_text(report: Any, saved: str, soup: Any) -> str:
    if saved == "soup":
        form = "a LoRA adapter on their base model" if soup.adapter else "a plain model folder"
        return f"the {soup.kind} soup of {len(soup.kept)} members, {form}"
    if saved == "stacking":
        return f"the stacked model ({report.best_learner})"
    return f"the best member ({report.best_member}), as a plain model folder"


def table(report: Any, saved: str, soup: Any = None) -> str:
    lines = [f"{'candidate':<44} {report.metric:>10}"]
    lines += [f"{name:<44} {value:>10.4f}" for name, value in _rows(report, soup)]
    measured = "test split" if report.measured_on == "test_split" else f"{report.folds}-fold CV"
    lines.append(f"measured: {measured} ({report.how_measured})")
    lines += _soup_measured(soup)
    lines += report.notes
    lines.append(f"saved: {_saved_text(report, saved, soup)}")
    if report.measured_on == "test_split" or saved == "soup":  # chosen on another split
        lines.append(f"  {_chosen_text(report, saved, soup)}")
    return "\n".join(lines)


def _source_text(source: Any) -> str:
    """A member's folder, or its store reference (card_json's "members" entry)."""
    if not isinstance(source, dict):
        return str(source or "")
    return f"trial #{source['trial']} in {source['store']} (weights sha256 {source['sha256'][:12]})"


def card_markdown(
    report: Any, soup: Any = None, sources: dict[str, Any] | None = None, saved: str | None = None
) -> str:
    """`sources`: each member's folder or store reference, as card_json gives them; `saved`:
    what the folder holds (default: the report's choice)."""
    sources = sources or {}
    saved = saved or report.choice
    score = _saved_score(report, saved, soup)
    lines = [
        "# Ensemble model card",
        "",
        f"Task: {report.task}. Metric: {report.metric}. Measured {report.how_measured}.",
        "",
        f"Saved: {_saved_text(report, saved, soup)}, {report.metric} {score:.4f}; "
        f"{_chosen_text(report, saved, soup)}.",
        "",
        "| member | score | from |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {value:.4f} | {_source_text(sources.get(name))} |"
        for name, value in report.member_scores.items()
    ]
    lines += ["", "| candidate | score |", "|---|---|"]
    lines += [f"| {name} | {value:.4f} |" for name, value in _rows(report, soup)]
    lines += ["", *_soup_measured(soup), *report.notes, ""]
    return "\n".join(lines)
