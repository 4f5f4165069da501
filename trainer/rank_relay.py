"""The pipe between the launching process and a run's main rank (trainer.launch): rank 0 asks
the run's callbacks (pruning, progress, stop requests, checkpoints, the study's batch cache) and
says how it is doing; the launching process answers and keeps what it said.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpo.trainer.batch_finder import PhysicalBatch
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.evaluation import Evaluation
from hpo.trainer.loop import OnEvaluation, OnProgress, ShouldStop
from hpo.trainer.rank_batch import RankBatchCache
from hpo.trainer.rank_failures import RankFailed, RankWords


class LaunchRelay:
    """The launching process's end of rank 0's pipe: each message is a callback of the run.
    A callback that raises ends the run: its error is kept (and raised once the ranks are
    down) and the pipe closed, so rank 0's next question fails."""

    def __init__(
        self,
        conn: Connection,
        on_evaluation: OnEvaluation | None,
        should_stop: ShouldStop | None,
        on_progress: OnProgress | None,
        checkpoints: CheckpointStore | None,
        batch_cache: RankBatchCache | None = None,
    ) -> None:
        self.conn, self.batch_cache = conn, batch_cache
        self.on_evaluation, self.should_stop = on_evaluation, should_stop
        self.on_progress, self.checkpoints = on_progress, checkpoints
        self.words = RankWords()  # what rank 0 said of itself
        self.open = True
        self.saved_state = False  # rank 0 wrote a resume state
        self.batch: PhysicalBatch | None = None  # rank 0's: its size, cache key and source

    def serve(self, timeout_s: float) -> None:
        try:
            while self.open and self.conn.poll(timeout_s):
                self._answer(self.conn.recv())
                timeout_s = 0
        except (EOFError, OSError):
            self.open = False
        except Exception as e:  # a callback's error, or one rank 0 sent that does not unpickle
            # Kept as rank 0's error (rank 0 then fails on its closed line): it ended the run.
            self.words.error = self.words.error or e
            self.open = False
            self.conn.close()

    def _answer(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "evaluation":
            self.conn.send(self.on_evaluation(message[1]) if self.on_evaluation else None)
        elif kind == "should_stop":
            self.conn.send(bool(self.should_stop()) if self.should_stop else False)
        elif kind == "progress" and self.on_progress is not None:
            self.on_progress(message[1])
        elif kind == "saved":
            self._saved(message[1], message[2], message[3])
        elif kind == "physical_batch":
            self.batch = message[1]
        elif kind.startswith("batch_"):
            self._batch_cache(kind, message[1:])
        elif kind in ("started", "ended", "error"):
            if self.words.error is None or kind == "started":
                self.words.record(message)

    def _batch_cache(self, kind: str, args: tuple[Any, ...]) -> None:
        """The main rank asks the study's cache (none: nothing cached, nothing kept)."""
        cache = self.batch_cache
        if kind == "batch_get":
            self.conn.send(cache.get(*args) if cache is not None else None)
        elif kind == "batch_record":
            self.conn.send(cache.record(*args) if cache is not None else args[1])
        elif kind == "batch_lower" and cache is not None:
            cache.lower(*args)

    def _saved(self, kind: str, path: Path, seconds: float) -> None:
        """Rank 0 wrote a checkpoint: this process's store says what writing cost so far (the
        trial records it) and passes it on (an upload to the artifact store)."""
        self.saved_state = self.saved_state or kind == "state"
        if self.checkpoints is None:
            return
        self.checkpoints.seconds = seconds
        if kind == "state":
            self.checkpoints.last_state_at = time.monotonic()
        if self.checkpoints.on_saved is not None:
            self.checkpoints.on_saved(kind, path)


class RankRelay:
    """Rank 0's end of the pipe: the run's callbacks, answered by the launching process."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def on_evaluation(self, evaluation: Evaluation) -> str | None:
        self.conn.send(("evaluation", evaluation))
        answer: str | None = self.conn.recv()
        return answer

    def should_stop(self) -> bool:
        self.conn.send(("should_stop",))
        return bool(self.conn.recv())

    def progress(self, progress: dict[str, Any]) -> None:
        self.conn.send(("progress", progress))

    def saved(self, kind: str, path: Path, seconds: float) -> None:
        self.conn.send(("saved", kind, path, seconds))

    def physical_batch(self, batch: PhysicalBatch) -> None:
        """The batch the ranks agreed on: an OOM restart keeps its cache key and source."""
        self.conn.send(("physical_batch", batch))

    # The study's batch-size cache (trainer.rank_batch.RankBatchCache), which the trial has.
    def get(self, key: dict[str, Any]) -> int | None:
        self.conn.send(("batch_get", key))
        size: int | None = self.conn.recv()
        return size

    def record(self, key: dict[str, Any], physical_batch_size: int, search: dict[str, Any]) -> int:
        self.conn.send(("batch_record", key, physical_batch_size, search))
        return int(self.conn.recv())

    def lower(self, key: dict[str, Any], physical_batch_size: int) -> None:
        self.conn.send(("batch_lower", key, physical_batch_size))


def say(conn: Connection, *message: Any) -> None:
    """Tell the launching process how this rank is doing; never raises (it may be gone)."""
    try:
        conn.send(message)
    except Exception:  # noqa: BLE001 (an error that does not pickle goes as its text)
        with contextlib.suppress(Exception):
            error = message[-1]
            conn.send((message[0], RankFailed(f"{type(error).__name__}: {error}")))
