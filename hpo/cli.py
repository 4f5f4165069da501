"""The `hpo` command line. Bad input becomes one clear line and exit code 2; a traceback only
with --debug.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpo import __version__
from hpo.config import Config, load_config
from hpo.errors import ConfigError, HPOError
from hpo.logs import set_optuna_verbosity, setup_logging
from hpo.stopping import EXIT_INTERRUPTED, StopRequest

if TYPE_CHECKING:
    from storage.engine import Liveness

EXIT_BAD_INPUT = 2
REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"

log = logging.getLogger("hpo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpo",
        description="Hyperparameter optimisation for fine-tuning transformer models. Trials live "
        "in an Optuna study in PostgreSQL or SQLite; run one worker per GPU on the same study.",
    )
    parser.add_argument("--version", action="version", version=f"hpo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
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
        help="seconds after which this worker starts no new trial (overrides study.timeout)",
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
    run.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    run.add_argument("--quiet", action="store_true", help="only warnings and the final summary")
    _add_monitoring_commands(commands)
    finder = commands.add_parser(
        "batch-size",
        help="find the largest physical batch that fits and print what the search did",
        description="Run the batch finder alone on this machine's device: worst-case probes "
        "(every sequence at max_length, forward, backward and an AdamW step, then an "
        "evaluation forward), grown geometrically, then bisected; prints every probe.",
    )
    finder.add_argument("--config", type=Path, required=True, help="YAML config of the study")
    finder.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    finder.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    finder.add_argument("--quiet", action="store_true", help="only warnings and the report")
    return parser


def _add_monitoring_commands(commands: argparse._SubParsersAction) -> None:
    storage_help = "database URL (default: $HPO_STORAGE, then ./hpo.db)"
    studies = commands.add_parser("studies", help="list the studies in the storage")
    best = commands.add_parser("best", help="print the best trial of a study")
    status = commands.add_parser("status", help="summarise a study: states, running, failures")
    dashboard = commands.add_parser("dashboard", help="serve optuna-dashboard on the storage")
    for sub in (studies, best, status, dashboard):
        sub.add_argument("--storage", default=None, help=storage_help)
        sub.add_argument("--debug", action="store_true", help="show tracebacks")
        sub.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    for sub in (best, status):
        sub.add_argument("--study", required=True, help="study name")
    for sub in (studies, best, status):
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    dashboard.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost)")
    dashboard.add_argument("--port", type=int, default=8080, help="port (default 8080)")


def main(argv: Sequence[str] | None = None) -> int:
    # Before CUDA initialises: fewer fragmentation OOMs as batch shapes change between steps.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    _setup_logging(args.debug, args.quiet)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "batch-size":
            return _batch_size(args)
        return _monitor(args)
    except HPOError as e:
        if args.debug:
            log.exception("hpo failed")
        print(f"hpo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("hpo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _setup_logging(debug: bool, quiet: bool) -> None:
    setup_logging(logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)


def _run(args: argparse.Namespace) -> int:
    from storage.url import resolve_storage_url

    config_path = args.config or DEMO_CONFIG
    if args.config is None and not DEMO_CONFIG.is_file():
        raise HPOError("no --config given and the demo config is not installed; pass --config FILE")
    config = load_config(config_path)
    _apply_overrides(config, args)
    storage_url = resolve_storage_url(args.storage, config.study.storage)
    gpus = _worker_gpus(config, args.gpus)
    # Only now the heavy imports: a config or URL error is reported in well under a second.
    from hpo.launcher import run_workers
    from hpo.objective import Objective
    from hpo.study import open_study, run_trials, summary_lines
    from storage import open_storage
    from trainer.data import prepare_data
    from trainer.model import check_model_config, load_tokenizer

    set_optuna_verbosity(logging.getLogger().level)
    # Every input is checked before the database is touched: a bad one writes nothing.
    check_model_config(config.model)
    data = prepare_data(config.data, load_tokenizer(config.model))
    log.info(
        "data: %d training and %d evaluation examples, labels %s",
        len(data.train),
        len(data.eval),
        data.label_names,
    )
    print(f"hpo: study {args.study!r} in {storage_url.describe()}", file=sys.stderr)
    storage = open_storage(
        storage_url, config.study.n_trials, _liveness(config), config.study.database_patience
    )
    study = open_study(storage, args.study, config)
    if len(gpus) > 1:
        code = run_workers(gpus, args.argv)
        print("\n".join(summary_lines(study, config.study.metric)))
        return code
    stop = StopRequest(interrupt_at_once=config.study.trial_isolation == "none")
    stop.install()
    run_trials(study, Objective(config, data, storage_url, stop), stop)
    print("\n".join(summary_lines(study, config.study.metric)))
    if stop.signal_name is not None:
        print(f"hpo: stopped by {stop.signal_name}", file=sys.stderr)
    return stop.exit_code if stop.requested else 0


def _monitor(args: argparse.Namespace) -> int:
    import json

    import optuna

    from hpo import report
    from storage import open_storage, resolve_storage_url

    set_optuna_verbosity(logging.getLogger().level)

    storage_url = resolve_storage_url(args.storage, None)
    storage = open_storage(storage_url)
    if args.command == "dashboard":
        from optuna_dashboard import run_server

        print(f"hpo: dashboard for {storage_url.describe()} on http://{args.host}:{args.port}/")
        run_server(storage, host=args.host, port=args.port)
        return 0
    if args.command == "studies":
        rows = report.studies(storage)
        print(json.dumps(rows, indent=2) if args.json else _studies_table(rows))
        return 0
    try:
        study = optuna.load_study(study_name=args.study, storage=storage)
    except KeyError as e:
        raise HPOError(f"no study {args.study!r} in {storage_url.masked}; see `hpo studies`") from e
    if args.command == "best":
        best = report.best_trial(study)
        if best is None:
            raise HPOError(f"study {args.study!r} has no completed trial yet")
        print(json.dumps(best, indent=2, default=str) if args.json else _best_text(best))
        return 0
    summary = report.status(study)
    print(
        json.dumps(summary, indent=2, default=str)
        if args.json
        else "\n".join(report.status_lines(summary))
    )
    return 0


def _studies_table(rows: list[dict]) -> str:
    if not rows:
        return "no studies"
    lines = [f"{'name':<30} {'direction':<9} {'trials':>6}  best"]
    for row in rows:
        best = "-" if row["best_value"] is None else f"{row['best_value']:.4f}"
        lines.append(f"{row['name']:<30} {row['direction']:<9} {row['n_trials']:>6}  {best}")
    return "\n".join(lines)


def _best_text(best: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    text = f"best trial #{best['number']} of {best['study']!r}: {best['value']:.4f} ({params})"
    model = best["user_attrs"].get("best_model")
    if model:
        text += f"\nmodel: {model} (AutoModelForSequenceClassification.from_pretrained)"
    return text


def _batch_size(args: argparse.Namespace) -> int:
    import json

    from trainer import device as dev
    from trainer.batch_finder import batch_key, find_physical_batch_size
    from trainer.config import TrainJob
    from trainer.data import prepare_data
    from trainer.model import check_model_config, load_tokenizer

    config = load_config(args.config)
    if args.device is not None:
        config.training.device = args.device
    check_model_config(config.model)
    data = prepare_data(config.data, load_tokenizer(config.model))
    job = TrainJob(config.data, config.model, config.training)
    device = dev.resolve_device(config.training.device)
    search = find_physical_batch_size(job, data.label_names, device)
    print(search.report())
    key = batch_key(job, device, dev.resolve_precision(config.training.precision, device))
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


def _liveness(config: Config) -> Liveness:
    from storage.engine import Liveness

    study = config.study
    grace = study.grace_period or 3 * study.heartbeat_interval
    return Liveness(study.heartbeat_interval, grace, study.max_retries)


def _apply_overrides(config: Config, args: argparse.Namespace) -> None:
    problems = []
    if args.n_trials is not None:
        if args.n_trials < 1:
            problems.append(f"--n-trials: got {args.n_trials}; must be a positive integer")
        config.study.n_trials = args.n_trials
    if args.timeout is not None:
        if args.timeout <= 0:
            problems.append(f"--timeout: got {args.timeout}; must be > 0 seconds")
        config.study.timeout = args.timeout
    if args.gpus is not None and args.device is not None:
        problems.append("--device: cannot be combined with --gpus, which sets each worker's GPU")
    if args.device is not None:
        config.training.device = args.device
        for key, value, rule in config.training.problems():
            if key == "device":
                problems.append(f"--device: got {value!r}; {rule}")
    if problems:
        raise ConfigError(problems, "command line")
