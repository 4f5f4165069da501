"""hpo copy: a study moved to another database (a laptop's SQLite file to the team's PostgreSQL
and back) with hpo's own records, whole or not at all; the mechanics are storage.study_copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import signal
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from hpo.errors import HPOError
from hpo.logs import set_optuna_verbosity
from hpo.reports.text import emit
from hpo.stopping import Interrupted
from hpo.study.names import check_no_lookalike, checked_study_name, quoted_study_name

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
SHOWN_NAMES = 10  # an unknown study's message lists at most this many of the source's


@dataclasses.dataclass(frozen=True)
class CopyRequest:
    """`hpo copy --study S --from URL --to URL`: each option as given."""

    study: str
    source: str
    """--from: the database URL that holds the study."""
    target: str
    """--to: the database URL to copy it into (an SQLite file is created if need be)."""
    to_study: str | None = None
    """The copy's name; None: the study's own."""
    allow_running: bool = False
    """Copy a study whose trials are running, as it stands at the read."""


@dataclasses.dataclass(frozen=True)
class CopyOutcome:
    name: str
    trials: int
    states: dict[str, int]
    batch_sizes: int
    target: str  # the target's URL, password masked
    secret: bool  # whether the URL holds a password (the masked one cannot be pasted)


def copy_command(request: CopyRequest) -> int:
    # Optuna's INFO line names the temporary study it creates: hpo says what it copied.
    set_optuna_verbosity(max(logging.getLogger().level, logging.WARNING))
    try:
        outcome = copy_study(request)
    except KeyboardInterrupt as e:
        # Not the exit code 0 a stopped worker gives for SIGTERM: `hpo copy ... && rm old.db`
        # must not go on when nothing was copied.
        name = getattr(e, "signal_name", "SIGINT")
        print(f"hpo: stopped by {name}: nothing was copied", file=sys.stderr)
        return 128 + signal.Signals[name].value
    states = ", ".join(f"{n} {state}" for state, n in sorted(outcome.states.items()))
    emit(
        f"hpo: copied study {quoted_study_name(outcome.name)} to {outcome.target}: "
        f"{outcome.trials} trials ({states or 'none'}), {outcome.batch_sizes} batch-size "
        f"records; its workers join it with hpo run --study {shlex.quote(outcome.name)} "
        f"--storage {'URL (the --to URL)' if outcome.secret else shlex.quote(outcome.target)}"
    )
    return 0


def copy_study(request: CopyRequest) -> CopyOutcome:
    """Copy the study, refusing (HPOError, StorageError) before anything is written when the
    source, the name or the target is wrong; see storage.study_copy for how it is written."""
    from hpo import services
    from hpo.storage import open_storage, resolve_storage_url
    from hpo.storage.study_copy import read_snapshot, same_database
    from hpo.storage.tables import ensure_tables
    from hpo.storage.url import EXAMPLE_URLS

    if request.study == "":
        raise HPOError("--study is empty; give the name of the study to copy (see hpo studies)")
    for flag, url in (("--from", request.source), ("--to", request.target)):
        if not url.strip():
            raise HPOError(f"{flag} is empty; give a database URL, e.g. {EXAMPLE_URLS}")
    source, source_url = services.open_storage_to_read(request.source, flag="--from")
    target_url = resolve_storage_url(request.target, None, "--to")
    with _database_errors(f"reading {source_url.masked}"):
        study_id = _find_study(source, request.study, source_url.masked)
        name = source.get_study_name_from_id(study_id)
        given = request.to_study
        final = name if given is None else checked_study_name(given, "--to-study")
        same = same_database(source_url, target_url)
        if same and final == name:
            raise HPOError(
                "--from and --to are the same database: a study cannot be copied onto itself; "
                "give --to-study NAME to copy it beside itself under another name"
            )
        # Read through Optuna's own storage, not hpo's trial cache: each trial as Optuna reads
        # it, its parameters in their order.
        snapshot = read_snapshot(source.rdb, source.engine, study_id)
    if snapshot.running() and not request.allow_running:
        raise HPOError(_running_refusal(name, snapshot.running()))
    target = open_storage(target_url)
    rows = [] if same else snapshot.batch_sizes  # one table already: nothing to bring over
    with _termination_raises(), _database_errors(f"the copy into {target_url.masked}"):
        _check_name_free(target, final, target_url.masked)
        ensure_tables(target.engine)  # a layout of another hpo's is refused before a write
        _write(source.rdb, study_id, snapshot, target, final, rows, request.allow_running)
    if snapshot.running():
        log.warning(_running_note(snapshot.running()))
    masked = target_url.masked
    secret = masked != target_url.url
    return CopyOutcome(final, len(snapshot.trials), snapshot.states(), len(rows), masked, secret)


def _write(
    source: Any,
    study_id: int,
    snapshot: Any,
    target: Any,
    final: str,
    rows: list[dict[str, Any]],
    allow_running: bool,
) -> None:
    """Written under a temporary name, checked, then published under `final`."""
    from hpo.storage.study_copy import publish, temporary_name, trial_fingerprint, write_copy

    def unchanged() -> None:
        # A worker that started or ended a trial while the study was read or written: the
        # copy would miss it. Compared once the copy is written, so that nothing escapes.
        if allow_running:
            return
        now = trial_fingerprint(source.get_all_trials(study_id, deepcopy=False))
        if now != trial_fingerprint(snapshot.trials):
            raise HPOError(
                f"study {quoted_study_name(snapshot.name)} changed while it was copied: a worker "
                "is running it. Nothing was copied; stop its workers and copy again, or pass "
                "--allow-running to copy it as it stands"
            )

    temporary = temporary_name()
    progress = _progress(len(snapshot.trials))
    copy_id = write_copy(target, snapshot, temporary, progress, last_check=unchanged)
    publish(target, target.engine, copy_id, temporary, final, rows)


def _progress(total: int) -> Callable[[int], None]:
    """A line every PROGRESS_EVERY_S while trials are written (a few thousand take minutes:
    Optuna writes one trial per transaction)."""
    last = time.monotonic()
    done = 0

    def copied(number: int) -> None:
        nonlocal last, done
        done += 1
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("copying: %d of %d trials written", done, total)

    return copied


def _find_study(storage: Any, name: str, masked_url: str) -> int:
    """The id of study `name` (as typed, else in NFC); one line listing the source's studies
    when there is none."""
    for spelling in dict.fromkeys([name, unicodedata.normalize("NFC", name)]):
        with contextlib.suppress(KeyError):
            return int(storage.get_study_id_from_name(spelling))
    names = sorted(s.study_name for s in storage.get_all_studies())
    if not names:
        held = "it holds no study"
    else:
        shown = ", ".join(quoted_study_name(n) for n in names[:SHOWN_NAMES])
        more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
        held = f"it holds {shown}{more}"
    raise HPOError(f"no study {quoted_study_name(name)} in {masked_url} (--from); {held}")


def _check_name_free(target: Any, name: str, masked_url: str) -> None:
    """The target holds no study of that name (hpo copy never merges into or replaces one),
    nor one that reads alike; a note on copies that were stopped before their end."""
    from hpo.storage.study_copy import unfinished_copies

    names = [s.study_name for s in target.get_all_studies()]
    if name in names:
        raise HPOError(
            f"{masked_url} (--to) already holds a study {quoted_study_name(name)}; hpo copy "
            "never merges into or replaces a study: give --to-study NEW_NAME, or delete that "
            "one first"
        )
    check_no_lookalike(name, names)
    leftovers = unfinished_copies(names)
    if leftovers:
        log.warning(
            "%s holds %d unfinished copies (%s...) from copies that were killed, or are still "
            "under way: no worker uses them; delete them with optuna delete-study "
            "--study-name NAME --storage URL",
            masked_url,
            len(leftovers),
            leftovers[0],
        )


def _running_trials(running: list[int]) -> str:
    """`2 RUNNING trials (#3, #7)`."""
    numbers = ", ".join(f"#{n}" for n in running[:5]) + (", ..." if len(running) > 5 else "")
    return f"{len(running)} RUNNING trial{'s' if len(running) != 1 else ''} ({numbers})"


def _running_refusal(name: str, running: list[int]) -> str:
    return (
        f"study {quoted_study_name(name)} has {_running_trials(running)}: its "
        "workers may still be writing to it, and the copy would miss what they write. Stop "
        "its workers (hpo status shows none running) and copy again, or pass --allow-running "
        "to copy it as it stands"
    )


def _running_note(running: list[int]) -> str:
    return (
        f"copied {_running_trials(running)} as RUNNING: no worker of the copy beats for "
        "them, so the first worker that joins the copy fails them as stale and "
        "queues them again with the same parameters (what their workers go on writing goes "
        "to the source only)"
    )


@contextlib.contextmanager
def _database_errors(what: str) -> Iterator[None]:
    """A database error as one line (an unfinished copy is deleted by then)."""
    import optuna
    import sqlalchemy as sa

    from hpo.storage.errors import StorageError
    from hpo.storage.url import mask_text

    try:
        yield
    except (sa.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        reason = mask_text(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise StorageError(
            f"{what} failed ({reason[:300]}); nothing was copied: run it again once the "
            "database is reachable"
        ) from e


@contextlib.contextmanager
def _termination_raises() -> Iterator[None]:
    """SIGTERM stops the copy as Ctrl-C does, so that the unfinished copy is deleted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
