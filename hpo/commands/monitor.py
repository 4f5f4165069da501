"""The read commands (studies, status, best, report, dashboard): a study looked at, never changed,
from any host that reaches its database.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from hpo import live, services
from hpo.config.notify import NotifyConfig
from hpo.errors import HPOError
from hpo.logs import set_optuna_verbosity
from hpo.reports.text import (
    artifact_line,
    best_text,
    emit,
    retrain_text,
    strict_json,
    studies_table,
)
from hpo.services import EMPTY_STUDY_NAME, Reader
from hpo.stopping import Interrupted


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
    storage, storage_url = services.open_storage_to_read(
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
    study = read("the study", lambda: services.load_existing_study(storage, args.study, masked))
    try:
        return _look_at(study, storage, args, read)
    except KeyError as e:
        raise services.study_gone(e, args.study, storage_url.masked) from e


def _look_at(study: Any, storage: Any, args: argparse.Namespace, read: Reader) -> int:
    """`hpo report`, `best` and `status` of a study that exists; what they print is read whole
    (`read`) before a line of it is printed."""
    from hpo.reports import status as report

    if args.command == "report":
        from hpo.reports import document as study_report

        if args.out is None and args.format == "md":
            emit(read("the report", lambda: study_report.markdown(study, storage)), end="")
            return 0
        out = services.write_report(study, storage, args.format, args.out, read=read)
        emit(f"hpo: report of study {study.study_name!r} written to {out}")
        return 0
    if args.command == "best":
        return _best(study, storage, args, read)
    if args.watch:
        return _watch(study, storage, args.json, args.interval, read, _notify_of(args.notify))
    if args.notify is not None:
        raise HPOError("--notify goes with --watch: a stall is noticed by watching")
    summary = read("the status", lambda: services.status(study, storage, args.artifact_store))
    store = summary.get("artifact_store")
    lines = report.status_lines(summary) + ([artifact_line(store)] if store else [])
    emit(strict_json(summary, indent=2) if args.json else "\n".join(lines))
    return 0


def _best(study: Any, storage: Any, args: argparse.Namespace, read: Reader) -> int:
    """`hpo best`: the best trial (the Pareto front), or its model downloaded."""
    best = read("the best trial", lambda: services.best(study, storage))
    if args.download is not None:
        # The download reads the study's attributes too; a retry fetches the model again
        # (what a failed try fetched is removed: see services.download_best).
        emit(
            read(
                "the best model",
                lambda: services.download_best(
                    study,
                    best.trials,
                    services.study_artifact_store(study, args.artifact_store),
                    args.download,
                    args.merge,
                ),
            )[1]
        )
        return 0
    if args.merge:
        raise HPOError("--merge goes with --download DIR: it writes the merged model there")
    if args.json:  # several objectives: the Pareto front, a list
        shown: Any = best.trials if best.objectives > 1 else best.trials[0]
        if best.retrained is not None:
            several = isinstance(shown, list)
            shown = {"pareto_front": shown} if several else shown
            shown = {**shown, "retrain": best.retrained}
        emit(strict_json(shown, indent=2))
    else:
        emit("\n".join(best_text(trial) for trial in best.trials))
        if best.retrained is not None:
            emit(retrain_text(best.retrained))
    return 0


def _notify_of(path: str | None) -> NotifyConfig | None:
    """The study.notify section of the config file of `hpo status --watch --notify`."""
    if path is None:
        return None
    from hpo.config.loader import load_notify

    return load_notify(path)


def _say_stalled(study: Any, notify: NotifyConfig | None, summary: dict[str, Any]) -> None:
    """The stall, through study.notify (the watcher waits study.notify.wait at most)."""
    if notify is None or "stall" not in notify.events:
        return
    from hpo import notify as notices
    from hpo.reports import status as report

    sender = notices.start(notify)
    name = study.study_name
    lines = "\n".join(report.status_lines(summary))
    sender.submit(
        lambda: sender.say(
            f"hpo: study {name!r} has stalled",
            f"No trial runs with a live worker: start a worker (hpo run) to go on.\n{lines}",
        )
    )
    sender.close()


def _stall_patience(summary: dict[str, Any], interval: float, notify: NotifyConfig | None) -> float:
    """How long a watch sees no live worker before it says the study stalled: study.notify's
    stall_after, else longer than a worker takes between two trials."""
    if notify is not None and notify.stall_after is not None:
        return notify.stall_after
    return max(3 * interval, summary.get("grace_period_s") or 60)


def _watch(
    study: Any,
    storage: Any,
    as_json: bool,
    interval: float,
    read: Reader,
    notify: NotifyConfig | None = None,
) -> int:
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
        patience = _stall_patience(summary, interval, notify)
        if stalled_since is not None and time.monotonic() - stalled_since >= patience:
            _say_stalled(study, notify, summary)
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
