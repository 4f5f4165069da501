"""Live progress: one line on a terminal, rewritten in place under the scrolling log; nothing
of it when stderr is not a terminal."""

from __future__ import annotations

import io
import logging
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from hpo import progress
from tests.conftest import REPO, tiny_config, write_config


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_lines_say_where_the_trial_and_the_study_are() -> None:
    text = progress.trial_text(4, 24, {
        "epoch": 1.25, "epochs": 3, "step": 120, "total_steps": 300, "samples_per_s": 412.3,
        "loss": 0.5312, "metric": ("accuracy", 0.8123), "seconds_left": 80.4,
    })  # fmt: skip
    assert text == (
        "trial 5/24 · epoch 1.2/3 · step 120/300 · 412 samples/s · loss 0.531 · "
        "accuracy 0.8123 · 1m20s left"
    )
    assert progress.trial_text(0, None, {"loss": float("nan")}) == "trial 1"
    assert progress.study_text({"complete": 3, "pruned": 2}, 0.91234) == (
        "study: 3 complete, 2 pruned, 0 fail; best 0.9123"
    )
    line = progress.LiveLine(Terminal(), width=30)
    line.update_study("study: 3 complete, 2 pruned, 0 fail")
    line.update_trial(0, 2, {"step": 1})
    assert line.text() == "trial 1/2 · step 1 | study: …"  # cut to the width


def test_log_records_scroll_above_the_line_and_it_is_drawn_again() -> None:
    stream = Terminal()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [handler]
    try:
        line = progress.start(stream)
        assert line is not None
        progress.trial_progress(2, {"budget": 5, "step": 7})
        logging.getLogger("x").warning("a log line")
        progress.stop()
    finally:
        root.handlers = saved
    out = stream.getvalue()
    drawn = f"{progress.CLEAR}trial 3/5 · step 7"
    assert out.index(drawn) < out.index(f"{progress.CLEAR}a log line\n{drawn}")
    assert out.endswith(progress.CLEAR) and root.handlers == saved
    assert progress.start(io.StringIO()) is None  # not a terminal: no line


def test_hpo_run_on_a_terminal_shows_a_live_line(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, study={"n_trials": 2}, training={"log_every_steps": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    primary, secondary = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO)}
    env.pop("HPO_NO_LIVE_LINE", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "hpo", "run", "--study", "s", "--config", str(config),
         "--storage", f"sqlite:///{tmp_path / 'p.db'}"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env,
    )  # fmt: skip
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
    assert worker.wait(timeout=60) == 0
    out = b"".join(chunks).decode("utf-8", "replace")
    assert f"{progress.CLEAR}trial 1/2 · epoch " in out, out[-3000:]
    assert "samples/s" in out and "study: 1 complete, 0 pruned, 0 fail; best " in out
