"""A trial's artifacts in the shared store: its checkpoints uploaded in the background while it
trains (the newest of each kind supersedes an older one still queued; failures that may pass
retried with backoff, a refusal not retried; never fatal), and its state fetched from the
store when a retry on another host starts. A sharded run's state goes with every rank's share
(sharded_upload).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hpo.storage.artifacts import (
    ArtifactStore,
    ArtifactStoreError,
    ArtifactTarget,
    Manifest,
    StoreRefused,
)
from hpo.trainer.checkpoint import STATE_FILE, CheckpointStore
from hpo.trial.sharded_upload import adopt_sharded_state, staged_state

log = logging.getLogger(__name__)

# Order of a round: the best model before the state that names its evaluation, so that a
# state in the store always has its best model there too.
UPLOAD_ORDER = ("best-model", "state")
# A file in a trial's local folder naming the stored state that its checkpoint.pt is a copy of:
# a retry on this host then need not download it.
STORED_VERSION_FILE = ".hpo-stored-state"


@dataclass
class Backoff:
    """Seconds between two tries of a failed upload: doubling from `first_s` up to `most_s`."""

    first_s: float = 1.0
    most_s: float = 30.0

    def delay(self, failures: int) -> float:
        return float(min(self.most_s, self.first_s * 2 ** max(0, failures - 1)))


@dataclass
class UploadStats:
    uploads: int = 0
    upload_s: float = 0.0
    uploaded_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class BackgroundUploader:
    """One thread that publishes a trial's checkpoints to the store as they are written.

    `submit` never blocks training: it only records the newest path of its kind. The thread
    publishes best model then state; a failure is recorded (`stats.errors`) and retried after
    a backoff, with whatever is newest by then. A refusal (no credentials, access denied, no
    such bucket: see StoreRefused) ends the trial's uploads: no wait would change it, and each
    trial's end would otherwise wait out study.artifact_patience for nothing."""

    def __init__(
        self, store: ArtifactStore, target: ArtifactTarget, backoff: Backoff | None = None
    ) -> None:
        self.store, self.target = store, target
        self.backoff = backoff or Backoff()
        self.stats = UploadStats()
        self._pending: dict[str, Path] = {}
        self._discarded: set[str] = set()  # kinds no longer wanted: a failed one is not retried
        self._busy = False
        self._failures = 0
        self._refused = False  # the store refused: nothing more is tried
        self._closed = False
        self._ending = False  # close() called: the trial is over, training no longer goes on
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpo-artifact-upload", daemon=True)
        self._thread.start()

    def submit(self, kind: str, path: Path) -> None:
        with self._changed:
            if self._refused:
                return
            self._discarded.discard(kind)
            self._pending[kind] = path
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted is in the store (or refused), at most `timeout_s`;
        whether it is in the store."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return not self._refused

    def close(self, timeout_s: float) -> bool:
        """Flush, then stop the thread; what is still pending after `timeout_s` is given up,
        with the reason recorded."""
        self._ending = True
        done = self.flush(timeout_s)
        with self._changed:
            given_up = sorted(self._pending)
            self._pending.clear()
            self._closed = True
            self._changed.notify_all()
        if given_up:
            reason = self.stats.errors[-1] if self.stats.errors else "no answer from the store"
            self._record(f"{', '.join(given_up)} not uploaded after {timeout_s:g} s: {reason}")
        return done and not given_up

    def discard(self, kind: str) -> None:
        """Drop a pending upload of `kind` (the trial ended: its state is no longer needed); one
        in flight that fails is not tried again (its file stays until the worker has recorded
        the trial's end: it would be, for the whole artifact patience)."""
        with self._changed:
            self._pending.pop(kind, None)
            self._discarded.add(kind)
            self._changed.notify_all()

    def abandon(self, wait_s: float = 0.0) -> bool:
        """Stop without uploading what is pending (a trial that will not be resumed). An
        upload in flight is waited for, up to `wait_s`: the kept trial process lives on, and a
        worker that ends next would cut it, leaving a half-written file no manifest names and no
        cleanup finds. Whether none is in flight any more."""
        deadline = time.monotonic() + wait_s
        self._ending = True
        with self._changed:
            self._pending.clear()
            self._closed = True
            self._changed.notify_all()
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                kind = next(k for k in UPLOAD_ORDER if k in self._pending)
                path = self._pending.pop(kind)
                self._busy = True
            ok = self._publish(kind, path)
            with self._changed:
                self._busy = False
                if self._refused:
                    self._pending.clear()
                # Discarded, or its file gone (the trial dropped it): nothing to retry.
                if not ok and not self._refused and kind not in self._discarded and path.exists():
                    self._pending.setdefault(kind, path)  # unless a newer one came meanwhile
                    self._failures += 1
                    self._changed.notify_all()
                    self._changed.wait(self.backoff.delay(self._failures))
                else:
                    self._failures = 0
                    self._changed.notify_all()

    def _publish(self, kind: str, path: Path) -> bool:
        started = time.perf_counter()
        source = path
        try:
            source = staged_state(path) if kind == "state" else path
            manifest = self.store.publish(self.target.study, self.target.folder, kind, source)
        except StoreRefused as e:
            self._refused = True  # before the warning: it says what happens next
            self._record(f"{kind} not uploaded to {self.target.url}: {e}")
            return False
        except (ArtifactStoreError, OSError) as e:
            self._record(f"{kind} not uploaded to {self.target.url}: {e}")
            return False
        finally:
            if source != path:
                shutil.rmtree(source, ignore_errors=True)
        if kind == "state":
            _remember_stored_version(path.parent, manifest.version)
        self.stats.uploads += 1
        self.stats.upload_s += time.perf_counter() - started
        self.stats.uploaded_bytes += manifest.size
        log.debug("%s of %s uploaded (%d bytes)", kind, self.target.folder, manifest.size)
        return True

    def _record(self, reason: str) -> None:
        if not self.stats.errors or self.stats.errors[-1] != reason:
            then = "the trial ends without it" if self._ending else "training goes on"
            if self._refused:
                then = f"the store refused, no more uploads of this trial; {then}"
            log.warning("%s; %s", reason, then)
        self.stats.errors.append(reason[:500])


def fetch_resume_state(
    store: ArtifactStore, target: ArtifactTarget, checkpoints: CheckpointStore
) -> bool:
    """A retry: unless its folder holds the newest state (this host wrote it, or fetched it,
    and no other host has published one since), the trial's best model and state (a sharded
    run's with every rank's share) come from the store into its folder, each checked against
    its manifest's hashes. Whether a state came; the
    fingerprint check of the training decides whether it is used."""
    directory = checkpoints.directory
    aside = directory / f".download-{uuid.uuid4().hex[:8]}"
    try:
        stored = store.manifest(target.study, target.folder, "state")
        if stored is None or _local_state_is_newest(checkpoints.state_path, stored):
            return False
        model = store.fetch(target.study, target.folder, "best-model", aside / "best-model")
        if model is not None:
            checkpoints.adopt_best_model(aside / "best-model")
        state = store.fetch(target.study, target.folder, "state", aside / "state")
        if state is None:
            return False
        adopt_sharded_state(aside / "state", directory)  # a sharded run's: before its state
        (aside / "state" / STATE_FILE).replace(checkpoints.state_path)
        _remember_stored_version(directory, state.version)
        return True
    except (ArtifactStoreError, OSError) as e:
        reason = f"resume state not fetched from {target.url}: {e}"
        log.warning("%s; training starts over", reason)
        checkpoints.errors.append(reason[:500])
        return False
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _local_state_is_newest(state_path: Path, stored: Manifest) -> bool:
    """The local state is the stored one (its version remembered), or was written after the
    stored one was published (its upload never finished): either way, no download."""
    if not state_path.is_file():
        return False
    if _stored_version(state_path.parent) == stored.version:
        return True
    return state_path.stat().st_mtime > stored.published_at()


def _stored_version(directory: Path) -> str | None:
    try:
        return (directory / STORED_VERSION_FILE).read_text(encoding="utf-8")
    except OSError:  # none: this host never uploaded nor fetched a state of the trial
        return None


def _remember_stored_version(directory: Path, version: str) -> None:
    """Which stored state the local one is, for the next retry on this host."""
    try:
        (directory / STORED_VERSION_FILE).write_text(version, encoding="utf-8")
    except OSError as e:
        log.debug("cannot note the stored state's version in %s: %s", directory, e)
