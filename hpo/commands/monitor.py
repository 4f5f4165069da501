"""The read commands (studies, status, best, report, dashboard): a study looked at, never changed,
from any host that reaches its database.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import sys
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from hpo import live
from hpo.errors import HPOError
from hpo.logs import set_optuna_verbosity
from hpo.stopping import Interrupted

if TYPE_CHECKING:
    from storage.artifacts import ArtifactStore
    from storage.url import StorageURL
from hpo.commands.run import (
    ARTIFACT_STORE_ATTR,
)
from hpo.reports.text import (
    artifact_line,
    best_text,
    emit,
    retrain_text,
    strict_json,
    studies_table,
)
from hpo.study.join import loader_text, study_task, trial_adapter
from hpo.study.names import quoted_study_name

EMPTY_STUDY_NAME = "--study: the study name is empty; `hpo studies` lists the names"
T = TypeVar("T")


class Reader(Protocol):
    """Runs `call`, a read of the study database named `what` in messages: at once, or again
    with fresh connections while the database drops out (StudyStorage.read)."""

    def __call__(self, what: str, call: Callable[[], T]) -> T: ...


def at_once(what: str, call: Callable[[], T]) -> T:
    """A Reader that retries nothing: an error is the caller's (the Python API)."""
    return call()


def _serve(app: Callable, host: str, port: int, banner: str) -> None:
    """A WSGI app (optuna-dashboard's) on a server bound here, until Ctrl-C or SIGTERM: a port
    in use or a host that is not this machine's is one line, not a traceback from inside."""
    import signal
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(WSGIServer):
        # wsgiref listens on IPv4 unless told; an address such as ::1 needs IPv6.
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Handler(WSGIRequestHandler):
        timeout = 10  # seconds: a client that stalls mid-request cannot hold up a stop

    try:
        server = make_server(host, port, app, server_class=Server, handler_class=Handler)
    except OSError as e:  # in use, not an address of this host, unknown host name
        fix = (
            "another program listens there: choose another --port"
            if e.errno == errno.EADDRINUSE
            else "--host must name this machine: 127.0.0.1, or 0.0.0.0 for every interface"
        )
        raise HPOError(
            f"dashboard: cannot listen on {host}:{port} ({e.strerror or e}); {fix}"
        ) from e
    # A stop shuts the server down once the request in hand is answered. Raising from the
    # signal handler would be swallowed by wsgiref's error handler when the signal lands inside
    # a request, and the server would go on serving after its SIGTERM. A second stop is at once.
    stops: list[str] = []

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stops:
            raise Interrupted(name)
        stops.append(name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(banner, flush=True)
        with server:
            server.serve_forever(poll_interval=0.2)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    if stops:
        raise Interrupted(stops[0])


def monitor_command(args: argparse.Namespace) -> int:
    from hpo.reports import status as report

    set_optuna_verbosity(logging.getLogger().level)
    if getattr(args, "study", None) == "":
        raise HPOError(EMPTY_STUDY_NAME)
    # The dashboard may write notes, but only into an existing study database.
    patience_s = getattr(args, "database_patience", None)
    storage, storage_url = open_storage_to_read(
        args.storage, args.command != "dashboard", patience_s=patience_s
    )
    if args.command == "dashboard":
        address = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 in a URL
        banner = f"hpo: dashboard for {storage_url.describe()} on http://{address}:{args.port}/"
        from optuna_dashboard import wsgi

        _serve(wsgi(storage), args.host, args.port, banner)
        return 0
    # Each read is retried whole while the database drops out, for up to the outage window.
    read: Reader = partial(storage.read, patience_s=patience_s)
    if args.command == "studies":
        rows = read("the list of studies", lambda: report.studies(storage))
        emit(strict_json(rows, indent=2) if args.json else studies_table(rows))
        return 0
    masked = storage_url.masked
    study = read("the study", lambda: load_existing_study(storage, args.study, masked))
    try:
        return _look_at(study, storage, args, read)
    except KeyError as e:
        raise study_gone(e, args.study, storage_url.masked) from e


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
    from storage import open_storage, resolve_storage_url

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


def _look_at(study: Any, storage: Any, args: argparse.Namespace, read: Reader) -> int:
    """`hpo report`, `best` and `status` of a study that exists; what they print is read whole
    (`read`) before a line of it is printed."""
    from hpo.reports import status as report
    from hpo.study import retrain

    if args.command == "report":
        from hpo.reports import document as study_report

        if args.out is None and args.format == "md":
            emit(read("the report", lambda: study_report.markdown(study, storage)), end="")
            return 0
        out = write_report(study, storage, args.format, args.out, read=read)
        emit(f"hpo: report of study {study.study_name!r} written to {out}")
        return 0
    if args.command == "best":
        best, retrained, objectives = read(
            "the best trial",
            lambda: (
                best_of(study, storage),
                retrain.recorded_outcome(study.user_attrs),
                len(study.directions),
            ),
        )
        if args.download is not None:
            # The download reads the study's attributes too; a retry fetches the model again
            # (what a failed try fetched is removed: see download_best).
            emit(
                read(
                    "the best model",
                    lambda: download_best(
                        study,
                        best,
                        study_artifact_store(study, args.artifact_store),
                        args.download,
                        args.merge,
                    ),
                )[1]
            )
            return 0
        if args.merge:
            raise HPOError("--merge goes with --download DIR: it writes the merged model there")
        if args.json:  # several objectives: the Pareto front, a list
            shown: Any = best if objectives > 1 else best[0]
            if retrained is not None:
                several = isinstance(shown, list)
                shown = {"pareto_front": shown} if several else shown
                shown = {**shown, "retrain": retrained}
            emit(strict_json(shown, indent=2))
        else:
            emit("\n".join(best_text(trial) for trial in best))
            if retrained is not None:
                emit(retrain_text(retrained))
        return 0
    if args.watch:
        return _watch(study, storage, args.json, args.interval, read)
    summary, store = read(
        "the status",
        lambda: (
            report.status(study, storage=storage),
            artifact_summary(study, args),
        ),
    )
    if store is not None:
        summary["artifact_store"] = store
    lines = report.status_lines(summary) + ([artifact_line(store)] if store else [])
    emit(strict_json(summary, indent=2) if args.json else "\n".join(lines))
    return 0


def study_artifact_store(study: Any, given: str | None) -> ArtifactStore | None:
    """The study's artifact store (`given`: --artifact-store, else $HPO_ARTIFACT_STORE, else
    its workers' record), or None."""
    from storage.artifacts import ArtifactStore, resolve_artifact_url

    recorded = study.user_attrs.get(ARTIFACT_STORE_ATTR)
    url = resolve_artifact_url(given, None, recorded)
    return None if url is None else ArtifactStore(url.url)


def artifact_summary(study: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """What the study holds in its store: URL, bytes and trial folders; an unreachable store is
    said, not fatal (status is for looking)."""
    from hpo.trial.folders import study_folder_name
    from storage.artifacts import ArtifactStoreError

    try:
        store = study_artifact_store(study, args.artifact_store)
        if store is None:
            return None
        slug = study_folder_name(study.study_name)
        return {
            "url": store.url,
            "size_bytes": store.size(slug),
            "trial_folders": len(store.folders(slug)),
        }
    except ArtifactStoreError as e:  # e.g. the workers' shared mount is not mounted here
        if args.artifact_store is not None:
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
    from hpo.trial.folders import study_folder_name
    from storage.artifacts import ArtifactStoreError

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
    from trainer.model import resolve_location
    from trainer.peft_adapters import is_adapter_folder, merge_adapter, point_at_base

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


def _watch(study: Any, storage: Any, as_json: bool, interval: float, read: Reader) -> int:
    """`hpo status --watch`: the status again every `interval` seconds (the screen redrawn on a
    terminal, one block per refresh otherwise) until the study has ended: at once when its
    budget is spent, else (nothing runs, but a worker may be between two trials) at two
    refreshes in a row; Ctrl-C ends it at once. A refresh rides out a database that drops out
    (`read`): the outage is said once, and the watch goes on when the database is back."""
    import datetime as dt

    from hpo.reports import status as report

    terminal = sys.stdout.isatty()
    ended_polls = 0
    stalled_since = None
    first = True
    while True:
        summary = read("the status", lambda: report.status(study, storage=storage))
        text = strict_json(summary) if as_json else "\n".join(report.status_lines(summary))
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = text if as_json else f"[{stamp}] {text}"
        if terminal:  # redrawn in place, within the screen as it is sized now
            columns, rows = live.terminal_size(sys.stdout)
            emit(live.screen_frame(text.splitlines(), columns, rows, first), end="")
        else:
            emit(text)
        first = False
        ended_polls = ended_polls + 1 if report.ended(summary) else 0
        if report.ended_for_good(summary) or ended_polls >= 2:
            break
        stalled_since = (stalled_since or time.monotonic()) if report.stalled(summary) else None
        # No live worker for longer than a worker takes between two trials: nothing will move.
        patience = max(3 * interval, summary.get("grace_period_s") or 60)
        if stalled_since is not None and time.monotonic() - stalled_since >= patience:
            print(
                f"hpo: study {study.study_name!r} has stopped moving: no trial runs with a live "
                "worker; start a worker (hpo run) to go on",
                file=sys.stderr,
            )
            return 1
        time.sleep(interval)
    spent = f": {report.budget_advice(summary)}" if report.waiting_for_budget(summary) else ""
    print(f"hpo: study {study.study_name!r} has ended{spent}", file=sys.stderr)
    return 0


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
    text = read(
        "the report",
        lambda: (
            study_report.markdown(study, storage)
            if form == "md"
            else study_report.html_page(study, storage)
        ),
    )
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
