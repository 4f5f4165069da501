"""What hpo tells of a study, for the command line (hpo.commands) and the Python API (hpo.api)
alike: the study database opened to read, the study found, its best trial, its status, its best
model downloaded, its report written. Each returns data (or the file written, and a line to say
of it); the callers print.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from hpo.errors import HPOError
from hpo.study.join import loader_text, study_task, trial_adapter
from hpo.study.names import quoted_study_name

if TYPE_CHECKING:
    from hpo.storage.artifacts import ArtifactStore
    from hpo.storage.url import StorageURL

ARTIFACT_STORE_ATTR = "artifact_store"  # the study's store, as its workers resolved it

EMPTY_STUDY_NAME = "--study: the study name is empty; `hpo studies` lists the names"
T = TypeVar("T")


class Reader(Protocol):
    """Runs `call`, a read of the study database named `what` in messages: at once, or again
    with fresh connections while the database drops out (StudyStorage.read)."""

    def __call__(self, what: str, call: Callable[[], T]) -> T: ...


def at_once(what: str, call: Callable[[], T]) -> T:
    """A Reader that retries nothing: an error is the caller's (the Python API)."""
    return call()


def open_storage_to_read(
    given: str | None,
    read_only: bool = True,
    flag: str = "--storage",
    patience_s: float | None = None,
) -> tuple[Any, StorageURL]:
    """The study database at `given` (else $HPO_STORAGE, else ./hpo.db), which must exist:
    looking never creates a database (a typo in the URL), nor with `read_only` a table or a
    lock file (a read-only folder). `flag`: how messages name `given`. `patience_s`: once
    reached, how long the opening rides out a database that drops out."""
    from hpo.storage import open_storage, resolve_storage_url

    storage_url = resolve_storage_url(given, None, flag)
    opened = open_storage(storage_url, patience_s, read_only=read_only, must_exist=True)
    return opened, storage_url


def load_existing_study(
    storage: Any, name: str, masked_url: str, empty: str = EMPTY_STUDY_NAME
) -> Any:
    """The study named `name`; one line when there is none. No checked_study_name: a study that
    plain Optuna made may have any name `hpo studies` lists (a tab, 600 characters, spaces
    only), and looking at it creates nothing."""
    import optuna

    if name == "":
        raise HPOError(empty)
    # As typed first (a study plain Optuna named in another Unicode form), then in NFC, the
    # form hpo names its studies in: `café` typed either way finds the study hpo created.
    for spelling in dict.fromkeys([name, unicodedata.normalize("NFC", name)]):
        with contextlib.suppress(KeyError):
            return optuna.load_study(study_name=spelling, storage=storage)
    raise HPOError(f"no study {quoted_study_name(name)} in {masked_url}; see `hpo studies`")


def study_gone(error: KeyError, name: str, masked_url: str) -> HPOError:
    """The error to raise for `error`, a KeyError while reading study `name`: Optuna's word
    for a row that has gone is one line; any other KeyError is raised as it is."""
    if "Record does not exist" not in str(error):
        raise error
    return HPOError(
        f"study {name!r} is no longer in {masked_url}: deleted while hpo read it; see `hpo studies`"
    )


def best_of(study: Any, storage: Any) -> list[dict[str, Any]]:
    """The best trial (the Pareto front's, with several objectives); one line when no trial has
    completed."""
    from hpo.reports import status as report

    best = report.best_trials(study, storage=storage)
    if not best:
        raise HPOError(f"study {study.study_name!r} has no completed trial yet")
    return best


@dataclass(frozen=True)
class Best:
    """What `hpo best` tells of a study: its best trial (with several objectives, the trials of
    its Pareto front), its latest retrain's winner (None without one) and its objectives."""

    trials: list[dict[str, Any]]
    retrained: dict[str, Any] | None
    objectives: int


def best(study: Any, storage: Any) -> Best:
    """The study's best trials and latest retrain; one line when no trial has completed."""
    from hpo.study.retrain import recorded_outcome

    return Best(best_of(study, storage), recorded_outcome(study.user_attrs), len(study.directions))


def status(
    study: Any, storage: Any, artifact_store: str | None = None, *, with_store: bool = True
) -> dict[str, Any]:
    """What `hpo status --json` prints: hpo.reports.status's summary and, `with_store` and when
    the study has an artifact store (`artifact_store`: as study_artifact_store takes it), what
    it holds there."""
    from hpo.reports import status as report

    summary = report.status(study, storage=storage)
    store = artifact_summary(study, artifact_store) if with_store else None
    if store is not None:
        summary["artifact_store"] = store
    return summary


def study_artifact_store(study: Any, given: str | None) -> ArtifactStore | None:
    """The study's artifact store (`given`: --artifact-store, else $HPO_ARTIFACT_STORE, else
    its workers' record), or None."""
    from hpo.storage.artifacts import ArtifactStore, resolve_artifact_url

    recorded = study.user_attrs.get(ARTIFACT_STORE_ATTR)
    url = resolve_artifact_url(given, None, recorded)
    return None if url is None else ArtifactStore(url.url)


def artifact_summary(study: Any, given: str | None) -> dict[str, Any] | None:
    """What the study holds in its store (`given`: as study_artifact_store takes it): URL, bytes
    and trial folders; an unreachable store is said, not fatal (status is for looking), unless
    it was `given`."""
    from hpo.storage.artifacts import ArtifactStoreError
    from hpo.trial.folders import study_folder_name

    try:
        store = study_artifact_store(study, given)
        if store is None:
            return None
        slug = study_folder_name(study.study_name)
        return {
            "url": store.url,
            "size_bytes": store.size(slug),
            "trial_folders": len(store.folders(slug)),
        }
    except ArtifactStoreError as e:  # e.g. the workers' shared mount is not mounted here
        if given is not None:
            raise
        return {"url": study.user_attrs.get(ARTIFACT_STORE_ATTR), "error": str(e)}


@dataclass(frozen=True)
class DownloadNames:
    """How the user wrote the download's options, for its messages: the CLI's flags, or the
    arguments of hpo.Study.download."""

    folder: str = "--download"
    merge: str = "--merge"
    example: str = "--download ./best-model"


API_DOWNLOAD = DownloadNames("download folder", "merge=True", 'download("best-model")')


def download_best(
    study: Any,
    best: list[dict],
    store: ArtifactStore | None,
    download: str,
    merge: bool,
    names: DownloadNames = DownloadNames(),
) -> tuple[Path, str]:
    """`hpo best --download DIR`: the best trial's model from the store into `download` (written
    beside it, then renamed: never half a model), each file checked against its sha256; with
    `merge`, a LoRA adapter merged into its base model. Returns the folder and what to say.
    `names`: how the messages name the options."""
    from hpo.storage.artifacts import ArtifactStoreError
    from hpo.trial.folders import study_folder_name

    entrypoint = best[0]["user_attrs"].get("entrypoint") if best else None
    if entrypoint:
        raise HPOError(
            f"trial #{best[0]['number']} ran your training function ({entrypoint}), "
            "which keeps its own model: hpo has none to download"
        )
    if store is None:
        raise HPOError(
            f"study {study.study_name!r} has no artifact store; its best model is on "
            "the host that trained it (hpo best names the folder)"
        )
    out = Path(download)
    if not download.strip() or out.resolve() == Path.cwd() or out.name in ("", ".", ".."):
        raise HPOError(
            f"{names.folder} {download!r}: name a new (or empty) folder for the "
            f"model, e.g. {names.example}"
        )
    if out.is_symlink():  # a link to an empty folder: that folder; a link to nothing: refused
        if not out.is_dir():
            raise HPOError(f"{names.folder} {out}: a link to nothing; name a new folder")
        out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HPOError(f"{names.folder} {out}: exists and is not an empty folder; name a new one")
    folder = f"trial-{int(best[0]['user_attrs'].get('first_attempt', best[0]['number']))}"
    aside = out.parent / f".{out.name}.{os.getpid()}.download"
    merged = aside.with_suffix(".merged")
    number = best[0]["number"]
    note = ""
    try:
        manifest = store.fetch(study_folder_name(study.study_name), folder, "best-model", aside)
        if manifest is not None:
            adapter = trial_adapter(study.user_attrs, best[0]["user_attrs"])
            note = _finish_adapter(study, adapter, aside, merged if merge else None, out, names)
            if out.is_dir():
                out.rmdir()
            (merged if merge else aside).rename(out)
    except ArtifactStoreError as e:
        raise HPOError(f"best model of trial #{number} not downloaded: {e}") from e
    except OSError as e:
        # The folder cannot be written, or its name was taken meanwhile: the message names the
        # folder asked for, and the partial download beside it is removed.
        raise HPOError(f"{names.folder} {out}: cannot write there ({e.strerror or e})") from e
    finally:
        for partial in (aside, merged):  # what was not renamed into `out`
            shutil.rmtree(partial, ignore_errors=True)
    if manifest is None:
        error = best[0]["user_attrs"].get("checkpoint_error")
        why = f" ({error})" if error else ""
        raise HPOError(f"trial #{number} has no best model in {store.url}{why}")
    size_mb = manifest.size / 1e6
    said = f"hpo: best model of trial #{number} ({size_mb:.1f} MB, sha256 checked) in {out}"
    return out, f"{said}{note}"


def _finish_adapter(
    study: Any,
    adapter: dict | None,
    folder: Path,
    merged: Path | None,
    out: Path,
    names: DownloadNames,
) -> str:
    """A downloaded LoRA adapter made loadable here: it names its base model as this host finds
    it; with `merged`, merged into that base as a plain model there. Returns what to say of
    `out`, where it goes ("" for a plain model)."""
    from hpo.trainer.model import resolve_location
    from hpo.trainer.peft_adapters import is_adapter_folder, merge_adapter, point_at_base

    if not is_adapter_folder(folder):
        if merged is not None:
            raise HPOError(
                f"{names.merge}: the best trial fine-tuned every weight (no LoRA "
                f"adapter), so its model is plain already; leave {names.merge} "
                "out"
            )
        return ""
    recorded = adapter.get("base_model") if adapter is not None else None
    base = point_at_base(folder, resolve_location(recorded) if recorded else None)
    task = study_task(study.user_attrs)
    if merged is None:
        return f"; {loader_text(task, base, str(out))}"
    merge_adapter(folder, base, task, merged)
    return f"; the LoRA adapter merged into {base}: {loader_text(task, None)}"


def report_path(given: str | None, study_name: str, form: str, flag: str = "--out") -> Path:
    """Where `hpo report --out` writes: the file named, or the default name in the folder
    named (an existing folder, or any name ending in a slash, which must be one)."""
    from hpo.trial.folders import study_folder_name

    default = Path(f"hpo-report-{study_folder_name(study_name)}.{form}")
    if given is None:
        return default
    if not given.strip():
        raise HPOError(f"{flag} is empty; name a file, or a folder to write it in")
    out = Path(given)
    if out.is_dir():
        return out / default
    if given.endswith(("/", os.sep)):
        raise HPOError(f"{flag} {given}: no such folder; create it first, or name a file")
    if not out.parent.is_dir():
        raise HPOError(f"{flag} {given}: no such folder {str(out.parent)!r}; create it first")
    return out


def report_text(study: Any, storage: Any, form: str) -> str:
    """The study's report (`form`: html, a whole page, or md) as text."""
    from hpo.reports import document as study_report

    if form == "md":
        return study_report.markdown(study, storage)
    return study_report.html_page(study, storage)


def write_report(
    study: Any,
    storage: Any,
    form: str,
    given: str | None,
    flag: str = "--out",
    read: Reader = at_once,
) -> Path:
    """The report (`form`: html or md) to `given` (see report_path), written aside, then
    renamed: never half a file. Returns the file written. `flag`: how messages name `given`;
    `read`: how the study is read (see Reader)."""
    import tempfile

    from hpo.reports import document as study_report

    out = report_path(given, study.study_name, form, flag)
    if out.exists() and not out.is_file():  # a device, a pipe: never replaced by a file
        raise HPOError(f"{flag} {out}: not a regular file; name a file to write")
    if out.is_file() and not study_report.is_report(out):  # a study's database, the data
        raise HPOError(
            f"{flag} {out}: exists and is not a report hpo wrote; name a new file, "
            "or move that one away first"
        )
    text = read("the report", lambda: report_text(study, storage, form))
    try:
        handle, aside = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise HPOError(f"{flag} {out}: cannot write there ({e.strerror or e})") from e
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(aside, 0o666 & ~umask)  # as any new file, not mkstemp's owner-only mode
        os.replace(aside, out)
    except OSError as e:
        Path(aside).unlink(missing_ok=True)
        raise HPOError(f"{flag} {out}: cannot write it ({e.strerror or e})") from e
    return out
