"""What a training run returns: its status, evaluations, best evaluation, the batch it ran with
and throughput figures; plain data that `hpo` records as trial attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpo.trainer.batch_finder import BatchSearch
from hpo.trainer.compiled import CompileStats
from hpo.trainer.evaluation import Evaluation
from hpo.trainer.progress import Status


@dataclass
class TrainResult:
    status: Status
    stop_reason: str | None
    evaluations: list[Evaluation]
    best: Evaluation | None
    effective_batch_size: int
    physical_batch_size: int
    grad_accum_steps: int
    optimizer_steps: int
    samples_per_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    wall_s: float
    train_s: float
    eval_s: float
    device_name: str
    precision: str
    optimizer: str
    metric: str
    oom_recoveries: int = 0
    batch_search: BatchSearch | None = None
    batch_source: str | None = None  # a run across ranks: config, search or cache
    resumed_at_step: int | None = None
    checkpoint_errors: list[str] = field(default_factory=list)
    first_step_at: float | None = None  # wall clock (time.time()) after the first step
    fit_started_at: float | None = None  # wall clock once model, optimizer and loaders are built
    compiled: CompileStats | None = None  # what this run compiled, with model.compile
    trainable_params: int = 0  # what the optimizer updates: a LoRA run's adapter and head
    total_params: int = 0
    # Bytes of weights and optimizer state rank 0 holds at the end (strategy fsdp: its share;
    # a whole-model run holds them all, about 12 bytes a parameter with fp32 AdamW).
    rank_state_bytes: int | None = None

    @property
    def curve(self) -> list[float]:
        return [e.metrics[self.metric] for e in self.evaluations]
