"""Live progress: one line on a terminal, rewritten in place under the scrolling log; nothing
of it when stderr is not a terminal."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import optuna
import pyte
import pytest

from hpo import live as progress
from tests.conftest import REPO, tiny_config, write_config

# A log line's timestamp; on a clean screen it starts its row (wrapped rows carry none).
TIMESTAMP = re.compile(r"\d\d-\d\d \d\d:\d\d:\d\d \[")
PROGRESS_ROW = re.compile(r"^(gpu\S+: )?trial #\d+ · |^study: \d+ complete| \| study: ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_lines_say_where_the_trial_and_the_study_are() -> None:
    text = progress.trial_text(
        4,
        {
            "epoch": 1.25,
            "epochs": 3,
            "step": 120,
            "total_steps": 300,
            "samples_per_s": 412.3,
            "loss": 0.5312,
            "metric": ("accuracy", 0.8123),
            "seconds_left": 80.4,
        },
    )
    assert text == (
        "trial #4 · epoch 1.2/3 · step 120/300 · 412 samples/s · loss 0.531 · "
        "accuracy 0.8123 · 1m20s left"
    )
    assert progress.trial_text(0, {"loss": float("nan")}) == "trial #0"
    assert progress.study_text({"complete": 3, "pruned": 2}, 0.91234, 24) == (
        "study: 3 complete, 2 pruned, 0 fail, budget 24; best 0.9123"
    )
    assert progress.study_text({}, None) == "study: 0 complete, 0 pruned, 0 fail"
    line = progress.LiveLine(Terminal(), width=30)
    line.update_study("study: 3 complete, 2 pruned, 0 fail")
    line.update_trial(0, {"step": 1})
    assert line.text() == "trial #0 · step 1 | study: 3…"  # cut to the width


def _screen(output: str, columns: int, rows: int = 200) -> list[str]:
    """The rows a terminal of `columns` x `rows` shows after `output` (what scrolled off the
    top first), through a terminal emulator: what a user sees, not the bytes."""
    screen = pyte.HistoryScreen(columns, rows, history=10_000)
    pyte.Stream(screen).feed(output)
    scrolled = ["".join(row[x].data for x in range(columns)) for row in screen.history.top]
    return [row.rstrip() for row in scrolled + list(screen.display)]


def _assert_clean(rows: list[str], progress_rows: int = 1) -> None:
    """No debris: every log line starts its row with its full timestamp (none glued to other
    text, none missing a first character), and at most `progress_rows` progress rows."""
    for row in rows:
        for found in TIMESTAMP.finditer(row):
            assert found.start() == 5 and re.match(r"\d{4}-", row), "\n".join(rows)
    shown = [row for row in rows if PROGRESS_ROW.search(row)]
    assert len(shown) <= progress_rows, "\n".join(rows)


def _set_size(fd: int, columns: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


class Screen(io.StringIO):
    """A terminal's input, for a terminal emulator: a tty turns each line break into CR LF."""

    def isatty(self) -> bool:
        return True

    def rows(self, columns: int, rows: int = 30) -> list[str]:
        return _screen(self.getvalue().replace("\n", "\r\n"), columns, rows)


def test_a_line_of_wide_characters_stays_on_its_row() -> None:
    term = Screen()
    line = progress.LiveLine(term, width=40)
    line.update_study("study: 1 complete, 0 pruned, 0 fail")
    wide = ("正解率正解率", 0.5)  # a metric named in Japanese: two columns a character
    line.update_trial(3, {"step": 5, "metric": wide})
    line.clear()  # what the log handler does around a record
    term.write("2026-11-25 20:51:46 [hpo] trial 2 done\n")
    line.draw()
    line.update_trial(3, {"step": 6, "metric": wide})
    rows = [row for row in term.rows(40) if row]
    assert rows[0] == "2026-11-25 20:51:46 [hpo] trial 2 done"
    assert len(rows) == 2 and rows[1].startswith("trial #3 · step 6 · 正解率"), rows
    assert progress.display_width(line.text()) <= 39  # never the last column
    assert progress.display_width("a正\u0301") == 3  # a combining accent takes none
    assert progress.fit("trial #1 · 正解率 0.5", 12) == "trial #1 ·…"


def test_a_line_drawn_with_a_stale_width_does_not_wrap() -> None:
    """The window narrowed between reading its width and drawing: the line is cut at the
    edge, not wrapped onto a row that the next redraw would leave behind."""
    term = Screen()
    line = progress.LiveLine(term, width=60)  # the terminal is 40 wide by now
    line.update_trial(3, {"epoch": 1.25, "epochs": 3, "step": 120, "samples_per_s": 412.0})
    line.update_study("study: 3 complete, 2 pruned, 0 fail, budget 24; best 0.9123")
    line.write_above("2026-11-25 20:51:46 [hpo] trial 2 done")
    line.update_trial(3, {"epoch": 1.5, "epochs": 3, "step": 144, "samples_per_s": 410.0})
    rows = [row for row in term.rows(40) if row]
    assert rows[0] == "2026-11-25 20:51:46 [hpo] trial 2 done" and len(rows) == 2, rows
    assert rows[1].startswith(line.text()[:39])  # the rest overwrote the last column


def test_what_other_processes_write_to_the_terminal_goes_above_the_line() -> None:
    """A trial process writes its log lines to the terminal it inherited, while the worker's
    line is drawn there: they must scroll above the line, never glued to it."""
    primary, secondary = pty.openpty()
    _set_size(secondary, 80, 24)
    stream = open(secondary, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("2026-11-25 20:51:46 [%(name)s] %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [handler]
    child = (
        "import sys; print('2026-11-25 20:51:47 [trainer.loop INFO] training on cpu', "
        "file=sys.stderr)"
    )
    try:
        assert progress.start(stream) is not None
        progress._last_draw = 0.0
        progress.study_progress({"complete": 1}, 0.9167, 4)
        subprocess.run([sys.executable, "-c", child], stderr=secondary, check=True)
        progress._last_draw = 0.0
        progress.trial_progress(1, {"step": 3})
        logging.getLogger("hpo.study.loop").warning("a log line of the worker")
        progress.stop()
    finally:
        root.handlers = saved
        stream.close()
    out = b""
    while select.select([primary], [], [], 0.5)[0]:
        out += os.read(primary, 65536)
    os.close(primary)
    os.close(secondary)
    assert progress.start(Screen()) is None  # a terminal in name only: nothing to redraw on
    rows = [row for row in _screen(out.decode(), 80, 24) if row]
    assert rows == [
        "2026-11-25 20:51:47 [trainer.loop INFO] training on cpu",
        "2026-11-25 20:51:46 [hpo.study.loop] a log line of the worker",
    ]


def _on_a_terminal(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, columns: int = 80
) -> str:
    """`hpo ARGS` with a pseudo-terminal of `columns` x 200 as its stdout and stderr: what the
    terminal got."""
    primary, secondary = pty.openpty()
    _set_size(secondary, columns, 200)
    full_env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("HPO_NO_LIVE_LINE", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "hpo", *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env=full_env,
    )
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([primary], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal closed with the worker
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert worker.wait(timeout=60) == 0, out[-3000:]
    return out


@pytest.mark.parametrize("columns", [80, 150])
def test_hpo_run_on_a_terminal_shows_a_live_line(
    tmp_path: Path, easy_data: tuple[Path, Path], columns: int
) -> None:
    # One epoch a trial (two evaluations): the line is drawn at every step all the same.
    raw = tiny_config(
        *easy_data, study={"n_trials": 2}, training={"log_every_steps": 1, "epochs": 1}
    )
    config = write_config(tmp_path / "c.yaml", raw)
    out = _on_a_terminal(
        [
            "run",
            "--study",
            "s",
            "--config",
            str(config),
            "--storage",
            f"sqlite:///{tmp_path / 'p.db'}",
        ],
        tmp_path,
        columns=columns,
    )
    assert f"{progress.CLEAR}trial #0 · epoch " in out, out[-3000:]
    assert "samples/s" in out and "study: 1 complete, 0 pruned, 0 fail, budget 2; best " in out
    rows = _screen(out, columns)
    _assert_clean(rows, progress_rows=0)  # the line is gone at the end, and left no copy
    # The trial processes' log lines came through, each on rows of its own.
    assert any(re.match(r"\S+ \S+ \[hpo.trial.training INFO\] trial 1 evaluation", r) for r in rows)
    assert any(row.startswith("best trial #") for row in rows), "\n".join(rows)


def test_workers_of_several_gpus_each_get_a_line_on_the_terminal(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # One epoch a trial (two evaluations): the line is drawn at every step all the same. The
    # trials train in their workers (trial_isolation: none): the lines are the workers', and
    # each worker's fork server would cost seconds of imports.
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 2, "trial_isolation": "none"},
        training={"log_every_steps": 1, "epochs": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    out = _on_a_terminal(
        [
            "run",
            "--study",
            "s",
            "--config",
            str(config),
            "--storage",
            f"sqlite:///{tmp_path / 'p.db'}",
            "--gpus",
            "0,1",
        ],
        tmp_path,
        env={"HPO_TEST_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert re.search(r"gpu[01]: trial #[01] · epoch ", out), out[-3000:]
    assert "study: " in out  # and the workers' log lines came through:
    assert re.search(r"trial [01] (finished|pruned)", out), out[-3000:]
    assert progress.RELAY_MARK not in out  # the launcher drew them; nothing raw leaked
    rows = _screen(out, 80)
    _assert_clean(rows, progress_rows=0)  # the block is gone at the end, and left no copy
    # The workers' summaries (their stdout) start rows of their own, not glued to the block.
    summaries = [row for row in rows if "study 's': " in row]
    assert summaries and all(row.startswith("study 's': ") for row in summaries), rows


def test_the_launcher_draws_a_line_per_worker_below_their_log_lines() -> None:
    screen = Terminal()
    block = progress.LiveBlock(screen, width=60)
    relay = Terminal()
    worker_line = progress._RelayLine(relay)  # what a worker of --gpus sends up
    worker_line.update_trial(0, {"step": 3})
    worker_line.update_study("study: 0 complete, 0 pruned, 0 fail")
    for sent in relay.getvalue().splitlines():
        block.feed("gpu0", sent)
    block.feed("gpu1", progress.RELAY_MARK + '{"trial": "trial #1 · step 7", "study": ""}')
    assert block.lines() == [
        "gpu0: trial #0 · step 3",
        "gpu1: trial #1 · step 7",
        "study: 0 complete, 0 pruned, 0 fail",
    ]
    block.feed("gpu1", "[gpu1] trial 1 finished: accuracy=0.9")  # a log line: printed above
    out = screen.getvalue()
    # The three lines are cleared (cursor up two, clear below), the log line printed, then drawn.
    assert out.endswith(
        "\x1b[2A\r\x1b[J[gpu1] trial 1 finished: accuracy=0.9\n"
        + f"{progress.NO_WRAP}{chr(10).join(block.lines())}{progress.WRAP}"
    )
    block.feed("gpu0", progress.RELAY_MARK + '{"trial": "", "study": ""}')  # its trial ended
    assert block.lines() == ["gpu1: trial #1 · step 7", "study: 0 complete, 0 pruned, 0 fail"]
    block.feed("gpu0", progress.RELAY_MARK + "{not json")  # shown as it came, never a crash
    assert "{not json\n" in screen.getvalue()
    block.close()
    assert screen.getvalue().endswith("\x1b[1A\r\x1b[J")


def test_the_launchers_block_of_wide_lines_leaves_no_debris() -> None:
    term = Screen()
    block = progress.LiveBlock(term, width=40)
    wide = "trial #0 · step 3 · 正解率正解率正解率 0.5000"  # 46 columns of 40
    study = "study: 0 complete, 0 pruned, 0 fail, budget 4"
    block.feed("gpu0", progress.RELAY_MARK + json.dumps({"trial": wide, "study": study}))
    block.feed("gpu1", progress.RELAY_MARK + json.dumps({"trial": "trial #1 · step 7"}))
    block.feed("gpu1", "2026-11-25 20:51:46 [gpu1] trial 1 done")
    block.feed("gpu0", progress.RELAY_MARK + json.dumps({"trial": wide, "study": study}))
    rows = [row for row in term.rows(40) if row]
    assert rows[0] == "2026-11-25 20:51:46 [gpu1] trial 1 done", rows
    assert rows[1].startswith("gpu0: trial #0 · step 3 · 正解") and len(rows) == 4, rows
    assert all(progress.display_width(row) <= 39 for row in rows)
    block.feed("gpu0", "study 's': 4 trials (4 complete)", out=term)  # a worker's stdout
    block.close()
    assert [row for row in term.rows(40) if row] == [
        "2026-11-25 20:51:46 [gpu1] trial 1 done",
        "study 's': 4 trials (4 complete)",
    ]


def test_a_watched_status_is_drawn_in_place_within_the_screen() -> None:
    lines = ["study 's': 4 complete", "x" * 100, "best #0: 1.0000", "device-hours 0.001"]
    term = Screen()
    term.write("$ hpo status --watch\n")
    for _ in range(3):
        term.write(progress.screen_frame(lines, 40, 6))
    rows = term.rows(40, 6)
    assert rows == ["study 's': 4 complete", "x" * 39, "x" * 39, "… 3 more lines", "", ""]
    assert len(rows) == 6  # nothing scrolled into the scrollback


def test_hpo_status_watch_on_a_terminal_of_80_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    study = optuna.create_study(storage=url, study_name="s", directions=["maximize"] * 2)
    names = ("learning_rate", "weight_decay", "warmup_ratio")
    space = {name: optuna.distributions.FloatDistribution(1e-5, 1.0) for name in names}
    for k in range(4):  # all four on the Pareto front, each line wider than 80 columns
        params = dict.fromkeys(names, 0.0123456789 * (k + 1))
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=space,
                values=[0.5 + k / 10, 1 - k / 10],
            )
        )
    primary, secondary = pty.openpty()
    _set_size(secondary, 80, 8)
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO)}
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpo",
            "status",
            "--study",
            "s",
            "--storage",
            url,
            "--watch",
            "--interval",
            "0.2",
        ],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    out = b""
    while select.select([primary], [], [], 60)[0]:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(primary)
    assert watch.wait(timeout=30) == 0, out.decode()
    rows = _screen(out.decode(), 80, 8)
    assert len(rows) == 8, "\n".join(rows)  # nothing scrolled off: no old status above
    assert sum("study 's':" in row for row in rows) == 1, "\n".join(rows)
    assert all(len(row) < 80 for row in rows), "\n".join(rows)
    assert rows[-2:] == ["hpo: study 's' has ended", ""], "\n".join(rows)
    assert re.fullmatch(r"… \d more lines", rows[-3]), "\n".join(rows)  # the rest: no room


def test_a_new_evaluation_value_is_drawn_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: a trial's last evaluation comes within a quarter second of the loss before
    it, and the line kept the previous evaluation's value until the trial ended."""
    line = progress.LiveLine(Terminal(), width=200)
    monkeypatch.setattr(progress, "_line", line)
    monkeypatch.setattr(progress, "_last_draw", 0.0)
    monkeypatch.setattr(progress, "_last_metric", None)
    progress.trial_progress(2, {"step": 9, "loss": 0.6, "metric": ("accuracy", 0.5)})
    progress.trial_progress(2, {"step": 10, "loss": 0.5, "metric": ("accuracy", 0.5)})
    assert "step 9 " in line.text()  # a loss alone: still at most 4 draws a second
    progress.trial_progress(2, {"step": 10, "loss": 0.5, "metric": ("accuracy", 0.8123)})
    assert line.text() == "trial #2 · step 10 · loss 0.500 · accuracy 0.8123"
