"""`hpo report`: a study on one page. HTML that opens offline (plotly's JavaScript inlined, nothing
fetched), with Optuna's own plots where it has them; or the same summary and tables as Markdown.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
import shlex
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.reports import cost, pruning
from hpo.reports import status as report
from hpo.reports.model_card import mean_std_text, seeds_text
from hpo.storage import study_queries
from hpo.study.join import model_loader
from hpo.study.retrain import recorded_outcome

PRUNED_GREY = "#b0b0b0"
# Past this many trials the plots and the table draw a sample: a page of 100,000 learning curves
# would not open, and reading every trial takes a minute.
DRAW_LIMIT = 1000
_NUMBER = "hpo:number"  # a sampled trial's number in the study


# The user attributes the trial table shows.
_TABLE_USER_KEYS = ("samples_per_s", "physical_batch_size")


@dataclass
class Drawn:
    """The trials the plots and the table show: the study's own, or of a large study a sample
    read from its database (`sample_ids`, with `engine`; `total`: the study's size). Each read
    is made only when something needs it: a Markdown report reads the table's columns only."""

    study: optuna.Study
    engine: Any = None
    sample_ids: list[int] | None = None
    total: int | None = None

    def trials(self) -> list[FrozenTrial]:
        """The trials of the table (of a sample: whole if the plots read them, else only the
        table's columns)."""
        if self.sample_ids is None:
            return self.study.get_trials(deepcopy=False)
        if "whole_sample" in self.__dict__:
            return self.whole_sample
        return study_queries.trials(self.engine, self.sample_ids, _TABLE_USER_KEYS)

    @functools.cached_property
    def whole_sample(self) -> list[FrozenTrial]:
        return study_queries.trials(self.engine, self.sample_ids or [])

    @property
    def numbers(self) -> list[int]:
        """The study's numbers of the view's trials, in the view's order."""
        return [t.number for t in self.whole_sample] if self.sample_ids is not None else []

    @functools.cached_property
    def view(self) -> optuna.Study:
        """What Optuna's plots read: the study, or an in-memory study of the sample."""
        if self.sample_ids is None:
            return self.study
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created in memory" line
        try:
            view = optuna.create_study(
                study_name=self.study.study_name, directions=self.study.directions
            )
        finally:
            optuna.logging.set_verbosity(verbosity)
        for key, value in self.study.user_attrs.items():
            view.set_user_attr(key, value)
        if self.study.metric_names:
            view.set_metric_names(self.study.metric_names)
        for trial in self.whole_sample:
            trial.set_user_attr(_NUMBER, trial.number)
        view.add_trials(self.whole_sample)
        return view


def _drawn(study: optuna.Study, storage: object) -> Drawn:
    db = report.database_of(study, storage)
    if db is None:
        return Drawn(study)
    engine, study_id = db.storage.engine, db.study_id
    total, _ = study_queries.size_and_start(engine, study_id)
    if total <= DRAW_LIMIT:
        return Drawn(study)
    maximize = study.directions[0] == StudyDirection.MAXIMIZE
    sample_ids = study_queries.sample_ids(engine, study_id, maximize, DRAW_LIMIT)
    return Drawn(study, engine, sample_ids, total)


def _shown(trial: FrozenTrial) -> int:
    """The trial's number in the study (a sampled trial's differs in its in-memory copy)."""
    number = trial.user_attrs.get(_NUMBER)
    return number if isinstance(number, int) else trial.number


# How hpo knows a file as a report of its own, which `hpo report --out` may replace (any other
# file it refuses: a study's database given as --out was once overwritten).
HTML_MARK = '<meta name="generator" content="hpo report">'
MARKDOWN_MARK = "<!-- written by hpo report -->"


def is_report(path: Path) -> bool:
    """Whether the file at `path` is a report hpo wrote (its mark near its start or its end;
    an HTML report of an earlier version by its title)."""
    try:
        with path.open("rb") as file:
            head = file.read(2048)
            file.seek(max(0, path.stat().st_size - 256))
            tail = file.read()
    except OSError:
        return False
    return (
        HTML_MARK.encode() in head
        or b"<title>hpo report: " in head
        or MARKDOWN_MARK.encode() in tail
    )


def markdown(study: optuna.Study, storage: object = None) -> str:
    """Summary, best configuration, reasons and every trial (of a large study: a sample), as
    Markdown. `storage`: hpo's, to ask the database (see hpo.reports.status)."""
    status = report.status(study, storage=storage)
    drawn = _drawn(study, storage)
    lines = [f"# Study {_md(repr(study.study_name))}", ""]
    lines += [f"- {_md(line)}" for line in _summary(study, status, drawn)]
    lines += ["", "## Best configuration", "", *_md_block(_best_block, study, status), ""]
    if said := _pruning(study, drawn):
        lines += ["## Pruning", "", *(f"- {_md(line)}" for line in said), ""]
    for title, rows, empty in _reason_tables(status):
        lines += [f"## {title}", ""]
        if rows:
            lines += ["| reason | trials |", "|---|---:|"]
            lines += [_md_row([reason, str(count)]) for reason, count in rows]
        else:
            lines.append(empty)
        lines.append("")
    header, table = _trial_table(study, drawn.trials())
    lines += ["## Trials", "", _md_row(header)]
    lines.append("|" + "---|" * len(header))
    lines += [_md_row(row) for row in table]
    return "\n".join([*lines, MARKDOWN_MARK]) + "\n"


def _md_row(cells: list[str]) -> str:
    """A table row; a `|` or a line break inside a cell (a reason, a categorical value) would
    break the table, and HTML in it (a parameter's value) would be rendered by many viewers."""
    safe = [_md(str(c)).replace("|", "\\|").replace("\n", " ") for c in cells]
    return "| " + " | ".join(safe) + " |"


def _md(text: str) -> str:
    """Text from the study (names, values, paths) as Markdown shows it, never as HTML."""
    return html.escape(text, quote=False)


def _md_block(
    block: Callable[[optuna.Study, dict[str, Any], str], list[str]],
    study: optuna.Study,
    status: dict[str, Any],
) -> list[str]:
    """`block`'s lines as Markdown: its code fences longer than any run of backticks in the
    study's values (which would close them early), its text outside them escaped."""
    plain = block(study, status, "")
    longest = max((len(run) for line in plain for run in re.findall("`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    lines, inside = [], False
    for line in block(study, status, fence):
        if line == fence:
            inside = not inside
        lines.append(line if inside or line == fence else _md(line))
    return lines


def html_page(study: optuna.Study, storage: object = None) -> str:
    """The whole report, one self-contained HTML page. Optuna's notes while plotting (a trial
    left out for an infinite value, importances from few trials) stay out of the terminal: the
    page says what it could not draw."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _html_page(study, storage)
    finally:
        optuna.logging.set_verbosity(verbosity)


def _html_page(study: optuna.Study, storage: object) -> str:
    sections = []
    first = True
    drawn = _drawn(study, storage)
    finished = bool(_trials(drawn.view, TrialState.COMPLETE, TrialState.PRUNED))
    for title, build in _plots(drawn):
        try:
            if not finished:  # Optuna's plots would draw empty axes
                raise ValueError("no trial has finished yet")
            figure = build()
        except (ValueError, RuntimeError, ZeroDivisionError, TypeError) as e:  # too few trials,
            # or values of a kind Optuna's plots cannot draw: the page says so, and goes on
            note = html.escape(f"not drawn: {e}")
            sections.append(f"<h2>{html.escape(title)}</h2><p class=note>{note}</p>")
            continue
        figure.update_layout(height=420, margin={"t": 40})
        body = figure.to_html(full_html=False, include_plotlyjs=first, config={"responsive": True})
        first = False
        sections.append(f"<h2>{html.escape(title)}</h2><div class=plot>{body}</div>")
    status = report.status(study, storage=storage)
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _summary(study, status, drawn))
    best = html.escape("\n".join(_best_block(study, status, fence="")))
    reasons = "".join(
        f"<h2>{html.escape(title)}</h2>"
        + (_html_table(["reason", "trials"], rows) if rows else f"<p class=note>{empty}</p>")
        for title, rows, empty in _reason_tables(status)
    )
    said = _pruning(study, drawn)
    pruned = "".join(f"<li>{html.escape(line)}</li>" for line in said)
    pruned = f"<h2>Pruning</h2><ul>{pruned}</ul>" if said else ""
    header, rows = _trial_table(study, drawn.trials())
    name = html.escape(study.study_name)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{HTML_MARK}<title>hpo report: {name}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
td, th {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }}
pre {{ background: #f4f4f4; padding: 0.8em; overflow-x: auto; }}
.note {{ color: #777; }}
</style></head><body>
<h1>Study {name}</h1>
<ul>{summary}</ul>
<h2>Best configuration</h2>
<pre>{best}</pre>
{"".join(sections)}
{pruned}
{reasons}
<h2>Trials</h2>
{_html_table(header, rows)}
</body></html>
"""


# -- what the page says ------------------------------------------------------------------------


def _summary(study: optuna.Study, status: dict[str, Any], drawn: Drawn) -> list[str]:
    states = ", ".join(f"{n} {s}" for s, n in sorted(status["trials"].items())) or "no trials"
    metrics = ", ".join(_metric_names(study))
    directions = ", ".join(d.name.lower() for d in study.directions)
    lines = [
        f"trials: {states}",
        f"objective: {metrics} ({directions})",
        report.figures_line(status),
    ]
    if status["best"] is not None:
        lines.append(f"best: trial #{status['best']['number']}, {status['best']['value']:.4f}")
    for trial in status["pareto_front"] or []:
        values = ", ".join(f"{v:.4f}" for v in trial["values"])
        lines.append(f"Pareto front: trial #{trial['number']}, {values}")
    if drawn.sample_ids is None and (reached := cost.reach_line(study, drawn.trials())):
        lines.append(reached)
    if drawn.total is not None:
        lines.append(
            f"plots and the trial table show {len(drawn.sample_ids or [])} of the study's "
            f"{drawn.total} trials: the best, the latest and an even spread of the rest; "
            "the counts above are of every trial"
        )
    best = [status["best"]] if status["best"] is not None else status["pareto_front"] or []
    return lines + report.checkpoint_warnings(best, status.get("lost_checkpoints"))


def _pruning(study: optuna.Study, drawn: Drawn) -> list[str]:
    """How many trials were pruned and what other pruners would have done with the curves;
    of a study too large to read whole, nothing (a sample's curves would mislead)."""
    if drawn.sample_ids is not None:
        return [f"pruning: not replayed for a study of more than {DRAW_LIMIT} trials"]
    return pruning.lines(study, study.get_trials(deepcopy=False))


def _best_block(study: optuna.Study, status: dict[str, Any], fence: str) -> list[str]:
    best = [status["best"]] if status["best"] is not None else status["pareto_front"] or []
    if not best:
        return ["no completed trial yet"]
    params = dict(best[0]["params"])
    searched = study.user_attrs.get("retrain_of")
    # A retrain run's seed is a parameter of its study only: elsewhere it is training.seed.
    seed = params.pop("seed", None) if searched is not None else None
    text = json.dumps(params, sort_keys=True)
    lines = [f"trial #{best[0]['number']}: {text}"]
    model = best[0]["user_attrs"].get("best_model")
    if model:
        lines.append(f"model: {model} ({model_loader(study.user_attrs, best[0]['user_attrs'])})")
    lines += [
        "",
        "To train this configuration again, add it to your config and run one trial:",
        *([fence] if fence else []),
        "study:",
        f"  enqueue: [{text}]",
        *(["training:", f"  seed: {seed}"] if seed is not None else []),
        *([fence, ""] if fence else [""]),
        *([fence] if fence else []),
        f"hpo run --study {shlex.quote(study.study_name + '-again')} --config YOUR_CONFIG.yaml "
        "--n-trials 1",
        *([fence] if fence else []),
        "",
    ]
    if searched is not None:  # a retrain study: its winner is in the searched study's report
        lines.append(
            f"This study holds the retrain runs of study {searched!r}; `hpo best --study "
            f"{shlex.quote(str(searched))}` names the winner on the mean."
        )
        return lines
    lines += [
        "For a final model: the best configurations trained again with new seeds, the winner "
        "chosen on the mean (one run's score is partly its seed's luck):",
        *([fence] if fence else []),
        f"hpo retrain --study {shlex.quote(study.study_name)} --config YOUR_CONFIG.yaml "
        "--top 3 --seeds 3",
        *([fence] if fence else []),
    ]
    retrained = recorded_outcome(study.user_attrs)
    if retrained:
        winner = json.dumps(retrained["params"], sort_keys=True)
        lines += [
            "",
            f"Retrain winner ({retrained['study']}): {retrained['metric']} "
            f"{mean_std_text(retrained['mean'], retrained['std'])} "
            f"over {seeds_text(retrained['seeds'])}, "
            f"{winner}; final model: {retrained['model']}",
        ]
    return lines


def _reason_tables(status: dict[str, Any]) -> list[tuple[str, list[tuple[str, int]], str]]:
    """Each table's title, its rows, and the sentence that replaces it when it has none."""
    return [
        ("Failures by reason", list(status["failures"].items()), "No trial failed."),
        ("Prunes by reason", list(status["prunes"].items()), "No trial was pruned."),
    ]


def _trial_table(
    study: optuna.Study, trials: list[FrozenTrial]
) -> tuple[list[str], list[list[str]]]:
    names = sorted({k for t in trials for k in t.params})
    header = ["#", "state", *_metric_names(study), *names, "samples/s", "physical batch"]
    rows = []
    for trial in trials:
        values = trial.values or [None] * len(study.directions)
        rows.append(
            [
                str(_shown(trial)),
                trial.state.name.lower(),
                *(_number(v) for v in values),
                *(_number(trial.params.get(n)) for n in names),
                _number(trial.user_attrs.get("samples_per_s")),
                _number(trial.user_attrs.get("physical_batch_size")),
            ]
        )
    return header, rows


def _gib(value: Any) -> float:
    return value / 2**30 if report.finite_number(value) else math.nan


def _number(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _html_table(header: list[str], rows: list[Any]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _metric_names(study: optuna.Study) -> list[str]:
    return study.metric_names or [f"objective {i}" for i in range(len(study.directions))]


# -- the plots ---------------------------------------------------------------------------------


def _plots(drawn: Drawn) -> list[tuple[str, Callable[[], Any]]]:
    import optuna.visualization as vis

    study = drawn.view
    names = _metric_names(study)
    if len(study.directions) > 1:
        return [
            ("Pareto front", lambda: vis.plot_pareto_front(study, target_names=names)),
            ("Learning rate against effective batch size", lambda: _lr_batch(study)),
            ("Throughput and peak memory by physical batch size", lambda: _throughput(study)),
        ]
    return [
        (
            "Optimization history",
            lambda: _renumbered(vis.plot_optimization_history(study, target_name=names[0]), drawn),
        ),
        ("Learning rate against effective batch size", lambda: _lr_batch(study)),
        ("Parameter importances", lambda: vis.plot_param_importances(study, target_name=names[0])),
        ("Learning curves (pruned in grey)", lambda: _curves(study)),
        ("Parallel coordinates", lambda: vis.plot_parallel_coordinate(study, target_name=names[0])),
        ("Throughput and peak memory by physical batch size", lambda: _throughput(study)),
    ]


def _renumbered(figure: Any, drawn: Drawn) -> Any:
    """A plot of a sample, its x axis (trial numbers of the in-memory copy) back to the
    study's trial numbers."""
    if drawn.total is not None:
        for trace in figure.data:
            if trace.x is not None:
                trace.x = [drawn.numbers[int(x)] for x in trace.x]
    return figure


def _trials(study: optuna.Study, *states: TrialState) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=states)


def _lr_batch(study: optuna.Study) -> Any:
    import plotly.graph_objects as go

    figure = go.Figure()
    complete = [
        t
        for t in _trials(study, TrialState.COMPLETE)
        if {"learning_rate", "effective_batch_size"} <= set(t.params)
    ]
    pruned = [
        t
        for t in _trials(study, TrialState.PRUNED)
        if {"learning_rate", "effective_batch_size"} <= set(t.params)
    ]
    if not complete and not pruned:
        raise ValueError("no trial samples both learning_rate and effective_batch_size")
    figure.add_trace(
        go.Scatter(
            x=[t.params["effective_batch_size"] for t in complete],
            y=[t.params["learning_rate"] for t in complete],
            mode="markers",
            name="complete",
            marker={
                "size": 11,
                "color": [t.values[0] for t in complete],
                "colorscale": "Viridis",
                "showscale": True,
                "colorbar": {"title": _metric_names(study)[0]},
            },
            text=[f"#{_shown(t)}: {t.values[0]:.4f}" for t in complete],
        )
    )
    figure.add_trace(
        go.Scatter(
            x=[t.params["effective_batch_size"] for t in pruned],
            y=[t.params["learning_rate"] for t in pruned],
            mode="markers",
            name="pruned",
            marker={"size": 9, "color": PRUNED_GREY, "symbol": "x"},
            text=[f"#{_shown(t)}: pruned" for t in pruned],
        )
    )
    figure.update_xaxes(title="effective batch size", type="log")
    figure.update_yaxes(title="learning rate", type="log")
    return figure


def _curves(study: optuna.Study) -> Any:
    import plotly.graph_objects as go

    figure = go.Figure()
    trials = _trials(study, TrialState.COMPLETE, TrialState.PRUNED)
    drawn = [t for t in trials if t.intermediate_values]
    if not drawn:
        raise ValueError("no trial has reported an evaluation yet")
    for trial in drawn:
        steps = sorted(trial.intermediate_values)
        pruned = trial.state == TrialState.PRUNED
        figure.add_trace(
            go.Scatter(
                x=steps,
                y=[trial.intermediate_values[s] for s in steps],
                mode="lines+markers",
                name=f"#{_shown(trial)}" + (" (pruned)" if pruned else ""),
                line={"color": PRUNED_GREY} if pruned else None,
            )
        )
    figure.update_xaxes(title="evaluation")
    figure.update_yaxes(title=_metric_names(study)[0])
    return figure


def _throughput(study: optuna.Study) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    trials = [
        t
        for t in _trials(study, TrialState.COMPLETE, TrialState.PRUNED)
        if report.finite_number(t.user_attrs.get("physical_batch_size"))
        and report.finite_number(t.user_attrs.get("samples_per_s"))
    ]
    if not trials:
        raise ValueError("no trial has recorded its throughput yet")
    figure = make_subplots(rows=1, cols=2, subplot_titles=("samples/s", "peak memory (GiB)"))
    batch = [t.user_attrs["physical_batch_size"] for t in trials]
    labels = [f"#{_shown(t)}" for t in trials]
    figure.add_trace(
        go.Scatter(
            x=batch,
            y=[t.user_attrs["samples_per_s"] for t in trials],
            mode="markers",
            text=labels,
            name="samples/s",
        ),
        row=1,
        col=1,
    )
    peaks = [_gib(t.user_attrs.get("peak_mem_bytes")) for t in trials]
    figure.add_trace(
        go.Scatter(x=batch, y=peaks, mode="markers", text=labels, name="peak memory"),
        row=1,
        col=2,
    )
    figure.update_xaxes(title="physical batch size")
    return figure
