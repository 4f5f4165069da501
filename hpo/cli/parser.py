"""The hpo command's arguments: every command, flag and help text, and the checks of a value's form
(a port, a host, a count) made while parsing.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path
from typing import NoReturn

from hpo.commands.launcher import MAX_WORKERS_PER_GPU
from hpo.config.loader import DEMO_CONFIG
from hpo.config.schema import DATABASE_PATIENCE_S


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            option = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += f"; a value that begins with '-' is written {option}=VALUE"
        super().error(message)


class _VersionAction(argparse.Action):
    """--version: what a bug report needs, torch imported only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        from hpo.version import version_report

        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--gpu 0,1` must not silently mean `--gpus` (and then reach the worker
    # processes, whose arguments are the user's minus the exact `--gpus`).
    parser = _Parser(
        prog="hpo",
        allow_abbrev=False,
        description="Hyperparameter optimisation for fine-tuning transformer models. Trials live "
        "in an Optuna study in PostgreSQL or SQLite; run one worker per GPU on the same study.",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="show hpo's version, Python's, torch's, transformers' and Optuna's, and the device",
    )
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
        help=f"YAML config (default: the demo's, {DEMO_CONFIG})",
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
        "--budget-device-hours",
        type=float,
        default=None,
        help="device-hours for the whole study, across all workers: once spent, no trial "
        "starts and running ones finish (overrides study.budget_device_hours)",
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
    run.add_argument(
        "--tracking",
        default=None,
        metavar="URI",
        help="log the trials to this MLflow tracking server (overrides tracking.mlflow.uri and "
        "$MLFLOW_TRACKING_URI; needs pip install 'hpo[mlflow]')",
    )
    run.add_argument(
        "--allow-changed-setup",
        action="store_true",
        help="join the study although its data (sha256 of the train and eval files), model, "
        "task, data.max_length, evaluation schedule (training.evals_per_epoch, epochs, "
        "max_steps) or pruner differ from this config's; without it such a worker is refused "
        "(exit 2), as its trials would not compare with the study's. The change is recorded "
        "in the study and `hpo status` says the study mixes setups",
    )
    run.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    run.add_argument("--quiet", action="store_true", help="only warnings and the final summary")
    _add_monitoring_commands(commands)
    _add_enqueue_command(commands)
    _add_copy_command(commands)
    _add_retrain_command(commands)
    _add_predict_command(commands)
    _add_ensemble_command(commands)
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
    finder.add_argument(
        "--max",
        type=functools.partial(_count, "--max", 1_048_576),
        default=None,
        metavar="N",
        help="search no further than N (default: training.batch_search_max); hpo run searches "
        "up to what its search space's largest effective batch needs",
    )
    finder.add_argument("--json", action="store_true", help="print the search as JSON")
    finder.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    finder.add_argument("--quiet", action="store_true", help="only warnings and the report")
    return parser


def _add_retrain_command(commands: argparse._SubParsersAction) -> None:
    from hpo.study.retrain import MAX_SEEDS, MAX_TOP

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
        "--config",
        type=Path,
        default=None,
        help="YAML config the study ran with (default: the demo config)",
    )
    retrain.add_argument(
        "--storage",
        default=None,
        help="database URL (default: $HPO_STORAGE, then the config's study.storage, then ./hpo.db)",
    )
    retrain.add_argument(
        "--top",
        type=functools.partial(_count, "--top", MAX_TOP),
        default=3,
        help="configurations to retrain, best first (default 3)",
    )
    retrain.add_argument(
        "--seeds",
        type=functools.partial(_count, "--seeds", MAX_SEEDS),
        default=3,
        help="new seeds per configuration (default 3)",
    )
    retrain.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the final model (default: hpo-final-<study> here)",
    )
    retrain.add_argument(
        "--full-data",
        action="store_true",
        help="then train the winner once more on the training and evaluation splits together "
        "and save that model; its metric is then the mean of the held-out retrain runs",
    )
    retrain.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    retrain.add_argument(
        "--gpus",
        default=None,
        help="one worker per GPU of this host, as for hpo run: auto, none or ids like 0,1,3",
    )
    retrain.add_argument(
        "--register",
        default=None,
        metavar="NAME",
        help="register the final model in MLflow's model registry as a new version of NAME, "
        "its model card as the version's description (needs MLflow tracking: tracking.mlflow "
        "in the config or --tracking)",
    )
    retrain.add_argument(
        "--tracking",
        default=None,
        metavar="URI",
        help="log the runs to this MLflow tracking server (overrides tracking.mlflow.uri and "
        "$MLFLOW_TRACKING_URI; needs pip install 'hpo[mlflow]')",
    )
    retrain.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    retrain.add_argument("--quiet", action="store_true", help="only warnings and the summary")
    # A worker of `--gpus` runs trials only; its launcher waits, picks and saves.
    retrain.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    retrain.set_defaults(n_trials=None, timeout=None, trial_timeout=None, workers_per_gpu=None)


def _add_predict_command(commands: argparse._SubParsersAction) -> None:
    predict = commands.add_parser(
        "predict",
        allow_abbrev=False,
        help="predict with a saved model: labels and probabilities, values or tags per word",
        description="Run a saved model (a final model of hpo retrain, a trial's model from hpo "
        "best --download, a LoRA adapter, a soup) on every row of a CSV or JSONL file shaped as "
        "its training data (the text columns it was trained on; no labels needed). Rows are "
        "read and written in batches, on the GPU when there is one; the predictions are written "
        "beside --out and renamed in once whole. Causal LMs are refused: predict does not "
        "generate text.",
    )
    predict.add_argument("--model", required=True, metavar="DIR", help="the model's folder")
    predict.add_argument(
        "--input", required=True, metavar="FILE", help="rows to predict: a .csv or .jsonl file"
    )
    predict.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="where the predictions go: .csv or .jsonl (the suffix picks the format)",
    )
    predict.add_argument(
        "--id-column",
        default=None,
        metavar="NAME",
        help="the input's column written beside each prediction (default: the row's number, "
        "from 1, in a column `row`)",
    )
    predict.add_argument(
        "--batch-size",
        type=functools.partial(_count, "--batch-size", 65_536),
        default=32,
        metavar="N",
        help="rows per forward pass (default 32)",
    )
    predict.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    predict.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    predict.add_argument("--quiet", action="store_true", help="print nothing when done")


def _add_ensemble_command(commands: argparse._SubParsersAction) -> None:
    ensemble = commands.add_parser(
        "ensemble",
        allow_abbrev=False,
        help="combine a study's top models (or hpo retrain's) into a stacked ensemble",
        description="Each member predicts the evaluation split (and data.test_file's, when set) "
        "once, cached by its weights' and the file's sha256; soft voting, greedy selection and "
        "each meta-learner are scored on the test split or by K-fold cross-validation, and the "
        "winner is saved in --out with a model card (the best member when stacking is no better).",
    )
    ensemble.add_argument("--study", default=None, help="the study whose top trials are members")
    ensemble.add_argument(
        "--storage", default=None, help="database URL (default: $HPO_STORAGE, then ./hpo.db)"
    )
    ensemble.add_argument(
        "--config",
        default=None,
        help="the config the study ran with (default: the data files the study recorded; "
        "needed for data.test_file and with --from-retrain)",
    )
    ensemble.add_argument(
        "--test-file",
        default=None,
        metavar="FILE",
        help="a held-out .csv or .jsonl no trial saw, to score every candidate on (default: "
        "the config's data.test_file, else the one the study recorded if unchanged)",
    )
    ensemble.add_argument(
        "--top",
        type=functools.partial(_count, "--top", 100),
        default=5,
        metavar="K",
        help="the K best completed trials that kept a model (default 5)",
    )
    ensemble.add_argument(
        "--from-retrain",
        nargs="+",
        default=[],
        metavar="DIR",
        help="hpo retrain --out folders as the members, instead of the study's trials",
    )
    _add_ensemble_options(ensemble)


def _add_ensemble_options(ensemble: argparse.ArgumentParser) -> None:
    ensemble.add_argument(
        "--learner",
        action="append",
        default=[],
        metavar="NAME",
        help="a meta-learner to fit (default: logistic_regression; ridge for regression); "
        "repeat to try several, or give all for every installed one: the best by "
        "cross-validation is kept",
    )
    ensemble.add_argument(
        "--features",
        choices=["predictions", "embedding"],
        default="predictions",
        help="what the meta-learner reads: the members' probabilities (default) or their "
        "mean-pooled last hidden states, scaled",
    )
    ensemble.add_argument(
        "--pca",
        type=functools.partial(_count, "--pca", 4096),
        default=None,
        metavar="N",
        help="scale the features and keep N principal components",
    )
    ensemble.add_argument(
        "--soup",
        choices=["uniform", "greedy", "none"],
        default="none",
        help="also average the members' weights (members of one base model): one model's cost",
    )
    ensemble.add_argument("--out", required=True, metavar="DIR", help="the new folder to write")
    ensemble.add_argument(
        "--batch-size",
        type=functools.partial(_count, "--batch-size", 65_536),
        default=32,
        metavar="N",
        help="rows per forward pass (default 32)",
    )
    ensemble.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    ensemble.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    ensemble.add_argument("--quiet", action="store_true", help="print nothing when done")


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
        "--config",
        type=Path,
        default=None,
        help="YAML config of the study (default: the search space the study was created with)",
    )
    enqueue.add_argument(
        "--storage",
        default=None,
        help="database URL (default: $HPO_STORAGE, then the config's study.storage, then ./hpo.db)",
    )
    enqueue.add_argument("--debug", action="store_true", help="show tracebacks")
    enqueue.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)


def _add_copy_command(commands: argparse._SubParsersAction) -> None:
    copy = commands.add_parser(
        "copy",
        allow_abbrev=False,
        help="copy a study to another database (SQLite to PostgreSQL and back)",
        description="Copy a study, every trial with its values, intermediate values, parameters "
        "and attributes, and the database's batch-size records, into another database. The "
        "copy is published whole at its end, or not at all; a target that already holds a "
        "study of that name is refused. Workers then run it there as before.",
    )
    copy.add_argument("--study", required=True, help="the study to copy")
    copy.add_argument(
        "--from", dest="source", required=True, metavar="URL", help="database URL that holds it"
    )
    copy.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="URL",
        help="database URL to copy it into (a new SQLite file is created)",
    )
    copy.add_argument(
        "--to-study", default=None, metavar="NAME", help="the copy's name (default: the study's)"
    )
    copy.add_argument(
        "--allow-running",
        action="store_true",
        help="copy a study whose trials are running, as it stands; in the copy they are "
        "failed as stale and queued again (default: refused)",
    )
    copy.add_argument("--debug", action="store_true", help="show tracebacks")
    copy.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)


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
        "--watch",
        action="store_true",
        help="refresh until the study ends (no trial running or queued, its budget spent)",
    )
    status.add_argument(
        "--interval", type=_seconds, default=5.0, help="seconds between refreshes (default 5)"
    )
    status.add_argument(
        "--notify",
        default=None,
        metavar="CONFIG",
        help="with --watch: say through the study.notify of this config file when the study "
        "stalls (no trial runs with a live worker for study.notify.stall_after seconds)",
    )
    report.add_argument(
        "--out",
        default=None,
        help="file or existing folder to write to (default: hpo-report-<study>.html here; "
        "Markdown: standard output)",
    )
    for sub in (studies, best, status):
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    for sub in (studies, best, status, report):
        sub.add_argument(
            "--database-patience",
            type=_seconds,
            default=DATABASE_PATIENCE_S,
            metavar="SECONDS",
            help="how long a read rides out a study database that drops out, as the workers do "
            f"(default {DATABASE_PATIENCE_S:g}, as study.database_patience)",
        )
    for sub in (best, status):
        sub.add_argument(
            "--artifact-store",
            default=None,
            help="the study's artifact store (default: $HPO_ARTIFACT_STORE, then the one its "
            "workers recorded)",
        )
    best.add_argument(
        "--download",
        default=None,
        metavar="DIR",
        help="fetch the best model from the artifact store into DIR (new or empty), every file "
        "checked against its sha256",
    )
    best.add_argument(
        "--merge",
        action="store_true",
        help="with --download, of a LoRA study: merge the adapter into its base model and write "
        "a plain model (default: the adapter, which peft loads on the base model)",
    )
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"got {text!r}; give seconds from 0.1 to 3600, e.g. 5")
    return value
