"""hpo's Python API: `run()` starts a worker on a study, `open_study()` reads one. A thin, typed
front over the workflows the CLI runs (hpo.commands), so both check, fail and write alike.

    import hpo

    result = hpo.run("configs/demo.yaml", study="demo", n_trials=4)
    study = hpo.open_study("demo")
    print(study.best().metrics, study.best().params)
    study.download("best-model")  # with an artifact store: the model, sha256 checked

Every error is one of hpo's (hpo.HPOError, hpo.ConfigError, hpo.DataError, ...) with the line
`hpo` prints; a password in a storage URL is never in it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.api import showing
from hpo.api.study import STATES, Study, Trial, _dispose, _trial
from hpo.errors import ConfigError, HPOError

if TYPE_CHECKING:
    from hpo.commands.predict import Model
    from hpo.commands.requests import RunRequest

__all__ = ["STATES", "RunResult", "Study", "Trial", "load_model", "open_study", "run"]

log = logging.getLogger("hpo")

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What `run()` did: the trials this worker ran and the study's best when it ended."""

    study: str
    trials_run: int | None
    """Trials this worker finished (other workers on the same study ran the rest; a trial
    stopped by a signal and handed back is not counted); None when worker processes ran them
    (`gpus`, `workers_per_gpu`): see `trials` for the study's count."""
    best: Trial | None
    """The study's best trial (one objective); None before one completes."""
    pareto_front: tuple[Trial, ...]
    """With several objectives, the trials of the study's Pareto front; empty otherwise."""
    trials: dict[str, int]
    """The study's trials by state, e.g. {"complete": 3, "pruned": 1}."""
    stopped_by: str | None
    """SIGINT or SIGTERM when a signal stopped the worker (its running trial handed back for
    another worker or a later run); None when it ran to its budget or timeout."""
    storage: str | None = None
    """Where the study is (its database, a password masked)."""
    budget: int | None = None
    """The study's n_trials as this run had it; None: no budget (a timeout, or until stopped)."""

    def summary(self) -> str:
        """What the run did in two or three lines: the trials it ran (or why none), the
        study's trials and best, and where it is. hpo.run prints it as it ends."""
        from hpo.api.showing import summary_lines

        return "\n".join(summary_lines(self))

    def _repr_html_(self) -> str:
        from hpo.api.showing import result_html

        return result_html(self)


def run(
    config: ConfigSource,
    *,
    study: str,
    storage: str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float | None = None,
    budget_device_hours: float | None = None,
    device: str | None = None,
    artifact_store: str | None = None,
    gpus: str | Sequence[int | str] | None = None,
    workers_per_gpu: int | str | None = None,
    allow_changed_setup: bool = False,
    entrypoint: str | Callable[..., Any] | None = None,
    quiet: bool = False,
) -> RunResult:
    """Run a worker on `study`, as `hpo run` does, in this process: create or join the study,
    then run trials until the study holds `n_trials` (counted across every worker) or
    `timeout` seconds pass. Every input is checked before anything is written.

    `config`: a YAML file's path, or a dict of the same sections (checked by the same rules;
    its relative paths are taken from the working folder). `storage`: a database URL (default:
    $HPO_STORAGE, then the config's study.storage, then ./hpo.db). `n_trials`, `timeout`,
    `trial_timeout`, `budget_device_hours`, `device` and `artifact_store` override the config
    as the CLI's flags do.
    A SIGINT or SIGTERM (in the main thread) stops the running trial cleanly and returns.

    `gpus` ("auto", "none", "0,1" or [0, 1]) and `workers_per_gpu` (a number, or "auto"), as
    `hpo run --gpus` / `--workers-per-gpu`: one worker process per GPU of this host (or N
    sharing each), all started from here and waited for; they read the config from its file,
    so give a path. `storage` and `artifact_store` reach them through their environment,
    never their command line (a password would show in `ps`).

    `allow_changed_setup`, as `hpo run --allow-changed-setup`: join a study whose data, model,
    evaluation schedule or pruner differ from this config's (recorded in the study); without
    it such a join is refused with a ConfigError that names each difference.

    `entrypoint`: the training function (training.entrypoint, set over the config's), as a
    function object or its import path. A function, metrics function or search space defined
    in a notebook cell or `python -c` is sent to each trial process by value (cloudpickle):
    give it as an object, or in the config as `__main__:name`.

    It prints a short summary as it ends (the trials it ran, or why none, the best trial and
    where the study is); in a Jupyter notebook it shows its progress in one display updated
    in place, and a kernel interrupt stops the running trial and hands it back. `quiet`:
    neither.

    Raises hpo.ConfigError for a bad config or argument, another hpo.HPOError (or
    hpo.TrainerError, hpo.StorageError) for anything else the user can fix."""
    from hpo.commands.requests import RunRequest
    from hpo.commands.run import run_study
    from hpo.logs import quiet_library_output

    started = time.monotonic()  # the timeout counts from here, data preparation included
    _check_not_in_a_trial_process()
    _check_main_guard(sys._getframe(1))
    _check_overrides(
        n_trials,
        timeout,
        trial_timeout,
        study,
        storage=storage,
        device=device,
        artifact_store=artifact_store,
    )
    gpu_list, per_gpu = _gpu_options(gpus, workers_per_gpu, config)
    from hpo.study.names import checked_study_name

    study = checked_study_name(study, "study")  # NFC: the name the study is stored under
    from hpo.plugins import by_value

    by_value.forget()  # a function of an earlier run (a cell run before) is not this one's
    config = _functions_named(config)
    spec = None if entrypoint is None else _entrypoint_spec(entrypoint)
    if spec is not None and (gpu_list is not None or per_gpu is not None):
        raise ConfigError(
            ["entrypoint: with gpus or workers_per_gpu, name it in the config file instead"],
            "hpo.run",
        )
    notebook = not quiet and showing.in_notebook()
    # Before CUDA initialises: fewer fragmentation OOMs as batch shapes change between steps.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    quiet_library_output()
    request = RunRequest(
        study=study,
        config=config,
        storage=storage,
        n_trials=n_trials,
        timeout=timeout,
        trial_timeout=trial_timeout,
        budget_device_hours=budget_device_hours,
        device=device,
        artifact_store=artifact_store,
        started=started,
        gpus=gpu_list,
        workers_per_gpu=per_gpu,
        allow_changed_setup=allow_changed_setup,
        entrypoint=spec,
        quiet=True,  # no terminal line: the notebook's display, or nothing
        in_notebook=notebook,
        from_python=True,
    )
    if gpu_list is not None or per_gpu is not None:
        argv, env = _worker_command(request)
        request = dataclasses.replace(request, argv=tuple(argv), worker_env=env)
    progress = showing.NotebookProgress() if notebook else None
    with _signals_restored(), _progress_shown(progress):
        outcome = run_study(request, say=log.info)
    try:
        result = _result(study, outcome)
    finally:
        _dispose(outcome.storage)  # a long-lived caller (a notebook) keeps no connection
    if progress is not None:
        progress.show(result.summary())
    elif not quiet:
        print(result.summary(), file=sys.stderr, flush=True)
    return result


@contextlib.contextmanager
def _progress_shown(progress: showing.NotebookProgress | None) -> Iterator[None]:
    from hpo import live

    if progress is not None:
        live.show_on(progress)
    try:
        yield
    finally:
        live.stop()


def _functions_named(config: ConfigSource) -> ConfigSource:
    """A config mapping with each function object where an import path goes (a callable as
    training.entrypoint, metrics, model.factory, task or search_space) named by its path,
    or kept to be sent to the trial processes by value."""
    from hpo.plugins import by_value

    if not isinstance(config, Mapping):
        return config
    copied = dict(config)
    for section, key in _PLUGIN_KEYS:
        holder = copied if section is None else copied.get(section)
        if not isinstance(holder, Mapping) or not _is_code(holder.get(key)):
            continue
        name = key if section is None else f"{section}.{key}"
        spec = by_value.spec_of(holder[key], name, classes=key == "task")
        if section is None:
            copied[key] = spec
        else:
            copied[section] = {**holder, key: spec}
    return copied


_PLUGIN_KEYS = (
    ("training", "entrypoint"),
    (None, "metrics"),
    ("model", "factory"),
    (None, "task"),
    (None, "search_space"),
)


def _is_code(value: object) -> bool:
    return callable(value) and not isinstance(value, (str, os.PathLike))


def _entrypoint_spec(entrypoint: object) -> str:
    from hpo.plugins import by_value

    if isinstance(entrypoint, str):
        return entrypoint
    return by_value.spec_of(entrypoint, "entrypoint")  # type: ignore[arg-type]


def _result(name: str, outcome: Any) -> RunResult:
    if outcome.study is None:
        return RunResult(name, 0, None, (), {}, outcome.stopped_by, outcome.where)
    front = [_trial(summary, outcome.study.metric_names) for summary in _best(outcome.study)]
    several = len(outcome.study.directions) > 1
    return RunResult(
        study=name,
        trials_run=outcome.trials_run,
        best=front[0] if front and not several else None,
        pareto_front=tuple(front) if several else (),
        trials=_counts(outcome.study),
        stopped_by=outcome.stopped_by,
        storage=outcome.where,
        budget=outcome.config.study.n_trials if outcome.config is not None else None,
    )


def open_study(name: str, storage: str | None = None) -> Study:
    """The study `name` in `storage` (default: $HPO_STORAGE, then ./hpo.db), to read: nothing is
    created or written, not even a database file for a mistyped URL. Raises hpo.HPOError when
    there is no such study, hpo.StorageError when the database cannot be reached."""
    from hpo.services import load_existing_study, open_storage_to_read

    if not isinstance(name, str):
        raise ConfigError([f"name: got {name!r}; give the study's name as text"], "open_study")
    opened, storage_url = open_storage_to_read(storage, flag="storage")
    try:
        empty = "name: the study name is empty; `hpo studies` lists the names"
        study = load_existing_study(opened, name, storage_url.masked, empty)
    except BaseException:
        _dispose(opened)
        raise
    return Study(study, opened, storage_url.masked)


def load_model(
    folder: str | os.PathLike[str], *, device: str = "auto", batch_size: int = 32
) -> Model:
    """A saved model (hpo retrain's, a trial's, a LoRA adapter, a soup) to predict with:
    `.predict(rows)` (dicts with the training data's text columns), `.task`, `.labels`."""
    from hpo.commands.predict import load_model as load

    return load(folder, device=device, batch_size=batch_size)


def _check_overrides(
    n_trials: object, timeout: object, trial_timeout: object, study: object, **texts: object
) -> None:
    """run()'s own arguments, every problem at once, named as the arguments are."""
    problems = []
    if not isinstance(study, str):
        problems.append(f"study: got {study!r}; give the study's name as text")
    for name, text in texts.items():
        if text is not None and not isinstance(text, str):
            problems.append(f"{name}: got {text!r}; give it as text (a string) or leave it out")
    if n_trials is not None and (type(n_trials) is not int or n_trials < 1):
        problems.append(f"n_trials: got {n_trials!r}; must be a positive integer")
    for name, seconds in (("timeout", timeout), ("trial_timeout", trial_timeout)):
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if seconds is not None and not (number and 0 < seconds < math.inf):  # type: ignore[operator]
            problems.append(f"{name}: got {seconds!r}; must be a finite number > 0 seconds")
    if problems:
        raise ConfigError(problems, "hpo.run")


def _gpu_options(
    gpus: object, workers_per_gpu: object, config: object
) -> tuple[str | None, int | str | None]:
    """run()'s `gpus` as `--gpus` takes it ("0,1"), and `workers_per_gpu` checked as
    `--workers-per-gpu` is; the config must be a file for the worker processes to read."""
    from hpo.commands.launcher import MAX_WORKERS_PER_GPU

    problems = []
    spec: str | None = None
    if isinstance(gpus, str):
        spec = gpus
    elif isinstance(gpus, Sequence) and all(
        isinstance(g, (int, str)) and not isinstance(g, bool) for g in gpus
    ):
        spec = ",".join(str(g) for g in gpus) or " "
    elif gpus is not None:
        problems.append(f"gpus: got {gpus!r}; give 'auto', 'none', or GPU ids like [0, 1] or '0,1'")
    per_gpu = workers_per_gpu
    if isinstance(per_gpu, str) and per_gpu.strip().lower() == "auto":
        per_gpu = "auto"
    elif per_gpu is not None and (
        type(per_gpu) is not int or not 1 <= per_gpu <= MAX_WORKERS_PER_GPU
    ):
        problems.append(
            f"workers_per_gpu: got {per_gpu!r}; give 1 to {MAX_WORKERS_PER_GPU} "
            "workers per GPU, or 'auto'"
        )
    if (spec is not None or per_gpu is not None) and not isinstance(config, (str, os.PathLike)):
        problems.append(
            "config: with gpus or workers_per_gpu, give the config as a file path: "
            "each worker is a process of its own that reads it"
        )
    if problems:
        raise ConfigError(problems, "hpo.run")
    return spec, per_gpu  # type: ignore[return-value]


def _worker_command(request: RunRequest) -> tuple[list[str], dict[str, str]]:
    """The `hpo` arguments and environment of each worker process that run(gpus=...) starts:
    the same run, with the storage and artifact store in the environment, where no other user
    of the host can read them (a command line shows in `ps`)."""
    assert isinstance(request.config, (str, os.PathLike))  # _gpu_options: a file with gpus
    argv = ["run", "--config", os.fspath(request.config), "--study", request.study]
    for name in ("n_trials", "timeout", "trial_timeout", "budget_device_hours"):
        value = getattr(request, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if request.allow_changed_setup:
        argv.append("--allow-changed-setup")
    env = {}
    if request.storage is not None:
        env["HPO_STORAGE"] = request.storage
    if request.artifact_store is not None:
        env["HPO_ARTIFACT_STORE"] = request.artifact_store
    return argv, env


def _check_not_in_a_trial_process() -> None:
    """A trial process (and multiprocessing's fork server) runs the caller's script as
    multiprocessing does, as module `__mp_main__`: a run() at its top level would start a
    worker again there. While that import runs, a module of that name is not the process's
    `__main__` (elsewhere multiprocessing makes `__mp_main__` an alias of `__main__`, one named
    `__main__` that a notebook's kernel may have replaced since)."""
    main = sys.modules.get("__main__")
    importing = sys.modules.get("__mp_main__", main)
    if importing is not main and getattr(importing, "__name__", None) == "__mp_main__":
        script = getattr(importing, "__file__", None) or "your script"
        raise HPOError(
            f"hpo.run() ran again in a trial process that imported {script}: put "
            'the call under `if __name__ == "__main__":`, as multiprocessing '
            "requires of a script that starts processes"
        )


def _check_main_guard(caller: types.FrameType | None) -> None:
    """Refuse, before the first trial, a run() at the top level of a script outside
    `if __name__ == "__main__":`. Trial processes import the script (as multiprocessing does),
    which would start the run again in each: every trial failed with a multiprocessing
    traceback and the budget burned (issue 42). Checked in the script's source; a call from
    a function, a notebook or an interactive session is left alone."""
    if caller is None or caller.f_code.co_name != "<module>":
        return
    if caller.f_globals.get("__name__") != "__main__":
        return
    script = caller.f_globals.get("__file__")
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8")) if script else None
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    if tree is None or _under_main_guard(tree, caller.f_lineno):
        return
    raise HPOError(
        f"hpo.run() is called at the top level of {script} (line "
        f'{caller.f_lineno}) outside `if __name__ == "__main__":`; each trial '
        "process imports the script and would run it again: put the call under "
        "that guard"
    )


def _under_main_guard(tree: ast.Module, line: int) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            last = node.body[-1].end_lineno or node.body[-1].lineno
            if node.body[0].lineno <= line <= last:
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The caller's SIGINT and SIGTERM handlers back once the run ends (the worker installs its
    own to stop a trial cleanly)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _best(study: Any) -> list[dict[str, Any]]:
    from hpo.reports import status as report

    return report.best_trials(study)


def _counts(study: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        state = trial.state.name.lower()
        counts[state] = counts.get(state, 0) + 1
    return counts
