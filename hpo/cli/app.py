"""`main()`: parse the arguments, run the command, and turn its end into an exit code: bad
input is one clear line and exit code 2 (a traceback only with --debug), a database outage past
its window one line and exit code 1, a signal its own code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from hpo.cli.parser import build_parser
from hpo.commands.batch_size import batch_size_command
from hpo.commands.copy import CopyRequest, copy_command
from hpo.commands.enqueue import enqueue_command
from hpo.commands.ensemble import EnsembleRequest, ensemble_command
from hpo.commands.monitor import monitor_command
from hpo.commands.predict import PredictRequest, predict_command
from hpo.commands.requests import RetrainRequest, RunRequest
from hpo.commands.retrain import retrain_command
from hpo.commands.run import (
    configure_logging,
    run_command,
)
from hpo.errors import USER_ERRORS
from hpo.reports.text import CLOSED_STDOUT, emit, stdout_is_closed
from hpo.stopping import stopped_exit_code
from hpo.storage.errors import DatabaseUnreachable
from hpo.storage.url import mask_text

EXIT_BAD_INPUT = 2
# Nothing the user typed is wrong: the same command works once the database is back.
EXIT_DATABASE_UNREACHABLE = 1

log = logging.getLogger("hpo")


def _config(args: argparse.Namespace) -> int:
    from hpo.config.json_schema import schema_text

    emit(schema_text(), end="")
    return 0


def main(argv: Sequence[str] | None = None, own_process: bool = False) -> int:
    """`own_process`: this process is the `hpo` command and nothing else ran in it (entry()):
    a worker may then copy itself into its trial processes' fork server (hpo.trial.worker_copy).
    Called in a process of the user's (a test, a script), it starts that server afresh."""
    # Before CUDA initialises: fewer fragmentation OOMs as batch shapes change between steps.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.monotonic()  # --timeout counts from here
    argv = list(sys.argv[1:] if argv is None else argv)
    if stdout_is_closed():  # every command answers there: refused before it does anything
        print(f"hpo: error: {CLOSED_STDOUT}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt as e:
        return _stopped(e)
    args.argv, args.started, args.own_process = argv, started, own_process
    configure_logging(args.debug, args.quiet)
    try:
        if args.command == "run":
            return run_command(run_request(args))
        if args.command == "batch-size":
            return batch_size_command(args)
        if args.command == "enqueue":
            return enqueue_command(args)
        if args.command == "copy":
            return copy_command(copy_request(args))
        if args.command == "retrain":
            return retrain_command(retrain_request(args))
        if args.command == "predict":
            return predict_command(predict_request(args))
        if args.command == "ensemble":
            return ensemble_command(ensemble_request(args))
        if args.command == "config":
            return _config(args)
        return monitor_command(args)
    except USER_ERRORS as e:
        if args.debug:
            log.exception("hpo failed")
        # Any URL the message quotes (a tracking URI, a storage URL) is shown masked.
        print(f"hpo: error: {mask_text(str(e))}", file=sys.stderr)
        return EXIT_DATABASE_UNREACHABLE if isinstance(e, DatabaseUnreachable) else EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        return _stopped(e)
    except BrokenPipeError:
        # `hpo status | head`: the reader has gone; nothing left to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def run_request(args: argparse.Namespace) -> RunRequest:
    """The request of `hpo run`'s flags (and retrain's, which share its worker's part), as
    parsed by main(): `argv`, `started` and `own_process` set there."""
    return RunRequest(
        study=args.study,
        config=args.config,
        storage=args.storage,
        n_trials=args.n_trials,
        budget_device_hours=getattr(args, "budget_device_hours", None),
        timeout=args.timeout,
        trial_timeout=args.trial_timeout,
        device=args.device,
        gpus=args.gpus,
        workers_per_gpu=args.workers_per_gpu,
        artifact_store=getattr(args, "artifact_store", None),
        tracking=args.tracking,
        allow_changed_setup=getattr(args, "allow_changed_setup", False),
        quiet=args.quiet,
        own_process=args.own_process,
        argv=tuple(args.argv),
        started=args.started,
    )


def retrain_request(args: argparse.Namespace) -> RetrainRequest:
    """The request of `hpo retrain`'s flags."""
    return RetrainRequest(
        run=run_request(args),
        out=args.out,
        top=args.top,
        seeds=args.seeds,
        full_data=args.full_data,
        register=args.register,
        as_worker=args.as_worker,
    )


def copy_request(args: argparse.Namespace) -> CopyRequest:
    """The request of `hpo copy`'s flags."""
    return CopyRequest(
        study=args.study,
        source=args.source,
        target=args.target,
        to_study=args.to_study,
        allow_running=args.allow_running,
    )


def predict_request(args: argparse.Namespace) -> PredictRequest:
    """The request of `hpo predict`'s flags."""
    return PredictRequest(
        model=args.model,
        input=args.input,
        out=args.out,
        id_column=args.id_column,
        batch_size=args.batch_size,
        device=args.device,
        quiet=args.quiet,
    )


def ensemble_request(args: argparse.Namespace) -> EnsembleRequest:
    """The request of `hpo ensemble`'s flags."""
    return EnsembleRequest(
        out=args.out,
        study=args.study,
        storage=args.storage,
        config=args.config,
        top=args.top,
        from_retrain=tuple(args.from_retrain),
        learners=tuple(args.learner),
        features=args.features,
        pca=args.pca,
        soup=args.soup,
        device=args.device,
        batch_size=args.batch_size,
        quiet=args.quiet,
        test_file=args.test_file,
    )


def _stopped(interrupt: KeyboardInterrupt) -> int:
    name = getattr(interrupt, "signal_name", "SIGINT")
    print(f"hpo: stopped by {name}", file=sys.stderr)
    return stopped_exit_code(name)
