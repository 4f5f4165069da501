"""What hpo.run says and shows: a short summary when it ends (what ran, the best value, where
the study is), and in a Jupyter notebook its live progress in one display updated in place,
and the inline display of a run's result and a study's report.
"""

from __future__ import annotations

import html
import sys
from typing import TYPE_CHECKING, Any

from hpo import live

if TYPE_CHECKING:
    from hpo.api import RunResult

# The display a report takes in a notebook's output: tall enough to read, scrolled within.
REPORT_HEIGHT_PX = 640


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython with a kernel attached): where hpo.run
    shows its progress as a display, not a terminal line. Never imports IPython itself."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return getattr(shell, "kernel", None) is not None


class NotebookProgress(live.LiveLine):
    """The live line as a notebook display: the running trial and the study, updated in place
    (IPython's display handle), never terminal escape codes; the final summary replaces it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr, width=10_000)
        self.handle: Any = None  # made with the first thing shown: a bad config shows none

    def text(self) -> str:
        return " | ".join(part for part in (self.trial, self.study) if part) or "hpo: running"

    def draw(self) -> None:
        with self._lock:
            self.show(self.text())

    def clear(self) -> None:
        pass  # the last state stays until the summary replaces it

    def write_above(self, text: str) -> None:
        print(text, end="" if text.endswith("\n") else "\n", file=sys.stderr)

    def show(self, text: str) -> None:
        from IPython.display import display

        if self.handle is None:
            self.handle = display(_bundle(text), raw=True, display_id=True)
        else:
            self.handle.update(_bundle(text), raw=True)


def _bundle(text: str) -> dict[str, str]:
    return {"text/plain": text, "text/html": f"<pre>{html.escape(text)}</pre>"}


def summary_lines(result: RunResult) -> list[str]:
    """What a run did, in two or three lines: the trials it ran (or, plainly, why none), the
    study's best, and where the study is."""
    where = f"study {result.study!r}" + (f" in {result.storage}" if result.storage else "")
    held = sum(n for state, n in result.trials.items() if state != "waiting")
    if result.stopped_by is not None:
        lines = [
            f"hpo: stopped by {result.stopped_by} after {result.trials_run or 0} trial(s); "
            "a trial it stopped was handed back, queued for the next run"
        ]
    elif result.trials_run == 0 and result.budget is not None and held >= result.budget:
        lines = [
            f"hpo: no trial ran: {where} already holds {held} trials, its budget "
            f"(n_trials={result.budget}) is spent; give a larger n_trials to run more"
        ]
    elif result.trials_run is None:
        lines = ["hpo: the worker processes ran their trials"]
    else:
        lines = [f"hpo: ran {result.trials_run} trial(s)"]
    counts = ", ".join(f"{n} {state}" for state, n in sorted(result.trials.items()))
    lines.append(f"hpo: {where}: {counts or 'no trials'}")
    if result.best is not None:
        lines.append(
            f"hpo: best trial #{result.best.number}: {_metrics(result.best.metrics)} "
            f"with {_params(result.best.params)}"
        )
    elif result.pareto_front:
        lines.append(f"hpo: Pareto front of {len(result.pareto_front)} trial(s)")
    return lines


def _metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.6g}" for name, value in metrics.items())


def _params(params: dict[str, Any]) -> str:
    shown = [
        f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in params.items()
    ]
    return ", ".join(shown) or "no parameters"


def result_html(result: RunResult) -> str:
    """A run's result as a small table, for a notebook's output."""
    rows = [("study", result.study)]
    if result.storage:
        rows.append(("storage", result.storage))
    rows.append(
        (
            "trials run",
            "by worker processes" if result.trials_run is None else str(result.trials_run),
        )
    )
    rows.append(("trials", ", ".join(f"{n} {s}" for s, n in sorted(result.trials.items()))))
    if result.best is not None:
        rows.append((f"best (#{result.best.number})", _metrics(result.best.metrics)))
        rows.append(("parameters", _params(result.best.params)))
    for trial in result.pareto_front:
        rows.append((f"Pareto #{trial.number}", _metrics(trial.metrics)))
    if result.stopped_by is not None:
        rows.append(("stopped by", f"{result.stopped_by} (the running trial handed back)"))
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
        f"{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    return f"<table>{body}</table>"


def report_html(page: str) -> str:
    """A whole report page shown in a notebook's output: in a frame of its own, so that its
    styles and scripts stay out of the notebook's."""
    return (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" '
        f'style="width:100%;height:{REPORT_HEIGHT_PX}px;border:0"></iframe>'
    )
