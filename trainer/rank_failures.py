"""Why a run across ranks ended, from what each rank said of itself over its line to the
launching process and what torch's launcher saw (trainer.launch reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hpo.trainer.memory import OutOfMemoryAtBatchOne


class RankFailed(Exception):
    """A rank of the run ended without finishing it: killed, crashed, or it raised; the
    message names the rank and what the launcher saw (its exit code or its error)."""


@dataclass
class RankWords:
    """What one rank said of itself: its pid, and how it ended (None: it never said)."""

    pid: int | None = None
    ended: bool = False
    error: BaseException | None = None

    def record(self, message: tuple[Any, ...]) -> None:
        if message[0] == "started":
            self.pid = message[1]
        elif message[0] == "ended":
            self.ended = True
        elif message[0] == "error":
            self.error, self.ended = message[1], True


def last_words(conn: Connection) -> RankWords:
    words = RankWords()
    try:
        while conn.poll(0):
            words.record(conn.recv())
    except (EOFError, OSError):
        pass
    return words


def cause(words: list[RankWords], failure: BaseException | None) -> BaseException:
    """The error that says why the run ended (see _Launch.result). A rank's own error (not a
    collective that failed for want of a peer) first: rank 0's as it was raised. Then a rank
    that died without a word, preferring one the launcher saw killed by a signal other than its
    own SIGTERM (which it sends the ranks left once one failed)."""
    own = [(r, w.error) for r, w in enumerate(words) if w.error and not lost_a_peer(w.error)]
    if own:
        rank, error = own[0]
        # Out of memory is the configuration's, whichever rank hit it (a sharded step's, at
        # which trainer.launch starts the ranks again): raised as it was, so the trial is
        # pruned rather than retried.
        if (rank == 0 or isinstance(error, OutOfMemoryAtBatchOne)) and error is not None:
            return error
        return RankFailed(f"rank {rank} (pid {words[rank].pid}): {type(error).__name__}: {error}")
    reported = failure.failures if isinstance(failure, ChildFailedError) else {}
    silent = [r for r, w in enumerate(words) if w.pid is not None and not w.ended]
    silent.sort(key=lambda r: 0 if _killed_by(reported.get(r)) not in (None, "SIGTERM") else 1)
    if silent:
        rank = silent[0]
        signal_name = _killed_by(reported.get(rank))
        how = (
            f"was killed by {signal_name}"
            if signal_name is not None
            else "ended without an error of its own (killed by a signal, or crashed)"
        )
        return RankFailed(f"rank {rank} (pid {words[rank].pid}) {how}")
    if isinstance(failure, ChildFailedError):
        return RankFailed(_failure_text(failure))
    if words[0].error is not None:
        return words[0].error
    return RankFailed(f"the launcher failed: {failure}")


def _killed_by(failure: Any) -> str | None:
    """The signal that ended a rank as the launcher saw it, if one did."""
    if failure is None or failure.exitcode >= 0:
        return None
    name = failure.signal_name()
    return name if isinstance(name, str) and name != "<N/A>" else None


def lost_a_peer(error: BaseException) -> bool:
    """Whether a rank's error is a collective that failed because another rank is gone (gloo
    and NCCL raise RuntimeError, newer torch a DistError), not a cause of its own."""
    return type(error) is RuntimeError or isinstance(error, dist.DistError)


def _failure_text(error: ChildFailedError) -> str:
    """The first rank that failed as the launcher saw it: its signal or exit code, and its
    error's text."""
    rank, failure = error.get_first_failure()
    signal_name = failure.signal_name()
    if failure.exitcode < 0 and signal_name != "<N/A>":
        return f"rank {rank} (pid {failure.pid}) was killed by {signal_name}"
    message = failure.message
    said = message.get("message", "") if isinstance(message, dict) else ""
    text = f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"
    return f"{text}: {str(said).strip()[:500]}" if said else text
