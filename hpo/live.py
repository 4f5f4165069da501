"""Live progress of a worker on a terminal: one line, rewritten in place, with the running
trial (trial k of N, epoch, step, samples/s, loss, last metric, time left) and the study
(complete, pruned, failed, best so far). Log lines still scroll above it: everything written
to the terminal's file descriptor while the line is up (this process's log, its trial
processes' log and any other output of theirs) comes through a pipe and is printed above the
line, which is drawn again below it. Off when stderr is not a terminal (a log file, a pipe, a
job scheduler): the plain log lines are the record there.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import select
import sys
import threading
import time
import unicodedata
from collections.abc import Sequence
from typing import Any, TextIO

CLEAR = "\r\x1b[K"
# Autowrap off while a progress line is drawn, on after: should the width be stale (a resize
# between reading it and drawing) or a character wider on this terminal than measured, the
# line is cut at the edge instead of wrapping onto a row the next redraw does not clear.
NO_WRAP, WRAP = "\x1b[?7l", "\x1b[?7h"
# Set for the workers that `hpo run --gpus` starts when its own output is not a terminal.
OFF_ENV = "HPO_NO_LIVE_LINE"
# Set for those workers when it is: each sends its line's parts up as one marked line on
# stderr, and the launcher draws one line per worker (LiveBlock).
RELAY_ENV = "HPO_LIVE_RELAY"
RELAY_MARK = "\x02hpo-live "  # never the start of a log line (STX, and not a line break)


def display_width(text: str) -> int:
    """Columns `text` takes on a terminal: two for a wide (East Asian) character, none for a
    combining mark or a control character, one for the rest."""
    return sum(_char_width(char) for char in text)


def _char_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cc", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def fit(text: str, columns: int) -> str:
    """`text` on one row of a terminal `columns` wide, cut with an ellipsis where it does not
    fit. It never reaches the last column: a character there leaves the cursor waiting to wrap,
    and what the terminal does next (a carriage return, a line break, a resize) differs from
    one terminal to the next; one column short, every terminal redraws the row the same."""
    text = "".join(" " if unicodedata.category(char) == "Cc" else char for char in text)
    room = max(1, columns - 1)
    if display_width(text) <= room:
        return text
    kept, used = [], 1  # the ellipsis
    for char in text:
        used += _char_width(char)
        if used > room:
            break
        kept.append(char)
    return "".join(kept) + "…"


def terminal_size(stream: TextIO) -> tuple[int, int]:
    """Columns and rows of the terminal `stream` writes to, read again at each call (the
    window may have been resized); 120 x 40 for one that does not say (a bare pty)."""
    try:
        size = os.get_terminal_size(stream.fileno())
        columns, rows = size.columns, size.lines
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        columns, rows = 0, 0
    return columns or 120, rows or 40


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
        return fit(line, self.width or terminal_size(self.stream)[0])

    def draw(self) -> None:
        with self._lock:
            self.stream.write(NO_WRAP + CLEAR + self.text() + WRAP)
            self.stream.flush()

    def clear(self) -> None:
        with self._lock:
            self.stream.write(CLEAR)
            self.stream.flush()

    def write_above(self, text: str) -> None:
        """Print `text` (whole lines) where the line is, and draw the line again below it."""
        with self._lock:
            self.stream.write(CLEAR + text + ("" if text.endswith("\n") else "\n"))
            self.draw()


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
    (each worker's stderr, and its stdout when that is a terminal too, come through `feed`).
    Each line takes one row (cut to the width, read at each draw), so that clearing the block
    moves up exactly as many rows as it drew."""

    def __init__(self, stream: TextIO, width: int = 0) -> None:
        self.stream, self.width = stream, width
        self.trials: dict[str, str] = {}
        self.study = ""
        self._drawn = 0  # rows of the block on the screen now
        self._lock = threading.Lock()

    def feed(self, label: str, line: str, out: TextIO | None = None) -> None:
        """One line of a worker's stderr: its progress, or a log line to print above. A line
        of its stdout comes with `out`, the launcher's stdout, where it is printed above."""
        parts = None if out is not None else _relayed(line)
        with self._lock:
            self._clear()
            if parts is not None:
                self.trials[label] = str(parts.get("trial") or "")
                self.study = str(parts.get("study") or self.study)
            elif out is not None:
                self.stream.flush()  # the block is gone from the screen before the line comes
                out.write(line + "\n")
                out.flush()
            else:
                self.stream.write(line + "\n")
            self._draw()

    def lines(self) -> list[str]:
        columns, rows = (self.width, 0) if self.width else terminal_size(self.stream)
        shown = [f"{label}: {text}" for label, text in sorted(self.trials.items()) if text]
        if rows and len(shown) + 2 > rows:  # a row for the study, one for the cursor
            hidden = len(shown) - max(0, rows - 3)
            shown = shown[: max(0, rows - 3)] + [f"… and {hidden} more workers"]
        shown += [self.study] if self.study else []
        return [fit(line, columns) for line in shown]

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
        self.stream.write(NO_WRAP + "\n".join(shown) + WRAP if shown else "")
        self.stream.flush()
        self._drawn = len(shown)


def screen_frame(lines: Sequence[str], columns: int, rows: int, first: bool = False) -> str:
    """`lines` drawn over the screen from its top, for a view that refreshes in place (`hpo
    status --watch`): each row rewritten and cleared to its end, the rest of the screen
    cleared below. Lines are wrapped one column short of the width, and no more rows are drawn
    than leave two free (a last message, the cursor): nothing scrolls, so no old copy is
    pushed into the scrollback. Only the `first` frame clears the whole screen."""
    wrapped = [(index, row) for index, line in enumerate(lines) for row in _wrap(line, columns)]
    room = max(1, rows - 2)
    shown = [row for _, row in wrapped]
    if len(wrapped) > room:
        cut = wrapped[room - 1][0]  # the first line not shown whole
        shown = shown[: room - 1] + [fit(f"… {len(lines) - cut} more lines", columns)]
    start = "\x1b[H\x1b[2J" if first else "\x1b[H"
    return start + "".join(f"{row}\x1b[K\n" for row in shown) + "\x1b[J"


def _wrap(line: str, columns: int) -> list[str]:
    """`line` in rows of at most `columns - 1` display columns."""
    room = max(1, columns - 1)
    rows, row, used = [], "", 0
    for char in line:
        char = " " if unicodedata.category(char) == "Cc" else char
        width = _char_width(char)
        if used + width > room:
            rows.append(row)
            row, used = "", 0
        row, used = row + char, used + width
    return [*rows, row]


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


class _TerminalPassage:
    """The terminal's file descriptor, taken over while the line is up. Whatever is written
    to it, by this process's log handler or by any process that inherited it (the trial
    processes and their fork server: their log lines, warnings, a crash's traceback), goes
    into a pipe; a thread prints it above the line, whole lines at a time, in the order it was
    written. Without this, a trial process's log line lands after the line's last character
    and the terminal wraps it, and the next redraw clears the wrong row."""

    IDLE_S = 0.1  # a partial line waiting this long is printed as it is

    def __init__(self, stream: TextIO, line: LiveLine) -> None:
        self.stream, self.fd = stream, stream.fileno()
        stream.flush()
        encoding = getattr(stream, "encoding", None) or "utf-8"
        # The line, and what the pipe brings, go to the terminal through a copy of its fd.
        self.terminal = open(os.dup(self.fd), "w", encoding=encoding, errors="replace")  # noqa: SIM115
        line.stream = self.terminal
        self.line: LiveLine | None = line
        self._read_fd, write_fd = os.pipe()
        os.dup2(write_fd, self.fd)
        os.close(write_fd)
        self._releasing, self._drained = threading.Event(), threading.Event()
        self._lock = threading.Lock()  # `line` is not taken away in the middle of a print
        threading.Thread(target=self._forward, name="hpo-live-line", daemon=True).start()

    def release(self) -> None:
        """Give the terminal its fd back, once what is in the pipe is printed. Processes that
        still hold the pipe (an idle fork server) keep their output shown, as plain lines."""
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()
        os.dup2(self.terminal.fileno(), self.fd)
        self._releasing.set()
        self._drained.wait(timeout=2)
        with self._lock:
            self.line = None

    def _forward(self) -> None:
        pending = b""
        while True:
            if not select.select([self._read_fd], [], [], self.IDLE_S)[0]:
                if pending:
                    self._show(pending + b"\n")
                    pending = b""
                if self._releasing.is_set():
                    self._drained.set()
                continue
            chunk = os.read(self._read_fd, 65536)
            if not chunk:  # every writer has gone
                break
            whole, newline, pending = (pending + chunk).rpartition(b"\n")
            if newline:
                self._show(whole + newline)
        if pending:
            self._show(pending + b"\n")
        self._drained.set()
        os.close(self._read_fd)

    def _show(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        with self._lock, contextlib.suppress(OSError, ValueError):
            # Suppressed: the terminal is gone (a closed window under nohup). The pipe is still
            # read, or every writer would hang once it filled.
            if self.line is not None:
                self.line.write_above(text)
            else:
                self.terminal.write(text)
                self.terminal.flush()


_line: LiveLine | None = None
_passage: _TerminalPassage | None = None
_last_draw = 0.0
_last_metric: Any = None  # the evaluation value the line shows


def start(stream: TextIO | None = None) -> LiveLine | None:
    """The live line on `stream` (default: sys.stderr as it is now, not as it was when this
    module was imported) when it is a terminal (and TERM is not `dumb`), with what is written
    to the terminal meanwhile printed above it; None otherwise."""
    global _line, _passage
    stream = stream if stream is not None else sys.stderr
    if os.environ.get(RELAY_ENV):
        _line = _RelayLine(stream)  # a worker of `--gpus`: its launcher draws the line
        return _line
    if not wanted(stream):
        return None
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None  # a terminal only in name: nothing to redraw on
    _line = LiveLine(stream)
    _passage = _TerminalPassage(stream, _line)
    return _line


def show_on(line: LiveLine) -> None:
    """The progress drawn by `line` from now on (a notebook's display: hpo.api.showing), not
    on a terminal; stop() ends it."""
    global _line
    _line = line


def stop() -> None:
    """Print what is still on its way to the terminal, clear the line and give the terminal
    its file descriptor back."""
    global _line, _passage
    if _line is None:
        return
    line, _line = _line, None
    if _passage is not None:
        _passage.release()
        _passage = None
    line.clear()


def trial_progress(number: int, progress: dict[str, Any]) -> None:
    """A running trial's progress, from the worker's relay or from the trial itself in the
    worker; drawn at most 4 times a second, except that a new evaluation's value is drawn at
    once (the last evaluation of a trial is often within a quarter second of the loss before
    it, and would leave the previous evaluation's value on the line)."""
    global _last_draw, _last_metric
    if _line is None:
        return
    now = time.monotonic()
    metric = (number, progress.get("metric"))
    if now - _last_draw >= 0.25 or metric != _last_metric:
        _last_draw, _last_metric = now, metric
        _line.update_trial(number, progress)


def active() -> bool:
    return _line is not None


def trial_ended() -> None:
    if _line is not None:
        _line.end_trial()


def study_progress(counts: dict[str, int], best: float | None, budget: int | None) -> None:
    if _line is not None:
        _line.update_study(study_text(counts, best, budget))
