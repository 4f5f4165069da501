"""What one trial trains on (its task, pickled into the trial process) and the batch-size
cache its training reads: shared by the worker's side (hpo.trial.objective) and the training side
(hpo.trial.training), so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.config.schema import Config
from hpo.config.search_paths import with_params
from hpo.plugins.protocols import TrialLike
from hpo.storage.artifacts import ArtifactTarget
from hpo.storage.batch_cache import BatchSizeCache, RelayedBatchCache
from hpo.storage.engine import create_engine
from hpo.storage.url import StorageURL
from hpo.trainer.config import TrainJob
from hpo.trial.child import ChildTrial

if TYPE_CHECKING:
    from hpo.trainer.data import PreparedData


@dataclass
class TrialTask:
    """What one trial trains on; pickled into the trial process."""

    config: Config
    data: PreparedData
    storage_url: StorageURL
    params: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None  # this configuration's folder, shared by its retries
    study_name: str = ""  # whose marker the folder carries (made again if it vanishes)
    resume: bool = False  # a retry: resume from the folder's checkpoint if there is one
    asked_at: float | None = None  # wall clock (time.time()) when the trial was created
    full_data: bool = False  # train on the evaluation split too (hpo retrain --full-data)
    artifacts: ArtifactTarget | None = None  # the shared store, when the study has one
    cpu_worker: Path | None = None  # the worker's entry among the host's CPU workers (cpu_share)
    # The data of each model (and max_length) a trial may choose, by data_key: prepared by the
    # worker's checks before the first trial, or by the first trial that needs it. Cached
    # splits pickle as their cache folder: sending them to the trial process copies no tokens.
    prepared: dict[str, PreparedData] = field(default_factory=dict)


def data_key(job: TrainJob) -> str:
    """What a job's tokenized data depends on besides the files: its tokenizer and data
    settings. Jobs with one key train on the same PreparedData."""
    tokenizer = job.model.tokenizer or job.model.name_or_path
    return json.dumps([tokenizer, dataclasses.asdict(job.data)], sort_keys=True, default=str)


def data_for(task: TrialTask, job: TrainJob) -> PreparedData:
    """A trial's data: the config's own, one the worker prepared for its model choice, or one
    tokenized now (the token cache on disk makes it a read after the first time)."""
    key = data_key(job)
    if key not in task.prepared:
        if key == data_key(with_params(task.config, {})):
            return task.data
        from hpo.trainer.model import load_tokenizer
        from hpo.trainer.tasks import prepare_data

        task.prepared[key] = prepare_data(
            job.data, load_tokenizer(job.model, job.task), job.task, job.training
        )
    return task.prepared[key]


def batch_cache_for(storage_url: StorageURL, patience_s: float) -> BatchSizeCache:
    """The study's batch-size cache on an engine of its own."""
    return BatchSizeCache(create_engine(storage_url, patience_s))


# The worker's cache per storage URL, set by its Objective: a trial in the worker uses it.
_worker_caches: dict[str, BatchSizeCache] = {}


def remember_worker_cache(storage_url: StorageURL, cache: BatchSizeCache) -> None:
    """The worker's own cache, for the trials it trains in its own process."""
    _worker_caches[storage_url.url] = cache


def batch_cache(trial: TrialLike, task: TrialTask) -> BatchSizeCache | RelayedBatchCache:
    """The batch-size cache of a trial's training: a trial process asks its worker (it opens
    no database connection); a trial in the worker uses the worker's cache."""
    if isinstance(trial, ChildTrial):
        return RelayedBatchCache(trial.ask)
    url = task.storage_url.url
    if url not in _worker_caches:
        _worker_caches[url] = batch_cache_for(task.storage_url, task.config.study.database_patience)
    return _worker_caches[url]
