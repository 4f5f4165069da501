"""Live progress: one line on a terminal, rewritten in place under the scrolling log; nothing
of it when stderr is not a terminal."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
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
    text = progress.trial_text(4, {
        "epoch": 1.25, "epochs": 3, "step": 120, "total_steps": 300, "samples_per_s": 412.3,
        "loss": 0.5312, "metric": ("accuracy", 0.8123), "seconds_left": 80.4,
    })  # fmt: skip
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


def test_log_records_scroll_above_the_line_and_it_is_drawn_again() -> None:
    stream = Terminal()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [handler]
    try:
        line = progress.start(stream)
        assert line is not None
        progress.trial_progress(2, {"step": 7})
        logging.getLogger("x").warning("a log line")
        progress.stop()
    finally:
        root.handlers = saved
    out = stream.getvalue()
    drawn = f"{progress.CLEAR}trial #2 · step 7"
    assert out.index(drawn) < out.index(f"{progress.CLEAR}a log line\n{drawn}")
    assert out.endswith(progress.CLEAR) and root.handlers == saved
    assert progress.start(io.StringIO()) is None  # not a terminal: no line


def _on_a_terminal(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """`hpo ARGS` with a pseudo-terminal as its stdout and stderr: what the terminal got."""
    primary, secondary = pty.openpty()
    full_env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("HPO_NO_LIVE_LINE", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "hpo", *args],
        cwd=cwd, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=full_env,
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
    out = b"".join(chunks).decode("utf-8", "replace")
    assert worker.wait(timeout=60) == 0, out[-3000:]
    return out


def test_hpo_run_on_a_terminal_shows_a_live_line(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, study={"n_trials": 2}, training={"log_every_steps": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    out = _on_a_terminal(
        ["run", "--study", "s", "--config", str(config), "--storage",
         f"sqlite:///{tmp_path / 'p.db'}"], tmp_path,
    )  # fmt: skip
    assert f"{progress.CLEAR}trial #0 · epoch " in out, out[-3000:]
    assert "samples/s" in out and "study: 1 complete, 0 pruned, 0 fail, budget 2; best " in out


def test_workers_of_several_gpus_each_get_a_line_on_the_terminal(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(*easy_data, study={"n_trials": 4}, training={"log_every_steps": 1})
    config = write_config(tmp_path / "c.yaml", raw)
    out = _on_a_terminal(
        ["run", "--study", "s", "--config", str(config), "--storage",
         f"sqlite:///{tmp_path / 'p.db'}", "--gpus", "0,1"], tmp_path,
        env={"HPO_TEST_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert re.search(r"gpu[01]: trial #[0-3] · epoch ", out), out[-3000:]
    assert "study: " in out  # and the workers' log lines came through:
    assert re.search(r"trial [0-3] (finished|pruned)", out), out[-3000:]
    assert progress.RELAY_MARK not in out  # the launcher drew them; nothing raw leaked


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
        "\x1b[2A\r\x1b[J[gpu1] trial 1 finished: accuracy=0.9\n" + "\n".join(block.lines())
    )
    block.feed("gpu0", progress.RELAY_MARK + '{"trial": "", "study": ""}')  # its trial ended
    assert block.lines() == ["gpu1: trial #1 · step 7", "study: 0 complete, 0 pruned, 0 fail"]
    block.feed("gpu0", progress.RELAY_MARK + "{not json")  # shown as it came, never a crash
    assert "{not json\n" in screen.getvalue()
    block.close()
    assert screen.getvalue().endswith("\x1b[1A\r\x1b[J")
