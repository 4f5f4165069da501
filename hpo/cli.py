"""The `hpo` command line. Bad input becomes one clear line and exit code 2; a traceback only
with --debug.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from hpo import __version__
from hpo import progress as live
from hpo.config import DEMO_CONFIG, Config, load_config
from hpo.errors import USER_ERRORS, ConfigError, HPOError
from hpo.launcher import MAX_WORKERS_PER_GPU
from hpo.logs import set_optuna_verbosity, setup_logging
from hpo.stopping import Interrupted, StopRequest, stopped_exit_code
from storage.url import StorageURL

if TYPE_CHECKING:
    from storage.artifacts import ArtifactStore, ArtifactURL

EXIT_BAD_INPUT = 2
ARTIFACT_STORE_ATTR = "artifact_store"  # the study's store, as its workers resolved it
MAX_STUDY_NAME_CHARS = 512  # Optuna's studies.study_name column
PARAMS_EXAMPLE = '{"learning_rate": 3e-5, "effective_batch_size": 32}'
REPO_ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("hpo")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            option = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += f"; a value that begins with '-' is written {option}=VALUE"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--gpu 0,1` must not silently mean `--gpus` (and then reach the worker
    # processes, whose arguments are the user's minus the exact `--gpus`).
    parser = _Parser(
        prog="hpo",
        allow_abbrev=False,
        description="Hyperparameter optimisation for fine-tuning transformer models. Trials live "
        "in an Optuna study in PostgreSQL or SQLite; run one worker per GPU on the same study.",
    )
    parser.add_argument("--version", action="version", version=f"hpo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        allow_abbrev=False,
        help="start a worker that runs trials of a study",
        description="Start a worker: create or join the study, then run trials until the study "
        "holds --n-trials trials (counted across every worker) or --timeout passes.",
    )
    run.add_argument(
        "--study", required=True, help="study name; workers with the same name share it"
    )
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"YAML config (default: the demo, {DEMO_CONFIG.relative_to(REPO_ROOT)})",
    )
    run.add_argument(
        "--storage",
        default=None,
        help="database URL, e.g. postgresql+psycopg2://user@host/db (default: $HPO_STORAGE, "
        "then study.storage in the config, then the SQLite file ./hpo.db)",
    )
    run.add_argument(
        "--n-trials",
        type=int,
        default=None,
        help="trials for the whole study, across all workers (overrides study.n_trials)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds after which this worker starts no new trial; the running trial finishes "
        "(counted from the worker's start; overrides study.timeout)",
    )
    run.add_argument(
        "--trial-timeout",
        type=float,
        default=None,
        help="seconds one trial may train: past it the trial checkpoints, stops and is pruned "
        "with reason `timeout` (overrides study.trial_timeout)",
    )
    run.add_argument(
        "--device", default=None, help="auto, cpu, cuda or cuda:N (overrides training.device)"
    )
    run.add_argument(
        "--gpus",
        default=None,
        help="start one worker per GPU of this host: auto (every visible GPU, or one CPU worker "
        "when there is none), none (one CPU worker) or ids like 0,1,3",
    )
    run.add_argument(
        "--workers-per-gpu",
        default=None,
        type=_workers_per_gpu,
        help="N workers share each GPU, each capped at 1/N of its memory (the batch finder "
        "searches within that share): more throughput for small models and batches. auto: "
        "4, 2 or 1, the most whose share still fits the largest effective batch of the search "
        "space in one micro-batch. Implies --gpus auto unless --gpus is given",
    )
    run.add_argument(
        "--artifact-store",
        default=None,
        help="where every host finds checkpoints and best models: file:///shared/path or "
        "s3://bucket/prefix (overrides $HPO_ARTIFACT_STORE and study.artifact_store)",
    )
    run.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    run.add_argument("--quiet", action="store_true", help="only warnings and the final summary")
    _add_monitoring_commands(commands)
    _add_enqueue_command(commands)
    _add_retrain_command(commands)
    _add_config_command(commands)
    finder = commands.add_parser(
        "batch-size",
        allow_abbrev=False,
        help="find the largest physical batch that fits and print what the search did",
        description="Run the batch finder alone on this machine's device: worst-case probes "
        "(every sequence at max_length, forward, backward and an AdamW step, then an "
        "evaluation forward), grown geometrically, then bisected; prints every probe.",
    )
    finder.add_argument("--config", type=Path, required=True, help="YAML config of the study")
    finder.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    finder.add_argument("--json", action="store_true", help="print the search as JSON")
    finder.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    finder.add_argument("--quiet", action="store_true", help="only warnings and the report")
    return parser


def _add_retrain_command(commands: argparse._SubParsersAction) -> None:
    from hpo.retrain import MAX_SEEDS, MAX_TOP

    retrain = commands.add_parser(
        "retrain",
        allow_abbrev=False,
        help="train the study's best configurations again with new seeds; save the winner",
        description="Train the --top best configurations of a study again, each with --seeds new "
        "seeds, in a study of its own (`<study> [retrain top K x S seeds, PLAN]`: in the "
        "dashboard and `hpo status`; a stopped retrain resumes when run again). The "
        "configuration with the "
        "best mean metric wins; its best run's model and tokenizer go to --out with a model "
        "card (parameters, per-seed metrics, data hashes, versions).",
    )
    retrain.add_argument("--study", required=True, help="the searched study")
    retrain.add_argument(
        "--config", type=Path, default=None,
        help="YAML config the study ran with (default: the demo config)",
    )  # fmt: skip
    retrain.add_argument("--storage", default=None, help="database URL (default: $HPO_STORAGE, "
                         "then the config's study.storage, then ./hpo.db)")  # fmt: skip
    retrain.add_argument(
        "--top", type=functools.partial(_count, "--top", MAX_TOP), default=3,
        help="configurations to retrain, best first (default 3)",
    )  # fmt: skip
    retrain.add_argument(
        "--seeds", type=functools.partial(_count, "--seeds", MAX_SEEDS), default=3,
        help="new seeds per configuration (default 3)",
    )  # fmt: skip
    retrain.add_argument(
        "--out", type=Path, default=None,
        help="folder for the final model (default: hpo-final-<study> here)",
    )  # fmt: skip
    retrain.add_argument(
        "--full-data", action="store_true",
        help="then train the winner once more on the training and evaluation splits together "
        "and save that model; its metric is then the mean of the held-out retrain runs",
    )  # fmt: skip
    retrain.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    retrain.add_argument(
        "--gpus", default=None,
        help="one worker per GPU of this host, as for hpo run: auto, none or ids like 0,1,3",
    )  # fmt: skip
    retrain.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    retrain.add_argument("--quiet", action="store_true", help="only warnings and the summary")
    # A worker of `--gpus` runs trials only; its launcher waits, picks and saves.
    retrain.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    retrain.set_defaults(n_trials=None, timeout=None, trial_timeout=None, workers_per_gpu=None)


def _count(flag: str, most: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"got {text!r}; give a whole number from 1 to {most}")
    return value


def _add_config_command(commands: argparse._SubParsersAction) -> None:
    config = commands.add_parser(
        "config",
        allow_abbrev=False,
        help="about the config file: `hpo config schema` prints its JSON Schema",
        description="About the study config file.",
    )
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    schema = actions.add_parser(
        "schema",
        allow_abbrev=False,
        help="print the config's JSON Schema, for an editor that completes and checks YAML",
        description="Print the JSON Schema (draft-07) of a study config. Save it and point your "
        "editor at it, e.g. for the VS Code YAML extension a first line "
        "`# yaml-language-server: $schema=hpo-config.schema.json` in the config.",
    )
    schema.add_argument("--debug", action="store_true", help="show tracebacks")
    schema.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)


def _config(args: argparse.Namespace) -> int:
    from hpo.config_schema import schema_text

    _out(schema_text(), end="")
    return 0


def _add_enqueue_command(commands: argparse._SubParsersAction) -> None:
    enqueue = commands.add_parser(
        "enqueue",
        allow_abbrev=False,
        help="queue a configuration for a study's workers to try next",
        description="Queue a configuration (a paper's recipe, a known-good run) that the next "
        "free worker of the study trains before sampling new ones. Checked against the study's "
        "search space; parameters left out are sampled. A configuration the study already holds "
        "is not queued again.",
    )
    enqueue.add_argument("--study", required=True, help="study name")
    enqueue.add_argument(
        "--params",
        required=True,
        help='JSON, e.g. \'{"learning_rate": 3e-5, "effective_batch_size": 32}\'',
    )
    enqueue.add_argument(
        "--config", type=Path, default=None,
        help="YAML config of the study (default: the search space the study was created with)",
    )  # fmt: skip
    enqueue.add_argument("--storage", default=None, help="database URL (default: $HPO_STORAGE, "
                         "then the config's study.storage, then ./hpo.db)")  # fmt: skip
    enqueue.add_argument("--debug", action="store_true", help="show tracebacks")
    enqueue.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)


def _add_monitoring_commands(commands: argparse._SubParsersAction) -> None:
    storage_help = "database URL (default: $HPO_STORAGE, then ./hpo.db)"
    add = functools.partial(commands.add_parser, allow_abbrev=False)
    studies = add("studies", help="list the studies in the storage")
    best = add("best", help="print the best trial of a study")
    status = add("status", help="summarise a study: states, running, failures")
    dashboard = add("dashboard", help="serve optuna-dashboard on the storage")
    report = add(
        "report", help="write a study's report: one HTML page that opens offline, or Markdown"
    )
    for sub in (studies, best, status, dashboard, report):
        sub.add_argument("--storage", default=None, help=storage_help)
        sub.add_argument("--debug", action="store_true", help="show tracebacks")
        sub.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    for sub in (best, status, report):
        sub.add_argument("--study", required=True, help="study name")
    report.add_argument(
        "--format", choices=["html", "md"], default="html", help="html (default) or md"
    )
    status.add_argument(
        "--watch", action="store_true",
        help="refresh until the study ends (no trial running or queued, its budget spent)",
    )  # fmt: skip
    status.add_argument(
        "--interval", type=_seconds, default=5.0, help="seconds between refreshes (default 5)"
    )
    report.add_argument(
        "--out", default=None,
        help="file or existing folder to write to (default: hpo-report-<study>.html here; "
        "Markdown: standard output)",
    )  # fmt: skip
    for sub in (studies, best, status):
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    for sub in (best, status):
        sub.add_argument(
            "--artifact-store", default=None,
            help="the study's artifact store (default: $HPO_ARTIFACT_STORE, then the one its "
            "workers recorded)",
        )  # fmt: skip
    best.add_argument(
        "--download", default=None, metavar="DIR",
        help="fetch the best model from the artifact store into DIR (new or empty), every file "
        "checked against its sha256",
    )  # fmt: skip
    dashboard.add_argument(
        "--host", type=_host, default="127.0.0.1", help="bind address (default: localhost)"
    )
    dashboard.add_argument("--port", type=_port_number, default=8080, help="port (default 8080)")


def _port_number(text: str) -> int:
    """argparse type for a TCP port: a bad one is a usage error (exit 2), not an OverflowError
    from the socket."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number, e.g. 8080") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1-65535; e.g. 8080")
    return port


def _host(text: str) -> str:
    """argparse type for --host: an empty one (an unset variable) would listen on every
    interface, which only 0.0.0.0 should mean; [::1], as the banner writes it, is ::1."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise argparse.ArgumentTypeError(
            "is empty; give 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        )
    return host


def _workers_per_gpu(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        workers = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; give a number like 2, or auto") from None
    if not 1 <= workers <= MAX_WORKERS_PER_GPU:
        raise argparse.ArgumentTypeError(
            f"got {workers}; give 1 to {MAX_WORKERS_PER_GPU} workers per GPU, or auto"
        )
    return workers


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


def main(argv: Sequence[str] | None = None) -> int:
    # Before CUDA initialises: fewer fragmentation OOMs as batch shapes change between steps.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.monotonic()  # --timeout counts from here
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt as e:
        return _stopped(e)
    args.argv, args.started = argv, started
    _setup_logging(args.debug, args.quiet)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "batch-size":
            return _batch_size(args)
        if args.command == "enqueue":
            return _enqueue(args)
        if args.command == "retrain":
            return _retrain(args)
        if args.command == "config":
            return _config(args)
        return _monitor(args)
    except USER_ERRORS as e:
        if args.debug:
            log.exception("hpo failed")
        print(f"hpo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        return _stopped(e)
    except BrokenPipeError:
        # `hpo status | head`: the reader has gone; nothing left to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _out(text: str, end: str = "\n") -> None:
    """What a command answers, on standard output: `hpo status > /dev/full` (or a full disk
    under a redirect) is one line, not a traceback."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        os.close(devnull)
        raise HPOError(f"cannot write the output to standard output ({e.strerror or e})") from e


def _stopped(interrupt: KeyboardInterrupt) -> int:
    name = getattr(interrupt, "signal_name", "SIGINT")
    print(f"hpo: stopped by {name}", file=sys.stderr)
    return stopped_exit_code(name)


def _setup_logging(debug: bool, quiet: bool) -> None:
    setup_logging(logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)


def _run(args: argparse.Namespace) -> int:
    # From the start: a SIGTERM or Ctrl-C while torch loads and the data is prepared stops
    # the worker at once, before anything is written: no traceback, no signal's exit code.
    stop = StopRequest(interrupt_at_once=True, doing="stopping before the first trial")
    stop.install()
    inputs = None
    with contextlib.suppress(Interrupted):
        inputs = _check_inputs(args)
    stop.interrupt_at_once, stop.doing = False, StopRequest.RUNNING
    if inputs is None or stop.requested:
        print(f"hpo: stopped by {stop.signal_name} before the first trial", file=sys.stderr)
        return stop.exit_code
    config, storage_url = inputs[0], inputs[1]
    from hpo.study import open_study, summary_lines
    from storage import open_storage

    print(f"hpo: study {args.study!r} in {storage_url.describe()}", file=sys.stderr)
    on_demand = config.study.database_connections == "on_demand"
    storage = open_storage(storage_url, config.study.database_patience, on_demand=on_demand)
    study = open_study(storage, args.study, config)
    if config.study.artifact_store is not None:
        from storage.artifacts import ArtifactStore

        ArtifactStore(config.study.artifact_store).create()  # a file store's folder, if missing
        # For `hpo best` and `hpo status`, which have no config.
        study.set_user_attr(ARTIFACT_STORE_ATTR, config.study.artifact_store)
        print(f"hpo: checkpoints and best models go to {config.study.artifact_store}",
              file=sys.stderr)  # fmt: skip
    code = _work(study, storage, inputs, stop, args)
    print("\n".join(summary_lines(study, config.study.objectives)))
    if stop.signal_name is not None:
        print(f"hpo: stopped by {stop.signal_name}", file=sys.stderr)
    return code


def _work(
    study: Any, storage: Any, inputs: tuple, stop: StopRequest, args: Any, queued_only: bool = False
) -> int:
    """Run the study's trials (`queued_only`: its queued ones): in this process, or in one
    worker process per GPU (each runs the same command with `worker_args` added)."""
    from hpo.launcher import run_workers
    from hpo.objective import Objective
    from hpo.study import run_trials
    from storage.batch_cache import BatchSizeCache

    config, storage_url, gpus, data, per_gpu = inputs
    if len(gpus) * per_gpu > 1:
        worker_args = ["--as-worker"] if args.command == "retrain" else []
        storage.engine.dispose()  # its workers connect; this process holds none meanwhile
        return run_workers(gpus, [*args.argv, *worker_args], per_gpu, stop)
    stop.interrupt_at_once = config.study.trial_isolation == "none"
    if not args.quiet:
        live.start()  # a progress line below the log, on a terminal only
    cache = BatchSizeCache(storage.engine)  # the worker's pool: no connection of its own
    objective = Objective(config, data, storage_url, stop, batch_cache=cache)
    try:
        run_trials(study, storage, objective, stop, queued_only, started=args.started)
    finally:
        live.stop()
        stop.interrupt_at_once = False
    return stop.exit_code if stop.requested else 0


def _retrain(args: argparse.Namespace) -> int:
    """`hpo retrain`: see hpo.retrain."""
    import optuna

    from hpo import retrain
    from hpo.study import open_study
    from storage import open_storage

    stop = StopRequest(interrupt_at_once=True, doing="stopping before the first trial")
    stop.install()
    out = args.out if args.out is not None else retrain.default_out(args.study)
    inputs = None
    opened: list[Any] = []

    def open_source(config: Config, storage_url: StorageURL) -> None:
        """The study to retrain, found before the data is prepared; --out checked first."""
        if not args.as_worker:  # before any training: a bad --out is found in seconds
            retrain.check_out(out, args.study, storage_url.masked)
        on_demand = config.study.database_connections == "on_demand"
        storage = open_storage(
            storage_url, config.study.database_patience, must_exist=True, on_demand=on_demand
        )
        try:
            storage.get_study_id_from_name(args.study)
        except KeyError as e:
            raise HPOError(
                f"no study {args.study!r} in {storage_url.masked}; see `hpo studies`"
            ) from e
        opened.append(storage)

    with contextlib.suppress(Interrupted):
        inputs = _check_inputs(args, before_data=open_source)
    stop.interrupt_at_once, stop.doing = False, StopRequest.RUNNING
    if inputs is None or stop.requested:
        print(f"hpo: stopped by {stop.signal_name} before the first trial", file=sys.stderr)
        return stop.exit_code
    config, storage_url, storage = inputs[0], inputs[1], opened[0]
    source = optuna.load_study(study_name=args.study, storage=storage)
    plan = retrain.make_plan(source, config, args.top, args.seeds, args.config is not None)
    plan = retrain.stored_plan(storage, plan.study_name) or plan  # a resumed retrain
    retrain_config = retrain.study_config(config, plan)
    print(f"hpo: retraining {len(plan.configs)} configurations of study {args.study!r} with "
          f"{len(plan.seeds)} seeds each, in study {plan.study_name!r} in "
          f"{storage_url.describe()}", file=sys.stderr)  # fmt: skip
    study = open_study(storage, plan.study_name, retrain_config)
    retrain.queue_runs(storage, study, plan)
    work = (retrain_config, *inputs[1:])
    code = _retrain_runs(study, storage, work, stop, args)
    if args.as_worker and code is None and args.full_data:
        # A worker of several GPUs also runs the full-data run, once the winner's is queued.
        with contextlib.suppress(KeyError):
            storage.get_study_id_from_name(plan.full_data_study_name)
            full = open_study(storage, plan.full_data_study_name, retrain_config)
            code = _retrain_runs(full, storage, work, stop, args)
    if code is not None or args.as_worker:
        return code or 0
    found = retrain.results(study, plan)
    direction = study.directions[0]
    winner = retrain.pick_winner(found, direction, len(plan.seeds))
    if winner is None:
        print(f"hpo: no retrain run of study {plan.study_name!r} completed; see "
              f"`hpo status --study {shlex.quote(plan.study_name)}`", file=sys.stderr)  # fmt: skip
        return 1
    chosen = retrain.best_run(winner, direction)
    model_study, model_trial = study, chosen["trial"]
    full_data_trial = None
    if args.full_data:
        model_study = open_study(storage, plan.full_data_study_name, retrain_config)
        retrain.queue_full_data_run(storage, model_study, plan, winner)
        code = _retrain_runs(model_study, storage, work, stop, args)
        if code is not None:
            return code
        full_data_trial = retrain.full_data_trial(model_study, winner)
        if full_data_trial is None:
            print("hpo: the full-data run did not complete; see `hpo status --study "
                  f"{shlex.quote(plan.full_data_study_name)}`", file=sys.stderr)  # fmt: skip
            return 1
        model_trial = full_data_trial
    metric = config.study.primary_metric
    card = retrain.model_card(plan, found, winner, chosen, config, metric, full_data_trial,
                              storage_url.masked)  # fmt: skip
    with _winner_model(model_study, model_trial, config, out) as model_dir:
        retrain.save_final_model(model_dir, out, card)
    source.set_user_attr(retrain.OUTCOME_ATTR, retrain.outcome(card, out))
    print(retrain.summary(card, out))
    if stop.requested:  # exit 0 all the same: nothing is left to do, a rerun would redo nothing
        print(f"hpo: {stop.signal_name} came during the final save, which was finished first",
              file=sys.stderr)  # fmt: skip
    return 0


@contextlib.contextmanager
def _winner_model(study: Any, number: int, config: Config, out: Path) -> Iterator[Path]:
    """The winning run's model folder: on this host, or (trained on another host) fetched from
    the artifact store beside `out`, checked against its sha256, and removed afterwards."""
    import tempfile

    from hpo import retrain
    from hpo.checkpoints import folder_name, study_folder_name
    from storage.artifacts import ArtifactStore, ArtifactStoreError

    local = retrain.model_folder(study, number)
    if (local / "config.json").is_file() or config.study.artifact_store is None:
        yield local
        return
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".fetch"))
    try:
        store = ArtifactStore(config.study.artifact_store)
        slug = study_folder_name(study.study_name)
        if store.fetch(slug, folder_name(trial), "best-model", scratch / "model") is None:
            yield local  # not in the store either: save_final_model says so
        else:
            yield scratch / "model"
    except ArtifactStoreError as e:
        raise HPOError(
            f"the winning run's model is not on this host and not fetched from "
            f"{config.study.artifact_store}: {e}"
        ) from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _retrain_runs(
    study: Any, storage: Any, work: tuple, stop: StopRequest, args: Any
) -> int | None:
    """Run a retrain study's queued runs (here, or on the workers of several GPUs) until none
    is left, none running anywhere; None when done, else the exit code (stopped, or a worker
    failed)."""
    from hpo import retrain

    while True:
        code = _work(study, storage, work, stop, args, queued_only=True)
        if stop.requested or code != 0:
            return _retrain_stopped(stop, code, args)
        if args.as_worker or not retrain.unfinished(study):
            return None
        # Handed back, or queued again by a sweep, after this worker's loop had ended.


def _retrain_stopped(stop: StopRequest, code: int, args: argparse.Namespace) -> int:
    if stop.signal_name is not None and not args.as_worker:
        print(f"hpo: stopped by {stop.signal_name}; run the same hpo retrain again to resume",
              file=sys.stderr)  # fmt: skip
    return stop.exit_code if stop.requested else code


def _check_inputs(
    args: argparse.Namespace, before_data: Callable[[Config, StorageURL], None] | None = None
) -> tuple[Config, StorageURL, list[str], Any, int]:
    """Every input of `hpo run`, checked before anything is written: a bad one writes nothing.
    The cheap checks first, the data last (it takes seconds, minutes on a real set): the
    database and the artifact store are reached once, and a model folder's weights read, before
    it is prepared. Returns the config, the storage URL, the worker's GPUs, the prepared data
    and the workers per GPU. `before_data` checks what it must (retrain: that the study exists)
    before the data is prepared."""
    from storage.artifacts import resolve_artifact_url
    from storage.url import resolve_storage_url

    check_study_name(args.study)
    config_path = args.config or DEMO_CONFIG
    if args.config is None and not DEMO_CONFIG.is_file():
        raise HPOError("no --config given and the demo config is not installed; pass --config FILE")
    config = load_config(config_path)
    _apply_overrides(config, args)
    storage_url = resolve_storage_url(args.storage, config.study.storage)
    artifacts = resolve_artifact_url(getattr(args, "artifact_store", None),
                                     config.study.artifact_store)  # fmt: skip
    config.study.artifact_store = artifacts.url if artifacts is not None else None
    _check_memory_share()
    per_gpu = args.workers_per_gpu
    gpus = _worker_gpus(config, "auto" if args.gpus is None and per_gpu is not None else args.gpus)
    if not gpus and isinstance(per_gpu, int) and per_gpu > 1:
        raise HPOError(
            f"--workers-per-gpu {per_gpu}: no GPU to share on this host; leave it out to run "
            "one worker on the CPU"
        )
    _check_stores(storage_url, artifacts)
    if before_data is not None:
        before_data(config, storage_url)
    # Only now the heavy imports: a config or URL error is reported in well under a second.
    from trainer.data import prepare_data
    from trainer.device import resolve_device
    from trainer.model import check_model_config, load_tokenizer

    set_optuna_verbosity(logging.getLogger().level)
    # The device first: `cuda` on a host without CUDA is reported before the data is prepared.
    resolve_device(config.training.device)
    check_model_config(config.model, config.data.max_length)
    data = prepare_data(config.data, load_tokenizer(config.model))
    log.info(
        "data: %d training and %d evaluation examples, labels %s",
        len(data.train),
        len(data.eval),
        data.label_names,
    )
    if per_gpu == "auto":
        per_gpu = _auto_workers_per_gpu(config, config_path, gpus)
    return config, storage_url, gpus, data, per_gpu or 1


def _check_stores(storage_url: StorageURL, artifacts: ArtifactURL | None) -> None:
    """The study database reached (credentials, Optuna's tables or the right to create them)
    and the artifact store tried (a probe written, read and deleted), writing nothing: a
    permanent refusal is one line now, not a wait of study.artifact_patience in every trial."""
    from storage.artifacts import ArtifactStore
    from storage.preflight import check_database

    check_database(storage_url)
    if artifacts is not None:
        ArtifactStore(artifacts.url).check()


def _check_memory_share() -> None:
    from trainer.memory_share import memory_share

    try:
        memory_share()
    except ValueError as e:
        raise HPOError(f"{e}, or unset it") from e


def _auto_workers_per_gpu(config: Config, config_path: Path, gpus: list[str]) -> int:
    """`--workers-per-gpu auto` on the first GPU (the others are taken to be alike)."""
    from hpo.launcher import choose_workers_per_gpu

    if not gpus:  # said, since --workers-per-gpu 2 is refused here
        log.info("--workers-per-gpu auto: 1 worker, on the CPU (no GPU on this host to share)")
        return 1
    space = config.search_space.get("effective_batch_size")
    if space is None:
        largest = config.training.effective_batch_size
    elif space.choices is not None:
        largest = max(int(choice) for choice in space.choices)
    else:
        largest = int(space.high or 1)
    workers, why = choose_workers_per_gpu(str(config_path), gpus[0], largest)
    log.info("--workers-per-gpu auto: %d workers per GPU (%s)", workers, why)
    return workers


def _enqueue(args: argparse.Namespace) -> int:
    import optuna

    from hpo.config import ParamSpec, check_params, space_record
    from hpo.study import enqueue
    from storage import open_storage, resolve_storage_url

    check_study_name(args.study)
    raw = _json_params(args.params)
    config = load_config(args.config) if args.config is not None else None
    storage_url = resolve_storage_url(args.storage, config.study.storage if config else None)
    set_optuna_verbosity(logging.getLogger().level)
    storage = open_storage(storage_url, must_exist=True)
    try:
        study_id = storage.get_study_id_from_name(args.study)
    except KeyError as e:
        raise HPOError(f"no study {args.study!r} in {storage_url.masked}; start it with `hpo "
                       "run` (or check --study with `hpo studies`)") from e  # fmt: skip
    attrs = storage.get_study_user_attrs(study_id)
    recorded = attrs.get("search_space")
    if config is not None:
        space = config.search_space
        if recorded is not None and recorded != space_record(space):
            raise HPOError(
                f"--config: its search space is not the one study {args.study!r} was created "
                "with; use the study's config or leave --config out"
            )
    elif recorded is None:
        raise HPOError(f"study {args.study!r} has no search space recorded by hpo; pass the "
                       "--config it runs with")  # fmt: skip
    else:
        space = {name: ParamSpec(**spec) for name, spec in recorded.items()}
    problems: list[str] = []
    grid = (config.study.sampler.type if config else attrs.get("sampler")) == "grid"
    params = check_params(space, raw, "--params", problems, complete=grid)
    if problems:
        raise ConfigError(problems, "--params")
    study = optuna.load_study(study_name=args.study, storage=storage)
    optuna.logging.set_verbosity(max(logging.getLogger().level, logging.WARNING))  # hpo says it
    with storage.lock(study_id):
        queued = enqueue(study, params)
    shown = json.dumps(params)
    if queued:
        print(f"hpo: queued {shown} in study {args.study!r}: the next worker to start a trial "
              "trains it, if the study's n_trials leaves room (queued trials count once "
              "started)")  # fmt: skip
    else:
        print(f"hpo: study {args.study!r} already holds a trial with {shown}; nothing queued")
    return 0


def _json_params(text: str) -> dict[str, Any]:
    """--params: a JSON object, no key twice (the last would win silently)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise HPOError(f"--params gives {repeated[0][:80]!r} twice; give each parameter once")
        return dict(pairs)

    try:
        raw = json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise HPOError(f"--params is not JSON ({reason}); write e.g. '{PARAMS_EXAMPLE}'") from e
    if not isinstance(raw, dict) or not raw:
        raise HPOError(
            f"--params must be a JSON object of search-space parameters, e.g. '{PARAMS_EXAMPLE}'"
        )
    return raw


def _monitor(args: argparse.Namespace) -> int:
    import optuna

    from hpo import report
    from storage import open_storage, resolve_storage_url

    set_optuna_verbosity(logging.getLogger().level)

    storage_url = resolve_storage_url(args.storage, None)
    # No check_study_name: a study that plain Optuna made may have any name `hpo studies` lists
    # (a tab, 600 characters, spaces only), and looking at it creates nothing.
    if getattr(args, "study", None) == "":
        raise HPOError("--study: the study name is empty; `hpo studies` lists the names")
    # Monitoring never creates a database, a table or a lock file (a typo in --storage, a
    # read-only folder); the dashboard may write notes, but only into an existing study database.
    storage = open_storage(storage_url, read_only=args.command != "dashboard", must_exist=True)
    if args.command == "dashboard":
        address = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 in a URL
        banner = f"hpo: dashboard for {storage_url.describe()} on http://{address}:{args.port}/"
        from optuna_dashboard import wsgi

        _serve(wsgi(storage), args.host, args.port, banner)
        return 0
    if args.command == "studies":
        rows = report.studies(storage)
        _out(strict_json(rows, indent=2) if args.json else _studies_table(rows))
        return 0
    try:
        study = optuna.load_study(study_name=args.study, storage=storage)
    except KeyError as e:
        raise HPOError(f"no study {args.study!r} in {storage_url.masked}; see `hpo studies`") from e
    try:
        return _look_at(study, storage, args)
    except KeyError as e:
        if "Record does not exist" not in str(e):  # Optuna's word for a row that has gone
            raise
        raise HPOError(f"study {args.study!r} is no longer in {storage_url.masked}: deleted "
                       "while hpo read it; see `hpo studies`") from e  # fmt: skip


def _look_at(study: Any, storage: Any, args: argparse.Namespace) -> int:
    """`hpo report`, `best` and `status` of a study that exists."""
    from hpo import report, retrain

    if args.command == "report":
        return _write_report(study, storage, args.format, args.out)
    if args.command == "best":
        best = report.best_trials(study, storage=storage)
        if not best:
            raise HPOError(f"study {args.study!r} has no completed trial yet")
        retrained = retrain.recorded_outcome(study.user_attrs)
        if args.download is not None:
            return _download_best(study, best, args)
        if args.json:  # several objectives: the Pareto front, a list
            shown: Any = best if len(study.directions) > 1 else best[0]
            if retrained is not None:
                several = isinstance(shown, list)
                shown = {"pareto_front": shown} if several else shown
                shown = {**shown, "retrain": retrained}
            _out(strict_json(shown, indent=2))
        else:
            _out("\n".join(_best_text(trial) for trial in best))
            if retrained is not None:
                _out(_retrain_text(retrained))
        return 0
    if args.watch:
        return _watch(study, storage, args.json, args.interval)
    summary = report.status(study, storage=storage)
    store = _artifact_summary(study, args)
    if store is not None:
        summary["artifact_store"] = store
    lines = report.status_lines(summary) + ([_artifact_line(store)] if store else [])
    _out(strict_json(summary, indent=2) if args.json else "\n".join(lines))
    return 0


def _study_artifact_store(study: Any, args: argparse.Namespace) -> ArtifactStore | None:
    """The study's artifact store (--artifact-store, $HPO_ARTIFACT_STORE, its workers'
    record), or None."""
    from storage.artifacts import ArtifactStore, resolve_artifact_url

    recorded = study.user_attrs.get(ARTIFACT_STORE_ATTR)
    url = resolve_artifact_url(args.artifact_store, None, recorded)
    return None if url is None else ArtifactStore(url.url)


def _artifact_summary(study: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """What the study holds in its store: URL, bytes and trial folders; an unreachable store is
    said, not fatal (status is for looking)."""
    from hpo.checkpoints import study_folder_name
    from storage.artifacts import ArtifactStoreError

    try:
        store = _study_artifact_store(study, args)
        if store is None:
            return None
        slug = study_folder_name(study.study_name)
        return {"url": store.url, "size_bytes": store.size(slug),
                "trial_folders": len(store.folders(slug))}  # fmt: skip
    except ArtifactStoreError as e:  # e.g. the workers' shared mount is not mounted here
        if args.artifact_store is not None:
            raise
        return {"url": study.user_attrs.get(ARTIFACT_STORE_ATTR), "error": str(e)}


def _artifact_line(store: dict[str, Any]) -> str:
    if "error" in store:
        return f"artifact store {store['url']}: unreachable ({store['error']})"
    return (f"artifact store {store['url']}: {store['size_bytes'] / 1e6:.1f} MB in "
            f"{store['trial_folders']} trial folders")  # fmt: skip


def _download_best(study: Any, best: list[dict], args: argparse.Namespace) -> int:
    """`hpo best --download DIR`: the best trial's model from the store into DIR (written
    beside it, then renamed: never half a model), each file checked against its sha256."""
    from hpo.checkpoints import study_folder_name
    from storage.artifacts import ArtifactStoreError

    store = _study_artifact_store(study, args)
    if store is None:
        raise HPOError(f"study {study.study_name!r} has no artifact store; its best model is on "
                       "the host that trained it (hpo best names the folder)")  # fmt: skip
    out = Path(args.download)
    if not args.download.strip() or out.resolve() == Path.cwd() or out.name in ("", ".", ".."):
        raise HPOError(f"--download {args.download!r}: name a new (or empty) folder for the "
                       "model, e.g. --download ./best-model")  # fmt: skip
    if out.is_symlink():  # a link to an empty folder: that folder; a link to nothing: refused
        if not out.is_dir():
            raise HPOError(f"--download {out}: a link to nothing; name a new folder")
        out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HPOError(f"--download {out}: exists and is not an empty folder; name a new one")
    folder = f"trial-{int(best[0]['user_attrs'].get('first_attempt', best[0]['number']))}"
    aside = out.parent / f".{out.name}.{os.getpid()}.download"
    number = best[0]["number"]
    try:
        manifest = store.fetch(study_folder_name(study.study_name), folder, "best-model", aside)
        if manifest is not None:
            if out.is_dir():
                out.rmdir()
            aside.rename(out)
    except ArtifactStoreError as e:
        raise HPOError(f"best model of trial #{number} not downloaded: {e}") from e
    except OSError as e:  # out of reach, or taken meanwhile: named by the folder asked for,
        shutil.rmtree(aside, ignore_errors=True)  # and nothing is left beside it
        raise HPOError(f"--download {out}: cannot write there ({e.strerror or e})") from e
    if manifest is None:
        error = best[0]["user_attrs"].get("checkpoint_error")
        why = f" ({error})" if error else ""
        raise HPOError(f"trial #{number} has no best model in {store.url}{why}")
    _out(
        f"hpo: best model of trial #{number} ({manifest.size / 1e6:.1f} MB, sha256 checked) "
        f"in {out}"
    )
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"got {text!r}; give seconds from 0.1 to 3600, e.g. 5")
    return value


def _watch(study: Any, storage: Any, as_json: bool, interval: float) -> int:
    """`hpo status --watch`: the status again every `interval` seconds (the screen redrawn on a
    terminal, one block per refresh otherwise) until the study has ended at two refreshes in a
    row; Ctrl-C ends it at once."""
    import datetime as dt

    from hpo import report

    terminal = sys.stdout.isatty()
    ended_polls = 0
    stalled_since = None
    first = True
    while ended_polls < 2:
        summary = report.status(study, storage=storage)
        text = strict_json(summary) if as_json else "\n".join(report.status_lines(summary))
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = text if as_json else f"[{stamp}] {text}"
        if terminal:  # redrawn in place, within the screen as it is sized now
            columns, rows = live.terminal_size(sys.stdout)
            _out(live.screen_frame(text.splitlines(), columns, rows, first), end="")
        else:
            _out(text)
        first = False
        ended_polls = ended_polls + 1 if report.ended(summary) else 0
        stalled_since = (stalled_since or time.monotonic()) if report.stalled(summary) else None
        # No live worker for longer than a worker takes between two trials: nothing will move.
        patience = max(3 * interval, summary.get("grace_period_s") or 60)
        if stalled_since is not None and time.monotonic() - stalled_since >= patience:
            print(f"hpo: study {study.study_name!r} has stopped moving: no trial runs with a live "
                  "worker; start a worker (hpo run) to go on", file=sys.stderr)  # fmt: skip
            return 1
        if ended_polls < 2:
            time.sleep(interval)
    print(f"hpo: study {study.study_name!r} has ended", file=sys.stderr)
    return 0


def report_path(given: str | None, study_name: str, form: str) -> Path:
    """Where `hpo report --out` writes: the file named, or the default name in the folder
    named (an existing folder, or any name ending in a slash, which must be one)."""
    from hpo.checkpoints import study_folder_name

    default = Path(f"hpo-report-{study_folder_name(study_name)}.{form}")
    if given is None:
        return default
    if not given.strip():
        raise HPOError("--out is empty; name a file, or a folder to write it in")
    out = Path(given)
    if out.is_dir():
        return out / default
    if given.endswith(("/", os.sep)):
        raise HPOError(f"--out {given}: no such folder; create it first, or name a file")
    if not out.parent.is_dir():
        raise HPOError(f"--out {given}: no such folder {str(out.parent)!r}; create it first")
    return out


def _write_report(study: Any, storage: Any, form: str, given: str | None) -> int:
    """The report to `given` (written aside, then renamed: never half a file), or Markdown to
    standard output."""
    import tempfile

    from hpo import study_report

    if given is None and form == "md":
        _out(study_report.markdown(study, storage), end="")
        return 0
    out = report_path(given, study.study_name, form)
    if out.exists() and not out.is_file():  # a device, a pipe: never replaced by a file
        raise HPOError(f"--out {out}: not a regular file; name a file to write")
    text = (study_report.markdown(study, storage) if form == "md"
            else study_report.html_page(study, storage))  # fmt: skip
    try:
        handle, aside = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise HPOError(f"--out {out}: cannot write there ({e.strerror or e})") from e
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(aside, 0o666 & ~umask)  # as any new file, not mkstemp's owner-only mode
        os.replace(aside, out)
    except OSError as e:
        Path(aside).unlink(missing_ok=True)
        raise HPOError(f"--out {out}: cannot write it ({e.strerror or e})") from e
    _out(f"hpo: report of study {study.study_name!r} written to {out}")
    return 0


def _studies_table(rows: list[dict]) -> str:
    if not rows:
        return "no studies"
    names = [_one_line(row["name"]) for row in rows]
    name_width = max(4, *(len(name) for name in names))
    width = max(9, *(len(row["direction"]) for row in rows))
    lines = [f"{'name':<{name_width}}  {'direction':<{width}} {'trials':>6}  best"]
    for name, row in zip(names, rows, strict=True):
        best = "-" if row["best_value"] is None else f"{row['best_value']:.4f}"
        if len(row["directions"]) > 1:
            best = "Pareto front (hpo best)"
        lines.append(
            f"{name:<{name_width}}  {row['direction']:<{width}} {row['n_trials']:>6}  {best}"
        )
    return "\n".join(lines)


def _one_line(text: str) -> str:
    """`text` with its control characters (a line break in a study name made with Optuna
    itself) shown escaped, so a table row stays one line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _retrain_text(retrained: dict) -> str:
    """`hpo best` after `hpo retrain`: the configuration that won on the mean over seeds."""
    from hpo.retrain import mean_std_text, seeds_text

    params = ", ".join(f"{k}={_short(v)}" for k, v in retrained["params"].items())
    full = ", trained on both splits" if retrained.get("full_data") else ""
    if not Path(retrained["model"]).is_dir():
        full += " (not there any more: moved or removed; hpo retrain again writes it)"
    seeds, study = seeds_text(retrained["seeds"]), retrained["study"]
    return (
        f"retrain winner (mean over {seeds}, study {study!r}): "
        f"{retrained['metric']} {mean_std_text(retrained['mean'], retrained['std'])} ({params}), "
        f"search trial #{retrained['search_trial']}\nfinal model: {retrained['model']}{full}"
    )


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON that strict parsers (jq, JSON.parse) read: an infinite or NaN value (a diverged
    trial's, say) is written as the string "inf", "-inf" or "nan", which float() reads back;
    anything else JSON has no type for (a date) as its text."""

    def finite(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return str(item)
        if isinstance(item, dict):
            return {key: finite(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [finite(v) for v in item]
        return item

    return json.dumps(finite(value), indent=indent, default=str, allow_nan=False)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _best_text(best: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    if "values" in best:  # a trial of the Pareto front
        values = ", ".join(f"{v:.4f}" for v in best["values"])
        text = f"Pareto-front trial #{best['number']} of {best['study']!r}: {values} ({params})"
    else:
        text = f"best trial #{best['number']} of {best['study']!r}: {best['value']:.4f} ({params})"
    model = best["user_attrs"].get("best_model")
    uri = best["user_attrs"].get("best_model_uri")
    missing = best.get("model_missing")
    if uri:
        text += f"\nmodel: {uri} (hpo best --download DIR fetches it)"
    elif model and not missing:
        text += f"\nmodel: {model} (AutoModelForSequenceClassification.from_pretrained)"
    error = best["user_attrs"].get("checkpoint_error")
    if missing:
        text += f"\nWARNING: {missing}"
    elif error and not uri:  # why the model is only on the host that trained it
        text += f"\nnot saved or not uploaded: {error}"
    return text


def _batch_size(args: argparse.Namespace) -> int:
    from trainer import device as dev
    from trainer.batch_finder import batch_key, find_physical_batch_size
    from trainer.config import TrainJob
    from trainer.data import prepare_data
    from trainer.model import check_model_config, load_tokenizer

    config = load_config(args.config)
    if args.device is not None:
        config.training.device = args.device
        rules = [rule for key, _, rule in config.training.problems() if key == "device"]
        if rules:
            raise ConfigError([f"--device: got {args.device!r}; {rules[0]}"], "command line")
    # The device first: `cuda` on a host without CUDA is reported before minutes of data prep.
    source = "--device" if args.device is not None else "training.device"
    device = dev.resolve_device(config.training.device, source)
    check_model_config(config.model, config.data.max_length)
    data = prepare_data(config.data, load_tokenizer(config.model))
    job = TrainJob(config.data, config.model, config.training)
    search = find_physical_batch_size(job, data.label_names, device)
    key = batch_key(job, device, dev.resolve_precision(config.training.precision, device))
    if args.json:
        print(json.dumps({**search.as_dict(), "cache_key": key}, sort_keys=True))
    else:
        print(search.report())
        print(f"cache key: {json.dumps(key, sort_keys=True)}")
    if search.chosen == 0:
        print(
            "hpo: not even one example fits in memory: shorten data.max_length, enable "
            "model.gradient_checkpointing or use a smaller model",
            file=sys.stderr,
        )
        return 1
    return 0


def _worker_gpus(config: Config, spec: str | None) -> list[str]:
    """With --gpus, the GPUs to start workers on; one of them (or the CPU) is set up to run in
    this very process."""
    from hpo.launcher import FAKE_GPUS_ENV, select_gpus, visible_gpus
    from hpo.logs import WORKER_LABEL_ENV

    if spec is None:
        return []
    gpus = select_gpus(spec, visible_gpus())
    if not gpus:
        if spec.strip().lower() == "auto":
            log.info("no GPU visible on this host: one worker on the CPU")
        config.training.device = "cpu"
    elif len(gpus) == 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]  # before anything initialises CUDA
        os.environ[WORKER_LABEL_ENV] = f"gpu{gpus[0]}"
        setup_logging(logging.getLogger().level)  # log lines now name the GPU
        config.training.device = "cpu" if os.environ.get(FAKE_GPUS_ENV) else "cuda"
    return gpus


def check_study_name(name: str) -> None:
    """Any name the database can hold is a valid study name (quotes, slashes, unicode: on disk
    it becomes a slug and a hash, see hpo.checkpoints); these it cannot, or nobody means."""
    if not name.strip():
        raise HPOError("--study: the study name is empty; give a name, e.g. --study demo")
    if len(name) > MAX_STUDY_NAME_CHARS:
        raise HPOError(
            f"--study: the study name has {len(name)} characters; Optuna's database holds at "
            f"most {MAX_STUDY_NAME_CHARS}: use a shorter name"
        )
    if any(ord(c) < 32 for c in name):
        raise HPOError(
            "--study: the study name contains a control character (NUL, newline, tab...); "
            "use printable characters"
        )


def _apply_overrides(config: Config, args: argparse.Namespace) -> None:
    problems = []
    if args.n_trials is not None:
        if args.n_trials < 1:
            problems.append(f"--n-trials: got {args.n_trials}; must be a positive integer")
        config.study.n_trials = args.n_trials
    if args.timeout is not None:
        if not 0 < args.timeout < math.inf:
            problems.append(f"--timeout: got {args.timeout}; must be a finite number > 0 seconds")
        config.study.timeout = args.timeout
    if args.trial_timeout is not None:
        if not 0 < args.trial_timeout < math.inf:
            problems.append(
                f"--trial-timeout: got {args.trial_timeout}; must be a finite number > 0 seconds"
            )
        config.study.trial_timeout = args.trial_timeout
    for flag, value in (("--gpus", args.gpus), ("--workers-per-gpu", args.workers_per_gpu)):
        if value is not None and args.device is not None:
            problems.append(f"--device: cannot be combined with {flag}, which sets the GPU")
    if args.device is not None:
        config.training.device = args.device
        for key, value, rule in config.training.problems():
            if key == "device":
                problems.append(f"--device: got {value!r}; {rule}")
    if problems:
        raise ConfigError(problems, "command line")
    if args.device is not None and args.device.startswith("cuda"):
        from trainer.device import resolve_device

        resolve_device(args.device, "--device")  # named as typed, not as training.device
