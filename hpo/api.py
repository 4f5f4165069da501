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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.errors import ConfigError, HPOError

if TYPE_CHECKING:
    from hpo.commands.predict import Model
    from hpo.commands.requests import RunRequest

log = logging.getLogger("hpo")

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]
STATES = ("running", "waiting", "complete", "pruned", "fail")  # Optuna's, as hpo status says


@dataclasses.dataclass(frozen=True)
class Trial:
    """One trial of a study, as it was when read."""

    number: int
    """The trial's number in its study, from 0 (the dashboard's and `hpo status`' #N)."""
    state: str
    """running, waiting (queued), complete, pruned or fail."""
    values: tuple[float, ...] | None
    """The objectives' values of a complete trial, in the study's order; None otherwise."""
    metrics: dict[str, float]
    """The same values by objective name (study.metric, study.objectives): {"accuracy": 0.9}."""
    params: dict[str, Any]
    """The sampled parameters, by search-space name (learning_rate, effective_batch_size...)."""
    user_attrs: dict[str, Any]
    """What hpo recorded of the trial: physical_batch_size, grad_accum_steps, samples_per_s,
    peak_mem_bytes, best_model, prune_reason, fail_reason, wall_s..."""

    @property
    def value(self) -> float | None:
        """The value of a study with one objective; None for several or an unfinished trial."""
        return self.values[0] if self.values is not None and len(self.values) == 1 else None

    @property
    def physical_batch_size(self) -> int | None:
        """The micro-batch the batch finder chose (the sampled effective batch is this times
        grad_accum_steps)."""
        return _int_or_none(self.user_attrs.get("physical_batch_size"))

    @property
    def grad_accum_steps(self) -> int | None:
        return _int_or_none(self.user_attrs.get("grad_accum_steps"))

    @property
    def model(self) -> str | None:
        """Where the trial's best model is: its artifact-store URI, else its local folder."""
        found = self.user_attrs.get("best_model_uri") or self.user_attrs.get("best_model")
        return found if isinstance(found, str) else None

    @property
    def reason(self) -> str | None:
        """Why a pruned or failed trial ended (oom, timeout, the error's line...)."""
        found = self.user_attrs.get("prune_reason") or self.user_attrs.get("fail_reason")
        return found if isinstance(found, str) else None


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


def run(
    config: ConfigSource,
    *,
    study: str,
    storage: str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    trial_timeout: float | None = None,
    device: str | None = None,
    artifact_store: str | None = None,
    gpus: str | Sequence[int | str] | None = None,
    workers_per_gpu: int | str | None = None,
    allow_changed_setup: bool = False,
) -> RunResult:
    """Run a worker on `study`, as `hpo run` does, in this process: create or join the study,
    then run trials until the study holds `n_trials` (counted across every worker) or
    `timeout` seconds pass. Every input is checked before anything is written.

    `config`: a YAML file's path, or a dict of the same sections (checked by the same rules;
    its relative paths are taken from the working folder). `storage`: a database URL (default:
    $HPO_STORAGE, then the config's study.storage, then ./hpo.db). `n_trials`, `timeout`,
    `trial_timeout`, `device` and `artifact_store` override the config as the CLI's flags do.
    A SIGINT or SIGTERM (in the main thread) stops the running trial cleanly and returns.

    `gpus` ("auto", "none", "0,1" or [0, 1]) and `workers_per_gpu` (a number, or "auto"), as
    `hpo run --gpus` / `--workers-per-gpu`: one worker process per GPU of this host (or N
    sharing each), all started from here and waited for; they read the config from its file,
    so give a path. `storage` and `artifact_store` reach them through their environment,
    never their command line (a password would show in `ps`).

    `allow_changed_setup`, as `hpo run --allow-changed-setup`: join a study whose data, model,
    evaluation schedule or pruner differ from this config's (recorded in the study); without
    it such a join is refused with a ConfigError that names each difference.

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
        device=device,
        artifact_store=artifact_store,
        started=started,
        gpus=gpu_list,
        workers_per_gpu=per_gpu,
        allow_changed_setup=allow_changed_setup,
        quiet=True,  # no progress line
        from_python=True,
    )
    if gpu_list is not None or per_gpu is not None:
        argv, env = _worker_command(request)
        request = dataclasses.replace(request, argv=tuple(argv), worker_env=env)
    with _signals_restored():
        outcome = run_study(request, say=log.info)
    try:
        return _result(study, outcome)
    finally:
        _dispose(outcome.storage)  # a long-lived caller (a notebook) keeps no connection


def _result(name: str, outcome: Any) -> RunResult:
    if outcome.study is None:
        return RunResult(name, 0, None, (), {}, outcome.stopped_by)
    front = [_trial(summary, outcome.study.metric_names) for summary in _best(outcome.study)]
    several = len(outcome.study.directions) > 1
    return RunResult(
        study=name,
        trials_run=outcome.trials_run,
        best=front[0] if front and not several else None,
        pareto_front=tuple(front) if several else (),
        trials=_counts(outcome.study),
        stopped_by=outcome.stopped_by,
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


class Study:
    """A study read from its database: its trials, best trial, best model and report. Each call
    reads the study as it is now (workers may be adding trials). Use as a context manager, or
    call close(), to release its database connections."""

    def __init__(self, study: Any, storage: Any, masked_url: str) -> None:
        self._study, self._storage, self._url = study, storage, masked_url

    @property
    def name(self) -> str:
        return str(self._study.study_name)

    @property
    def storage(self) -> str:
        """The database URL, its password masked."""
        return self._url

    @property
    def directions(self) -> tuple[str, ...]:
        """minimize or maximize, per objective."""
        return tuple(d.name.lower() for d in self._study.directions)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(_metric_names(self._study.metric_names, len(self._study.directions)))

    def trials(self, states: Sequence[str] | None = None) -> list[Trial]:
        """Every trial by number, or those in `states` (running, waiting, complete, pruned,
        fail)."""
        wanted = _states(states)
        with self._reading():
            found = self._study.get_trials(deepcopy=False)
        names = self._study.metric_names
        return [_frozen(t, names) for t in found if wanted is None or t.state in wanted]

    def best(self) -> Trial:
        """The best trial, as `hpo best` names it; raises hpo.HPOError before one completes, or
        for a study of several objectives (see pareto_front())."""
        if len(self._study.directions) > 1:
            raise HPOError(
                f"study {self.name!r} has {len(self._study.directions)} objectives, so "
                "no single best trial; use pareto_front()"
            )
        return self.pareto_front()[0]

    def pareto_front(self) -> list[Trial]:
        """The trials no other complete trial beats on every objective (one objective: the best
        trial alone); raises hpo.HPOError before one completes."""
        from hpo.services import best_of

        with self._reading():
            found = best_of(self._study, self._storage)
        return [_trial(summary, self._study.metric_names) for summary in found]

    def status(self) -> dict[str, Any]:
        """What `hpo status --json` prints: trials by state, running trials and their workers,
        the best, device-hours, trials/hour, failures and prunes by reason, the budget."""
        from hpo import services

        with self._reading():
            return services.status(self._study, self._storage, with_store=False)

    def download(
        self,
        folder: str | os.PathLike[str],
        *,
        merge: bool = False,
        artifact_store: str | None = None,
    ) -> Path:
        """The best trial's model from the study's artifact store into `folder` (new or empty),
        as `hpo best --download`: every file checked against its sha256, never half a model.
        `merge`: a LoRA study's adapter merged into its base model, written as a plain model.
        `artifact_store`: where the store is reached from here (default: $HPO_ARTIFACT_STORE,
        then the one the study's workers recorded). Returns the folder."""
        from hpo.services import API_DOWNLOAD, download_best, study_artifact_store

        with self._reading():
            best = self._best_summaries()
            store = study_artifact_store(self._study, artifact_store)
            out, said = download_best(
                self._study, best, store, os.fspath(folder), merge, API_DOWNLOAD
            )
        log.info("%s", said)
        return out

    def report(self, path: str | os.PathLike[str], *, format: str | None = None) -> Path:
        """The study's report, as `hpo report` writes it, to `path` (a file, or an existing
        folder for the default name): one HTML page that opens offline, or Markdown (`format`
        "md", or a path ending in .md). Returns the file written."""
        from hpo.services import write_report

        given = os.fspath(path)
        form = format or ("md" if given.lower().endswith(".md") else "html")
        if form not in ("html", "md"):
            raise ConfigError([f"format: got {format!r}; give 'html' or 'md'"], "report")
        with self._reading():
            return write_report(self._study, self._storage, form, given, "report path")

    def close(self) -> None:
        """Release the study's database connections; the object reads nothing more after."""
        _dispose(self._storage)

    def __enter__(self) -> Study:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"hpo.Study({self.name!r}, storage={self._url!r})"

    def _best_summaries(self) -> list[dict[str, Any]]:
        from hpo.services import best_of

        return best_of(self._study, self._storage)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A study deleted while it is read is one hpo.HPOError, as in the CLI."""
        from hpo.services import study_gone

        try:
            yield
        except KeyError as e:
            raise study_gone(e, self.name, self._url) from e


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
    for name in ("n_trials", "timeout", "trial_timeout"):
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


def _states(states: Sequence[str] | None) -> set[Any] | None:
    from optuna.trial import TrialState

    if states is None:
        return None
    if isinstance(states, str):
        states = [states]
    unknown = [s for s in states if not isinstance(s, str) or s.lower() not in STATES]
    if unknown:
        raise ConfigError(
            [f"states: got {unknown[0]!r}; give any of {', '.join(STATES)}"], "trials"
        )
    return {TrialState[s.upper()] for s in states}


def _metric_names(names: list[str] | None, count: int) -> list[str]:
    if names and len(names) == count:
        return list(names)
    return ["value"] if count == 1 else [f"objective_{i}" for i in range(count)]


def _frozen(trial: Any, names: list[str] | None) -> Trial:
    """A Trial of Optuna's FrozenTrial."""
    values = tuple(trial.values) if trial.values is not None else None
    return _make(
        trial.number, trial.state.name.lower(), values, trial.params, trial.user_attrs, names
    )


def _trial(summary: dict[str, Any], names: list[str] | None) -> Trial:
    """A Trial of a best-trial summary (hpo.reports.status.best_trials): a complete trial."""
    values = summary.get("values") or [summary["value"]]
    return _make(
        summary["number"],
        "complete",
        tuple(values),
        summary["params"],
        summary["user_attrs"],
        names,
    )


def _make(
    number: int,
    state: str,
    values: tuple[float, ...] | None,
    params: dict[str, Any],
    user_attrs: dict[str, Any],
    names: list[str] | None,
) -> Trial:
    metrics: dict[str, float] = {}
    if values is not None:
        metrics = dict(zip(_metric_names(names, len(values)), values, strict=True))
    return Trial(number, state, values, metrics, dict(params), dict(user_attrs))


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dispose(storage: Any) -> None:
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()
