"""Live progress of a worker on a terminal: one line, rewritten in place, with the running
trial (trial k of N, epoch, step, samples/s, loss, last metric, time left) and the study
(complete, pruned, failed, best so far). Log lines still scroll above it: the line is cleared
before each log record and drawn again after. Off when stderr is not a terminal (a log file,
a pipe, a job scheduler): the plain log lines are the record there.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Any, TextIO

CLEAR = "\r\x1b[K"
# Set for the workers that `hpo run --gpus` starts when its own output is not a terminal.
OFF_ENV = "HPO_NO_LIVE_LINE"
# Set for those workers when it is: each sends its line's parts up as one marked line on
# stderr, and the launcher draws one line per worker (LiveBlock).
RELAY_ENV = "HPO_LIVE_RELAY"
RELAY_MARK = "\x02hpo-live "  # never the start of a log line (STX, and not a line break)


class LiveLine:
    """The worker's progress line; `update_trial` and `update_study` change its parts."""

    def __init__(self, stream: TextIO, width: int = 0) -> None:
        self.stream = stream
        self.width = width
        self.trial = ""
        self.study = ""
        self._lock = threading.RLock()

    def update_trial(self, number: int, progress: dict[str, Any]) -> None:
        self.trial = trial_text(number, progress)
        self.draw()

    def end_trial(self) -> None:
        self.trial = ""
        self.draw()

    def update_study(self, text: str) -> None:
        self.study = text
        self.draw()

    def text(self) -> str:
        line = " | ".join(part for part in (self.trial, self.study) if part)
        width = self.width or _terminal_width(self.stream)
        return line if len(line) < width else line[: max(0, width - 2)] + "…"

    def draw(self) -> None:
        with self._lock:
            self.stream.write(CLEAR + self.text())
            self.stream.flush()

    def clear(self) -> None:
        with self._lock:
            self.stream.write(CLEAR)
            self.stream.flush()


def trial_text(number: int, progress: dict[str, Any]) -> str:
    """`trial #4 · epoch 1.3/3 · step 120/300 · 412 samples/s · loss 0.531 · accuracy 0.81 ·
    1m20s left` (the parts that are known). The trial's number is Optuna's, as in the log and
    the dashboard; how much of the budget is spent is the study part's (a retry has a number
    past the budget)."""
    parts = [f"trial #{number}"]
    epoch, epochs = progress.get("epoch"), progress.get("epochs")
    if epoch is not None:
        parts.append(f"epoch {epoch:.1f}/{epochs}" if epochs else f"epoch {epoch:.1f}")
    step, steps = progress.get("step"), progress.get("total_steps")
    if step is not None:
        parts.append(f"step {step}/{steps}" if steps else f"step {step}")
    rate = progress.get("samples_per_s")
    if rate:
        parts.append(f"{rate:.0f} samples/s")
    loss = progress.get("loss")
    if loss is not None and math.isfinite(loss):
        parts.append(f"loss {loss:.3f}")
    metric = progress.get("metric")
    if metric is not None:
        parts.append(f"{metric[0]} {metric[1]:.4f}")
    left = progress.get("seconds_left")
    if left is not None and math.isfinite(left):
        parts.append(f"{_duration(left)} left")
    return " · ".join(parts)


def study_text(counts: dict[str, int], best: float | None, budget: int | None = None) -> str:
    """`study: 3 complete, 2 pruned, 0 fail, budget 16; best 0.9123`."""
    done = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("complete", "pruned", "fail"))
    done += f", budget {budget}" if budget is not None else ""
    return f"study: {done}" + (f"; best {best:.4f}" if best is not None else "")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _terminal_width(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        columns = 0
    return columns or 120  # 0: a terminal that does not say (a bare pty)


class _RelayLine(LiveLine):
    """The line of a worker whose launcher draws it: every change goes up as a marked line."""

    def draw(self) -> None:
        with self._lock:
            self.stream.write(RELAY_MARK + json.dumps({"trial": self.trial, "study": self.study}))
            self.stream.write("\n")
            self.stream.flush()

    def clear(self) -> None:
        pass  # the launcher's block owns the terminal


class LiveBlock:
    """The launcher's view of its workers on a terminal: a line per worker with a running
    trial and the study's line, below the log lines of every worker, which it prints for them
    (each worker's stderr comes through `feed`)."""

    def __init__(self, stream: TextIO, width: int = 0) -> None:
        self.stream, self.width = stream, width
        self.trials: dict[str, str] = {}
        self.study = ""
        self._drawn = 0  # lines of the block on the screen now
        self._lock = threading.Lock()

    def feed(self, label: str, line: str) -> None:
        """One line of a worker's stderr: its progress, or a log line to print above."""
        parts = _relayed(line)
        with self._lock:
            self._clear()
            if parts is None:
                self.stream.write(line + "\n")
            else:
                self.trials[label] = str(parts.get("trial") or "")
                self.study = str(parts.get("study") or self.study)
            self._draw()

    def lines(self) -> list[str]:
        width = self.width or _terminal_width(self.stream)
        shown = [f"{label}: {text}" for label, text in sorted(self.trials.items()) if text]
        shown += [self.study] if self.study else []
        return [line if len(line) < width else line[: max(0, width - 2)] + "…" for line in shown]

    def close(self) -> None:
        with self._lock:
            self._clear()
            self.stream.flush()

    def _clear(self) -> None:
        if self._drawn:
            up = f"\x1b[{self._drawn - 1}A" if self._drawn > 1 else ""
            self.stream.write(f"{up}\r\x1b[J")
            self._drawn = 0

    def _draw(self) -> None:
        shown = self.lines()
        self.stream.write("\n".join(shown))
        self.stream.flush()
        self._drawn = len(shown)


def _relayed(line: str) -> dict[str, Any] | None:
    if not line.startswith(RELAY_MARK):
        return None
    try:
        parts = json.loads(line[len(RELAY_MARK) :])
    except ValueError:
        return None
    return parts if isinstance(parts, dict) else None


def wanted(stream: TextIO) -> bool:
    """Whether progress lines belong on `stream`: a terminal that can redraw, not turned off."""
    return stream.isatty() and os.environ.get("TERM") != "dumb" and not os.environ.get(OFF_ENV)


class _KeepLineHandler(logging.Handler):
    """Wraps the terminal's log handler: clears the live line, lets the record print, draws
    the line again below it."""

    def __init__(self, inner: logging.Handler, line: LiveLine) -> None:
        super().__init__(inner.level)
        self.inner, self.line = inner, line

    def emit(self, record: logging.LogRecord) -> None:
        with self.line._lock:
            self.line.clear()
            self.inner.emit(record)
            self.line.draw()


_line: LiveLine | None = None
_last_draw = 0.0


def start(stream: TextIO = sys.stderr) -> LiveLine | None:
    """The live line on `stream` when it is a terminal (and TERM is not `dumb`), with the root
    logger's handlers on that stream wrapped to keep it below the log; None otherwise."""
    global _line
    if os.environ.get(RELAY_ENV):
        _line = _RelayLine(stream)  # a worker of `--gpus`: its launcher draws the line
        return _line
    if not wanted(stream):
        return None
    _line = LiveLine(stream)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "stream", None) is stream:
            root.removeHandler(handler)
            root.addHandler(_KeepLineHandler(handler, _line))
    return _line


def stop() -> None:
    """Clear the line and give the log handlers back."""
    global _line
    if _line is None:
        return
    _line.clear()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _KeepLineHandler):
            root.removeHandler(handler)
            root.addHandler(handler.inner)
    _line = None


def trial_progress(number: int, progress: dict[str, Any]) -> None:
    """A running trial's progress, from the worker's relay or from the trial itself in the
    worker; drawn at most 4 times a second."""
    global _last_draw
    if _line is None:
        return
    now = time.monotonic()
    if now - _last_draw >= 0.25:
        _last_draw = now
        _line.update_trial(number, progress)


def active() -> bool:
    return _line is not None


def trial_ended() -> None:
    if _line is not None:
        _line.end_trial()


def study_progress(counts: dict[str, int], best: float | None, budget: int | None) -> None:
    if _line is not None:
        _line.update_study(study_text(counts, best, budget))
