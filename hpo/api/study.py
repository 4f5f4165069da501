"""`Study` and `Trial` of hpo's Python API: a study read from its database, its trials, best
model, report and ensemble. `hpo.api` re-exports them (`hpo.Study`, `hpo.Trial`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from hpo.errors import ConfigError, HPOError

log = logging.getLogger("hpo")

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

    @overload
    def report(self, path: None = None, *, format: str | None = None) -> Report: ...
    @overload
    def report(self, path: str | os.PathLike[str], *, format: str | None = None) -> Path: ...

    def report(
        self, path: str | os.PathLike[str] | None = None, *, format: str | None = None
    ) -> Path | Report:
        """The study's report, as `hpo report` writes it, to `path` (a file, or an existing
        folder for the default name): one HTML page that opens offline, or Markdown (`format`
        "md", or a path ending in .md). Returns the file written. Without `path`, nothing is
        written: a Report that a notebook displays inline (`.html`, `.markdown`, `.save()`)."""
        from hpo.services import report_text, write_report

        given = None if path is None else os.fspath(path)
        form = format or ("md" if given is not None and given.lower().endswith(".md") else "html")
        if form not in ("html", "md"):
            raise ConfigError([f"format: got {format!r}; give 'html' or 'md'"], "report")
        with self._reading():
            if given is None:
                return Report(self, report_text(self._study, self._storage, form), form)
            return write_report(self._study, self._storage, form, given, "report path")

    def ensemble(
        self,
        out: str | os.PathLike[str],
        *,
        top: int = 5,
        config: str | os.PathLike[str] | None = None,
        learners: Sequence[str] | str | None = None,
        pca: int | None = None,
        device: str = "auto",
        batch_size: int = 32,
        test_file: str | os.PathLike[str] | None = None,
        soup: str = "none",
    ) -> dict[str, Any]:
        """`hpo ensemble`: the study's `top` trials that kept a model, stacked, written to the
        new folder `out` (the stacked ensemble, or the best member when stacking is not
        better). `config`: the config the study ran with (its data.test_file scores every
        candidate; default: the evaluation file the study recorded, scored on the test file it
        recorded when that is unchanged, else by 5-fold cross-validation). `test_file`: a
        held-out .csv or .jsonl to score every candidate on instead. `learners`: the
        meta-learners to try, chosen by cross-validation ("all": every installed one; default:
        logistic regression, ridge for regression); a second call over the same members and
        options reads the fit from the cache. `soup`: "uniform" or "greedy" also averages the
        members' weights (or LoRA adapters). Returns the scores: `folder`, `saved`, each
        candidate's and how they were measured (`how_measured`). `hpo.load_model(out)` predicts
        with it."""
        from hpo.commands.ensemble import EnsembleRequest, build_ensemble

        request = EnsembleRequest(
            out=os.fspath(out),
            config=None if config is None else os.fspath(config),
            top=top,
            learners=(learners,) if isinstance(learners, str) else tuple(learners or ()),
            pca=pca,
            soup=soup,
            device=device,
            batch_size=batch_size,
            quiet=True,
            test_file=None if test_file is None else os.fspath(test_file),
        )
        with self._reading():
            outcome = build_ensemble(request, self._study)
        log.info("%s", outcome.table)
        scores = outcome.report.to_json() if outcome.report is not None else {}
        return {"folder": outcome.folder, "saved": outcome.saved, "table": outcome.table, **scores}

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


@dataclasses.dataclass(frozen=True)
class Report:
    """A study's report read into memory (`Study.report()` without a path): shown inline by a
    notebook; `save(path)` writes it as `Study.report(path)` would."""

    study: Study
    text: str
    format: str
    """html (a whole page) or md."""

    def save(self, path: str | os.PathLike[str]) -> Path:
        return self.study.report(path, format=self.format)

    def _repr_html_(self) -> str | None:
        from hpo.api.showing import report_html

        return report_html(self.text) if self.format == "html" else None

    def _repr_markdown_(self) -> str | None:
        return self.text if self.format == "md" else None

    def __repr__(self) -> str:
        return f"<hpo report of study {self.study.name!r} ({self.format}, {len(self.text)} chars)>"


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
