"""`hpo report`: a study on one offline HTML page, or Markdown; bad arguments are one line."""

from __future__ import annotations

import html
import math
import os
import random
import re
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from hpo.reports import document as study_report


def finished_study(url: str, name: str = "watched") -> optuna.Study:
    """Complete, pruned and failed trials with the attributes hpo records."""
    rng = random.Random(0)
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    study.set_metric_names(["accuracy"])
    for i in range(10):
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
        batch = trial.suggest_categorical("effective_batch_size", [16, 32, 64])
        trial.set_user_attr("samples_per_s", 100.0 + batch)
        trial.set_user_attr("physical_batch_size", batch)
        trial.set_user_attr("peak_mem_bytes", batch * 2**24)
        trial.set_user_attr("wall_s", 360.0)  # ten trials of 6 minutes: one device-hour
        for step in range(3):
            trial.report(0.3 + 0.1 * step + rng.random() * 0.1, step)
        if i % 4 == 3:
            trial.set_user_attr("prune_reason", "pruner: accuracy=0.3 at evaluation 1")
            study.tell(trial, state=TrialState.PRUNED)
        elif i == 5:
            trial.set_user_attr("fail_reason", "RuntimeError: NaN loss")
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, 0.5 + rng.random() * 0.4)
    # Six minutes a trial, as the wall_s says (the study itself took milliseconds).
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for i in range(10):
            start, end = (
                f"2026-11-20 {9 + (6 * k) // 60:02d}:{(6 * k) % 60:02d}:00" for k in (i, i + 1)
            )
            conn.execute(
                sa.text(
                    "UPDATE trials SET datetime_start = :s, datetime_complete = :e "
                    "WHERE number = :n "
                    "AND study_id = (SELECT study_id FROM studies WHERE study_name = :name)"
                ),
                {"s": start, "e": end, "n": i, "name": name},
            )
    engine.dispose()
    return study


PLOTS = [
    "Optimization history",
    "Learning rate against effective batch size",
    "Parameter importances",
    "Learning curves (pruned in grey)",
    "Parallel coordinates",
    "Throughput and peak memory by physical batch size",
]


def test_the_html_report_draws_every_plot_and_fetches_nothing(tmp_path: Path) -> None:
    study = finished_study(f"sqlite:///{tmp_path / 'r.db'}")
    page = study_report.html_page(study)
    for title in PLOTS:
        assert f"<h2>{title}</h2><div class=plot>" in page, title
    assert "not drawn" not in page
    assert len(re.findall(r'class="plotly-graph-div"', page)) == len(PLOTS)
    assert page.count("plotly.js v") == 1  # the library once, inlined
    assert not re.search(r"<script[^>]+src=", page)  # nothing to fetch: opens offline
    assert "NaN loss" not in page and "RuntimeError" in page  # reasons by kind
    best = study.best_trial
    assert f"trial #{best.number}: " in page and "enqueue: [" in page
    assert (
        "device-hours 1.000 (every trial" in page and "pruner" in page
    )  # summary; prunes by reason


def test_the_plots_mark_pruned_trials_and_colour_by_value(tmp_path: Path) -> None:
    study = finished_study(f"sqlite:///{tmp_path / 'r.db'}")
    states = [t.state for t in study.get_trials()]
    complete, pruned = states.count(TrialState.COMPLETE), states.count(TrialState.PRUNED)
    lr_batch = {trace.name: trace for trace in study_report._lr_batch(study).data}
    assert len(lr_batch["complete"].x) == complete and len(lr_batch["pruned"].x) == pruned
    assert lr_batch["pruned"].marker.color == study_report.PRUNED_GREY
    assert lr_batch["complete"].marker.showscale  # coloured by the metric, with its scale
    assert sorted(lr_batch["complete"].marker.color) == sorted(
        t.value for t in study.get_trials() if t.state == TrialState.COMPLETE
    )
    curves = study_report._curves(study).data
    assert len(curves) == complete + pruned  # a failed trial's curve is left out
    grey = [c for c in curves if c.line.color == study_report.PRUNED_GREY]
    assert len(grey) == pruned and all("(pruned)" in c.name for c in grey)
    throughput = {trace.name: trace for trace in study_report._throughput(study).data}
    assert list(throughput["peak memory"].y) and not any(
        math.isnan(y) for y in throughput["peak memory"].y
    )


def test_an_empty_study_and_one_with_two_objectives(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    empty = optuna.create_study(study_name="empty", storage=url)
    page = study_report.html_page(empty)
    assert "no completed trial yet" in page and page.count("not drawn") == len(PLOTS)
    pareto = optuna.create_study(study_name="two", storage=url, directions=["maximize"] * 2)
    pareto.set_metric_names(["accuracy", "samples_per_s"])
    for accuracy, speed in ((0.9, 100.0), (0.8, 300.0), (0.7, 50.0)):
        trial = pareto.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
        pareto.tell(trial, [accuracy, speed])
    page = study_report.html_page(pareto)
    assert "<h2>Pareto front</h2><div class=plot>" in page
    assert "Pareto front: trial #0" in page and "Pareto front: trial #2" not in page
    text = study_report.markdown(pareto)
    assert "| # | state | accuracy | samples_per_s | learning_rate |" in text
    # No failure and no prune: a sentence, not a table with a "none | 0" row.
    assert "No trial failed." in text and "No trial was pruned." in text
    assert "| reason |" not in text and "none" not in text
    assert "<p class=note>No trial failed.</p>" in page


def test_report_out_names_a_file_or_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.errors import HPOError
    from hpo.services import report_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rep").mkdir()
    html_name, md_name = report_path(None, "s", "html"), report_path(None, "s", "md")
    assert html_name.name.startswith("hpo-report-s") and html_name.suffix == ".html"
    assert html_name.parent == Path(".") and md_name == html_name.with_suffix(".md")
    assert "/" not in report_path(None, "a/../b", "html").name
    assert report_path("rep", "s", "html") == Path("rep") / html_name
    assert report_path("rep/", "s", "md") == Path("rep") / md_name
    assert report_path("rep/r.html", "s", "html") == Path("rep/r.html")
    for given, message in (
        ("new/", "--out new/: no such folder; create it first"),  # not a file named "new"
        ("no/r.html", "no such folder 'no'"),
        ("  ", "--out is empty"),
    ):
        with pytest.raises(HPOError, match=re.escape(message)):
            report_path(given, "s", "html")
    assert not (tmp_path / "new").exists()


def test_hpo_report_through_the_cli(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # hpo's main in this process, as the CLI calls it, in the folder a user runs it from.
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    finished_study(url, name="it's/../odd")
    report = ["report", "--study", "it's/../odd", "--storage", url]
    with warnings.catch_warnings(record=True) as caught:
        # What a user's Python shows (its default filters, every time): no plotting notes.
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for category in (
            DeprecationWarning,
            PendingDeprecationWarning,
            ImportWarning,
            ResourceWarning,
        ):
            warnings.simplefilter("ignore", category)
        assert hpo_main(report) == 0
    done = capsys.readouterr()
    assert not caught, [str(w.message) for w in caught]
    assert "WARNING" not in done.err and "Warning" not in done.err, done.err[-2000:]
    [page] = tmp_path.glob("hpo-report-*.html")  # a safe file name, in this folder
    assert page.stat().st_mode & 0o044 == 0o044  # readable like any file, not mkstemp's 0600
    assert "--study 'it'\"'\"'s/../odd-again'" in html.unescape(page.read_text(encoding="utf-8"))
    assert hpo_main([*report, "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith('# Study "it\'s/../odd"') and "| 9 | complete |" in md
    missing = tmp_path / "no" / "such" / "r.html"
    assert hpo_main([*report, "--out", str(missing)]) == 2
    bad = capsys.readouterr().err
    assert "no such folder" in bad and "Traceback" not in bad and not (tmp_path / "no").exists()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert hpo_main([*report, "--out", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # left as it was (a device such as /dev/full too)
    assert hpo_main(["report", "--study", "nope", "--storage", url]) == 2
    assert "no study 'nope'" in capsys.readouterr().err
    assert len(list(tmp_path.glob("hpo-report-*"))) == 1 and not list(tmp_path.glob(".hpo-*"))


def test_a_report_replaces_only_a_report_of_its_own(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    """`hpo report --out study.db` wrote the page over the study's own database (hostile try,
    2026-11-26): a file that is not a report hpo wrote is refused, untouched; its own report
    (HTML or Markdown, an HTML page of an earlier version too) is replaced."""
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    finished_study(url, name="s")
    report = ["report", "--study", "s", "--storage", url]
    data = tmp_path / "train.csv"
    data.write_text("text,label\nfine,1\n", encoding="utf-8")
    database = (tmp_path / "r.db").read_bytes()
    for victim in ("r.db", "train.csv"):
        for form in ("html", "md"):
            assert hpo_main([*report, "--format", form, "--out", victim]) == 2
            err = capsys.readouterr().err
            assert f"--out {victim}: exists and is not a report hpo wrote" in err, err
    assert (
        tmp_path / "r.db"
    ).read_bytes() == database and data.read_text() == "text,label\nfine,1\n"
    assert optuna.load_study(study_name="s", storage=url).trials  # the study is still there
    assert not list(tmp_path.glob(".r.db.*")) and not list(tmp_path.glob(".train.csv.*"))
    for form in ("html", "md"):  # written, then written again over itself
        out = f"mine.{form}"
        assert hpo_main([*report, "--format", form, "--out", out]) == 0
        assert hpo_main([*report, "--format", form, "--out", out]) == 0
        assert study_report.is_report(tmp_path / out)
    older = tmp_path / "older.html"  # an HTML report written before the mark existed
    older.write_text("<!DOCTYPE html>\n<html><head><title>hpo report: s</title>", "utf-8")
    assert hpo_main([*report, "--out", str(older)]) == 0
    assert study_report.HTML_MARK in older.read_text(encoding="utf-8")


def test_the_report_names_the_retrain_winner_and_a_retrain_study_points_back(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    searched = finished_study(url, name="s")
    searched.set_user_attr(
        "retrain",
        {
            "study": "s [retrain top 1 x 1 seeds, abc123]",
            "metric": "accuracy",
            "mean": 0.9,
            "std": None,
            "seeds": 1,
            "params": {"learning_rate": 0.01},
            "model": "/final",
            "search_trial": 3,
            "full_data": False,
        },
    )
    text = study_report.markdown(searched)
    assert "Retrain winner (s [retrain top 1 x 1 seeds, abc123]): accuracy 0.9000 (one run" in text
    assert "hpo retrain --study s" in text
    runs = optuna.create_study(
        study_name="s [retrain top 1 x 1 seeds, abc123]", storage=url, direction="maximize"
    )
    runs.set_user_attr("retrain_of", "s")
    runs.add_trial(
        optuna.create_trial(
            value=0.9,
            params={"learning_rate": 0.01, "seed": 43},
            distributions={
                "learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-1),
                "seed": optuna.distributions.CategoricalDistribution([43]),
            },
        )
    )
    text = study_report.markdown(runs)
    # The recipe to train it again is one hpo accepts: the seed as training.seed, not a param.
    assert 'enqueue: [{"learning_rate": 0.01}]\ntraining:\n  seed: 43' in text
    assert "hpo retrain" not in text  # a retrain of a retrain study is refused: not suggested
    assert "holds the retrain runs of study 's'; `hpo best --study s`" in text


def test_markdown_cells_with_a_bar_or_a_line_break_keep_the_table_whole(tmp_path: Path) -> None:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'r.db'}", study_name="bars")
    trial = study.ask()
    trial.suggest_categorical("pooling", ["mean|max"])
    trial.set_user_attr("fail_reason", "ValueError: a|b\nsecond line")
    study.tell(trial, state=TrialState.FAIL)
    text = study_report.markdown(study)
    assert "| ValueError | 1 |" in text  # reasons by kind
    row = next(line for line in text.splitlines() if line.startswith("| 0 |"))
    assert "mean\\|max" in row and row.count(" | ") == text.split("## Trials")[1].splitlines()[
        2
    ].count(" | ")


def test_a_large_study_is_drawn_from_a_sample_read_from_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.storage import open_storage
    from hpo.storage.url import StorageURL

    url = f"sqlite:///{tmp_path / 'r.db'}"
    study = finished_study(url)
    for i in range(50):
        study.add_trial(
            optuna.create_trial(
                value=0.5 + i / 1000,
                params={"learning_rate": 1e-3, "effective_batch_size": 32},
                distributions=study.trials[0].distributions,
                intermediate_values={0: 0.4},
                user_attrs={"samples_per_s": 10.0, "physical_batch_size": 8},
            )
        )
    monkeypatch.setattr(study_report, "DRAW_LIMIT", 20)
    storage = open_storage(StorageURL(url, "test"))
    view = study_report._drawn(study, storage)
    assert view.total == 60 and 20 <= len(view.numbers) <= 25
    best = study.best_trial.number
    assert best in view.numbers and 59 in view.numbers  # the best and the latest
    history = dict(study_report._plots(view))["Optimization history"]()
    assert max(history.data[0].x) == 59  # the study's trial numbers, not the copy's
    text = study_report.markdown(study, storage)
    assert f"show {len(view.numbers)} of the study's 60 trials" in text
    assert "- trials: 57 complete, 1 fail, 2 pruned" in text  # counts of every trial
    rows = [line for line in text.split("## Trials")[1].splitlines() if line.startswith("| ")]
    assert len(rows) == len(view.numbers) + 1 and any(r.startswith(f"| {best} |") for r in rows)
    assert sum(r.endswith("| 10 | 8 |") for r in rows) >= len(view.numbers) - 10  # light read
    page = study_report.html_page(study, storage)
    assert page.count("class=plot>") == len(PLOTS)


def test_markdown_shows_html_and_backticks_from_the_study_as_text(tmp_path: Path) -> None:
    """Many Markdown viewers render inline HTML; a value with backticks could close a fence."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    payload = "<img src=x onerror=alert(1)>"
    study = optuna.create_study(study_name=payload, storage=url, direction="maximize")
    study.set_metric_names([payload])

    def objective(trial: optuna.Trial) -> float:
        trial.set_user_attr("best_model", payload)
        trial.suggest_categorical("lr" + payload, ["```\\n# injected"])
        return 0.5

    study.optimize(objective, n_trials=2)
    text = study_report.markdown(study)
    fences = re.findall(r"^`{3,}$", text, flags=re.M)
    assert fences and all(len(f) >= 4 for f in fences)  # longer than the value's ```
    outside = re.sub(r"^(`{4,})$.*?^\1$", "", text, flags=re.M | re.S)  # code shows no HTML
    assert "<img" not in outside and "&lt;img src=x onerror=alert(1)&gt;" in outside


def _curves_study(curves: list[list[float]]) -> optuna.Study:
    """One trial per curve, reported from evaluation 1: a curve of one value is a trial the
    study pruned there, the others complete with their best value."""
    study = optuna.create_study(study_name="curves", direction="maximize")
    for curve in curves:
        trial = study.ask()
        for step, value in enumerate(curve, 1):
            trial.report(value, step)
        if len(curve) == 1:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, max(curve))
    return study


def test_the_report_replays_the_studys_curves_under_other_pruners() -> None:
    """Three trials, one the study pruned, then a late starter that ends best: the median rule
    would have stopped it (a different best, less compute); without pruning, the pruned trial
    would have gone on, its later curve unknown."""
    from hpo.reports import pruning

    study = _curves_study(
        [[0.3, 0.5, 0.7], [0.3, 0.6, 0.8], [0.31, 0.6, 0.9], [0.1], [0.1, 0.2, 0.95]]
    )
    said = pruning.lines(study, study.get_trials())
    assert said[0] == (
        "pruning: 1 of 5 trials pruned; the study ran 13 evaluations, 87% of the "
        "15 the same trials would run unpruned"
    )
    lines = {line.split(" would have")[0]: line for line in said[1:]}
    median = "the median rule without a margin"
    assert lines[median] == (
        f"{median} would have used 85% of this study's evaluations: a "
        "different best: trial #2, 0.9000; 2 trials pruned"
    )
    assert lines["no pruning"].startswith(
        "no pruning would have used 115% of this study's evaluations: the same best (trial #4, "
        "0.9500); 1 trial this study pruned would have gone on"
    )
    # hpo's default judges from evaluation 2 on: the late starter is at 0.2 there, 0.4 below
    # the median (0.6), and is stopped too; the trial the study stopped at evaluation 1 is not.
    default = "hpo's default (the median rule, margin 0.02, from evaluation 2)"
    assert lines[default].startswith(
        f"{default} would have used 92% of this study's evaluations: a different best: trial "
        "#2, 0.9000; 1 trial pruned; 1 trial this study pruned would have gone on"
    )
    assert set(lines) >= {"successive halving", "hyperband"}
    text = study_report.markdown(study)
    assert "## Pruning\n\n- pruning: 1 of 5 trials pruned" in text
    assert "<h2>Pruning</h2><ul><li>pruning: 1 of 5" in study_report.html_page(study)
    two = optuna.create_study(directions=["maximize"] * 2)  # hpo prunes no multi-objective study
    assert pruning.lines(two, two.get_trials()) == [] and "## Pruning" not in study_report.markdown(
        two
    )
