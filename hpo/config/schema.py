"""The study config's schema: typed sections with a description per field, their defaults, and the
rules between a section's own fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# The search space's types are space.py's; importers of the schema find them here too.
from hpo.config.budget import DevicePrice as DevicePrice
from hpo.config.budget import WarmStartConfig as WarmStartConfig
from hpo.config.budget import spend_problems
from hpo.config.notify import NotifyConfig as NotifyConfig
from hpo.config.space import DEFAULT_BATCH_CHOICES as DEFAULT_BATCH_CHOICES
from hpo.config.space import ParamSpec as ParamSpec
from hpo.config.space import applies as applies
from hpo.config.space import default_search_space as default_search_space
from hpo.config.space import has_conditions as has_conditions
from hpo.config.space import sampling_order as sampling_order
from hpo.config.space import space_record as space_record
from hpo.config.trackers import WANDB_FORBIDDEN as WANDB_FORBIDDEN
from hpo.config.trackers import MlflowTrackingConfig as MlflowTrackingConfig
from hpo.config.trackers import TensorboardTrackingConfig as TensorboardTrackingConfig
from hpo.config.trackers import TrackingConfig as TrackingConfig
from hpo.config.trackers import WandbTrackingConfig as WandbTrackingConfig
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig
from hpo.trainer.metrics import Direction
from hpo.trainer.tasks import DEFAULT_TASK, METRIC_DIRECTIONS, TASKS, is_task_path

# Every task's metrics (trainer.tasks.TASKS); the config's task decides which it may name.
MetricName = Literal[
    "accuracy",
    "macro_f1",
    "micro_f1",
    "roc_auc",
    "eval_loss",
    "subset_accuracy",
    "mse",
    "rmse",
    "mae",
    "pearson",
    "spearman",
    "r2",
    "f1",
    "precision",
    "recall",
    "token_accuracy",
    "perplexity",
]
# What a study can optimise: the evaluation metrics, and a trial's training throughput (nested
# Literals flatten).
ObjectiveName = Literal[MetricName, "samples_per_s"]
OBJECTIVE_DIRECTIONS: dict[str, Direction] = {**METRIC_DIRECTIONS, "samples_per_s": "maximize"}
# study.throughput_tolerance: the run-to-run noise of samples/s is a few percent (hpo.study.front).
DEFAULT_THROUGHPUT_TOLERANCE = 0.05
MAX_SECONDS = 1e9  # about 31 years; a timer cannot wait 1e300 s
MAX_ENQUEUED = 1000  # configurations in study.enqueue
DURATION_KEYS = (
    "timeout",
    "trial_timeout",
    "heartbeat_interval",
    "grace_period",
    "checkpoint_interval",
    "database_patience",
    "stop_timeout",
    "artifact_patience",
)


def _artifact_store_problems(url: str) -> list[tuple[str, Any, str]]:
    from hpo.storage.artifacts import (
        ArtifactStoreError,
        masked_artifact_url,
        validated_artifact_url,
    )

    try:
        validated_artifact_url(url)
    except ArtifactStoreError as e:
        return [("artifact_store", masked_artifact_url(url), str(e))]
    return []


# The outage window: how long a worker, and a read command (--database-patience), rides out
# an unreachable study database before it gives up.
DATABASE_PATIENCE_S = 600.0


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class SamplerConfig:
    """How Optuna proposes the next trial."""

    type: Literal["tpe", "random", "gp", "cmaes", "qmc", "grid", "nsga2"] = _doc(
        "tpe (Bayesian, tree-structured Parzen estimators), random, gp (Gaussian process), "
        "cmaes (CMA-ES; categorical parameters are sampled at random; one objective only), qmc "
        "(quasi-random Sobol points), grid (every combination, once; needs a finite search "
        "space) or nsga2 (genetic, for several objectives).",
        "tpe",
    )
    seed: int | None = _doc("Sampler seed, for a reproducible sequence of trials.")
    n_startup_trials: int = _doc(
        "tpe, gp, cmaes: random trials before the sampler's model is used.", 10
    )
    multivariate: bool | None = _doc(
        "tpe: model the parameters jointly, not one by one (learning rate and batch size "
        "interact); default true for tpe."
    )
    group: bool | None = _doc(
        "tpe with multivariate: model parameters that appear together as groups; default "
        "true when a search-space parameter has a `when` (Optuna's advice for conditional "
        "spaces), else false."
    )
    constant_liar: bool = _doc(
        "tpe: count running trials as bad, so parallel workers do not propose the same "
        "configuration in a row.",
        True,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if self.n_startup_trials < 0:
            found.append(("n_startup_trials", self.n_startup_trials, "must be >= 0"))
        if self.seed is not None and not 0 <= self.seed < 2**32:  # numpy's RandomState
            found.append(("seed", self.seed, "must be in [0, 2**32) or null"))
        for key in ("multivariate", "group"):
            if getattr(self, key) and self.type != "tpe":
                found.append((key, True, f"only for type: tpe, not {self.type}"))
        if self.group and self.multivariate is False and self.type == "tpe":
            found.append(("group", True, "needs multivariate: true"))
        return found


# The default pruner's settings (issue 29): the median rule, judged from a trial's second
# evaluation on, acting only on differences beyond 0.02 of the metric (runs at chance level
# differ by less; a late starter is not cut on noise).
DEFAULT_WARMUP = 2
DEFAULT_MARGIN = 0.02


@dataclass
class PrunerConfig:
    """When a weak trial is stopped early, judged at each evaluation."""

    type: Literal["median", "percentile", "successive_halving", "hyperband", "none"] = _doc(
        "median (a trial whose best so far is below the median of the complete trials at the "
        "same evaluation, by more than margin, is stopped; the default, with margin 0.02 and "
        "judged from evaluation 2: chosen by bench/search_efficiency.py on five tasks, it never "
        "ended worse than random search at equal trials on any of them), percentile, "
        "successive_halving (asynchronous successive halving, ASHA: at evaluations "
        "min_resource x reduction_factor^k a trial goes on only if it is in the best "
        "1/reduction_factor of the trials that reached that evaluation), hyperband or none.",
        "median",
    )
    n_startup_trials: int = _doc("median/percentile: complete trials before pruning starts.", 3)
    n_warmup_steps: int = _doc(
        "median/percentile: evaluations of a trial before it can be pruned.", DEFAULT_WARMUP
    )
    percentile: float = _doc("percentile: prune below this percentile of the other trials.", 25.0)
    margin: float = _doc(
        "median/percentile: prune only a trial worse than the median (percentile) by more than "
        "this, in the metric's units (0.01: one point of accuracy), so that differences within "
        "evaluation noise, such as runs that all sit at chance level before their metric "
        "jumps, prune nothing.",
        DEFAULT_MARGIN,
    )
    min_resource: int | None = _doc("successive_halving/hyperband: evaluations before a rung.")
    reduction_factor: int = _doc("successive_halving/hyperband: keep 1/this at each rung.", 3)
    patience: int | None = _doc(
        "Optuna's PatientPruner around the pruner: a trial may be pruned only once its last "
        "patience + 1 evaluations are all worse (by more than min_delta) than its best before "
        "them, so a trial that still improves is never pruned; with type none, such a trial is "
        "pruned. null: no patience."
    )
    min_delta: float = _doc("patience: how much worse an evaluation must be to count.", 0.0)
    objective: str | None = _doc(
        "With several objectives (study.metric a list): the one the pruner judges, e.g. "
        "accuracy in [accuracy, samples_per_s]. A trial weak on it is stopped as with one "
        "objective, and the Pareto front still uses all of them (a pruned trial is on no "
        "front); with samples_per_s an objective, a trial is compared only with the trials at "
        "least as fast (within throughput_tolerance), so fast trade-offs are kept. An "
        "evaluation metric of study.metric, not samples_per_s (measured at the trial's end). "
        "null: with several objectives nothing is pruned (Optuna's pruners serve one "
        "objective; hpo judges this one in a one-objective view of the study)."
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        for key in ("n_startup_trials", "n_warmup_steps"):
            if getattr(self, key) < 0:
                found.append((key, getattr(self, key), "must be >= 0"))
        if not 0 < self.percentile < 100:
            found.append(("percentile", self.percentile, "must be in (0, 100)"))
        if self.min_resource is not None and self.min_resource < 1:
            found.append(("min_resource", self.min_resource, "must be a positive integer or null"))
        if self.reduction_factor < 2:
            found.append(("reduction_factor", self.reduction_factor, "must be >= 2"))
        if self.patience is not None and self.patience < 0:
            found.append(("patience", self.patience, "must be >= 0 or null"))
        if self.type not in ("median", "percentile"):
            for key, default in (("n_startup_trials", 3), ("n_warmup_steps", DEFAULT_WARMUP)):
                if getattr(self, key) != default:
                    found.append(
                        (
                            key,
                            getattr(self, key),
                            f"only for median or percentile, "
                            f"not {self.type}; set type: median to use it",
                        )
                    )
        if self.margin < 0:
            found.append(("margin", self.margin, "must be >= 0"))
        elif self.margin not in (0.0, DEFAULT_MARGIN) and self.type not in ("median", "percentile"):
            found.append(("margin", self.margin, f"only for median or percentile, not {self.type}"))
        if self.min_delta < 0:
            found.append(("min_delta", self.min_delta, "must be >= 0"))
        return found


@dataclass
class StudyConfig:
    """What the study optimises and how long it runs."""

    metric: MetricName | list[ObjectiveName] = _doc(
        "Evaluation metric that is the trial's value (its best evaluation), one of the task's: "
        "sequence_classification: accuracy (the default), macro_f1, micro_f1, roc_auc (two "
        "classes), eval_loss; multi_label_classification: micro_f1 (default), macro_f1, "
        "subset_accuracy, eval_loss; regression: rmse (default), mse, mae, pearson, spearman, "
        "r2, eval_loss; token_classification: f1 (default; entity-level), precision, recall, "
        "token_accuracy, eval_loss; causal_lm: eval_loss (default), perplexity. A list (e.g. "
        "[macro_f1, eval_loss], or [accuracy, samples_per_s]) makes several objectives: the "
        "first, an evaluation metric, picks the trial's best "
        "evaluation, whose values the others take (samples_per_s: the trial's throughput); "
        "the study then keeps a Pareto front, and pruning is off unless study.pruner.objective "
        "names the objective to prune on.",
        "accuracy",
    )
    direction: Direction | list[Direction] | None = _doc(
        "Optimisation direction (a list for several objectives); default: each metric's "
        "natural one."
    )
    throughput_tolerance: float = _doc(
        "With samples_per_s among several objectives: the fraction of a trial's throughput "
        "that is noise. A trial better on the quality metrics dominates one whose samples/s "
        "is higher by no more than this; a trial no better than chance (always the most "
        "common label) is never on the Pareto front while another beats chance.",
        DEFAULT_THROUGHPUT_TOLERANCE,
    )
    n_trials: int | None = _doc(
        "Trials for the whole study (all workers); null: until timeout.", 20
    )
    budget_device_hours: float | None = _doc(
        "Device-hours for the whole study (all workers; the figure `hpo status` prints): once "
        "spent, no worker starts a trial (running ones finish); null: no limit."
    )
    price_per_device_hour: float | DevicePrice | None = _doc(
        "What a device-hour costs ({amount: 2.5, currency: EUR}, or a number in USD): `hpo "
        "status` and `hpo report` then show the study's cost."
    )
    warm_start: WarmStartConfig | None = _doc(
        "Start from earlier studies' best configurations: {from: [study, ...], top: K, "
        "narrow: false}; see docs/guides/budgets.md."
    )
    timeout: float | None = _doc(
        "Seconds after which this worker starts no new trial (the running one finishes), "
        "counted from the worker's start."
    )
    trial_timeout: float | None = _doc(
        "Seconds one trial may train: past it, the trial checkpoints, stops and is pruned with "
        "reason `timeout`; null: no limit."
    )
    storage: str | None = _doc(
        "Database URL; --storage and $HPO_STORAGE take precedence. A relative SQLite file "
        "(sqlite:///hpo.db) is relative to this config file."
    )
    heartbeat_interval: int = _doc("Seconds between a running trial's heartbeats.", 30)
    grace_period: int | None = _doc(
        "Seconds without a heartbeat before a trial counts as dead; default 3x the interval."
    )
    max_retries: int = _doc(
        "Times a trial whose worker died or was stopped is re-run by a worker.", 2
    )
    trial_isolation: Literal["process", "none"] = _doc(
        "process: each trial trains in a child process, so a crash, a CUDA error or leaked "
        "memory ends with the trial; none: in the worker itself (for debuggers).",
        "process",
    )
    checkpoints: bool = _doc(
        "Checkpoint each trial, so that a retried trial resumes; the best trial's model is kept.",
        True,
    )
    keep_models: int = _doc(
        "How many of the study's best trials keep their model, on disk and in the artifact "
        "store: 1, the best (what `hpo best` names); more for `hpo ensemble`, which stacks or "
        "averages the top ones. Each kept model takes its space until the study ends.",
        1,
    )
    checkpoint_interval: float = _doc(
        "Least seconds between two checkpoints of a trial, written at evaluations (0: at every "
        "evaluation). A stop (SIGTERM, Ctrl-C) always checkpoints; a crash loses at most this "
        "much training.",
        300.0,
    )
    checkpoint_dir: str | None = _doc(
        "Folder for checkpoints (default ./hpo-checkpoints); on a filesystem every worker "
        "shares, a trial retried on another host resumes too."
    )
    artifact_store: str | None = _doc(
        "Where every host finds checkpoints and best models: file:///path (a shared mount) or "
        "s3://bucket/prefix (S3, MinIO, Ceph, R2: credentials, profile and $AWS_ENDPOINT_URL "
        "from the usual AWS settings). Checkpoints are written locally first and uploaded in "
        "the background; a retry on any host resumes from the store. --artifact-store and "
        "$HPO_ARTIFACT_STORE take precedence. Default: none, checkpoints stay on their host.",
    )
    artifact_patience: float = _doc(
        "Seconds a finished or stopped trial waits for its uploads to the artifact store "
        "(retried with backoff) before it gives up and records checkpoint_error.",
        120.0,
    )
    database_patience: float = _doc(
        "Seconds a worker rides out an unreachable study database (retrying with backoff) "
        "before it gives up.",
        DATABASE_PATIENCE_S,
    )
    database_connections: Literal["pooled", "on_demand"] = _doc(
        "PostgreSQL only. pooled: each worker keeps at most 2 connections open (fastest; up to "
        "max_connections / 2 workers, 48 on a stock server); on_demand: a connection per "
        "database call, closed after it, so hundreds of workers share a stock server (each "
        "call pays a connect: a few ms on a LAN, more over TLS). See the storage concepts "
        "(docs/concepts/storage.md).",
        "pooled",
    )
    stop_timeout: float = _doc(
        "Seconds a worker gives its running trial to stop after SIGTERM or Ctrl-C before it "
        "kills it.",
        30.0,
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    notify: NotifyConfig | None = _doc(
        "Messages about the study (its end, a new best, failures in a row, a stall) to Slack, "
        "email, Matrix, ntfy or a webhook: Apprise URLs and when; see "
        "docs/guides/notifications.md."
    )
    enqueue: list[dict[str, Any]] = field(
        default_factory=list,
        metadata={
            "help": "Configurations tried first (a paper's recipe, a known-good run): each a "
            "mapping of search-space parameters to values; parameters left out are sampled. "
            "Queued once per study, whichever worker starts first; one already in the study "
            "is not queued again."
        },
    )

    @property
    def objectives(self) -> list[str]:
        """The study's objectives, in order: one metric, or the list given."""
        return objective_list(self.metric)

    @property
    def primary_metric(self) -> str:
        """The evaluation metric that picks a trial's best evaluation (and checkpoint)."""
        return self.objectives[0]

    @property
    def pruned_metric(self) -> str | None:
        """The metric each evaluation reports to the pruner: the one objective, or with
        several, pruner.objective (None: nothing is pruned)."""
        if len(self.objectives) == 1:
            return self.objectives[0]
        return self.pruner.objective

    @property
    def grace_period_s(self) -> int:
        """The grace period, its default resolved: 3x the heartbeat interval."""
        return self.grace_period or 3 * self.heartbeat_interval

    @property
    def resolved_directions(self) -> list[Direction]:
        if self.direction is None:
            return [OBJECTIVE_DIRECTIONS[name] for name in self.objectives]
        return [self.direction] if isinstance(self.direction, str) else list(self.direction)

    def problems(self) -> list[tuple[str, Any, str]]:
        found = self._objective_problems()
        if len(self.objectives) > 1 and self.sampler.type == "cmaes":
            rule = "several objectives need tpe, gp, nsga2, random, qmc or grid, not cmaes"
            found.append(("metric", self.objectives, rule))
        if not 0 <= self.throughput_tolerance < 1:
            rule = "must be a fraction in [0, 1), e.g. 0.05"
            found.append(("throughput_tolerance", self.throughput_tolerance, rule))
        if self.n_trials is not None and self.n_trials < 1:
            found.append(("n_trials", self.n_trials, "must be a positive integer or null"))
        found += spend_problems(
            self.budget_device_hours, self.price_per_device_hour, self.warm_start, self.sampler.type
        )
        if self.timeout is not None and self.timeout <= 0:
            found.append(("timeout", self.timeout, "must be > 0 seconds or null"))
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            found.append(("trial_timeout", self.trial_timeout, "must be > 0 seconds or null"))
        if self.heartbeat_interval < 1:
            found.append(("heartbeat_interval", self.heartbeat_interval, "must be >= 1 second"))
        if self.grace_period is not None and self.grace_period <= self.heartbeat_interval:
            found.append(("grace_period", self.grace_period, "must exceed heartbeat_interval"))
        if self.max_retries < 0:
            found.append(("max_retries", self.max_retries, "must be >= 0"))
        if self.database_patience <= 0:
            found.append(("database_patience", self.database_patience, "must be > 0 seconds"))
        if self.stop_timeout <= 0:
            found.append(("stop_timeout", self.stop_timeout, "must be > 0 seconds"))
        if isinstance(self.keep_models, bool) or self.keep_models < 1:
            found.append(("keep_models", self.keep_models, "must be an integer >= 1"))
        if self.checkpoint_interval < 0:
            found.append(("checkpoint_interval", self.checkpoint_interval, "must be >= 0 seconds"))
        if self.artifact_patience <= 0:
            found.append(("artifact_patience", self.artifact_patience, "must be > 0 seconds"))
        if self.artifact_store is not None:
            found.extend(_artifact_store_problems(self.artifact_store))
        if self.n_trials is None and self.timeout is None and self.budget_device_hours is None:
            rule = "give n_trials, timeout or budget_device_hours, or the study never ends"
            found.append(("n_trials", None, rule))
        if len(self.enqueue) > MAX_ENQUEUED:
            found.append(
                ("enqueue", f"{len(self.enqueue)} configurations", f"at most {MAX_ENQUEUED}")
            )
        return found + self._duration_problems()

    def _duration_problems(self) -> list[tuple[str, Any, str]]:
        """Seconds past what the OS can wait for (1e300) overflow a timer mid-study."""
        found: list[tuple[str, Any, str]] = []
        for key in DURATION_KEYS:
            value = getattr(self, key)
            if value is not None and value > MAX_SECONDS:
                nullable = " (null: no limit)" if key in ("timeout", "trial_timeout") else ""
                found.append((key, value, f"must be at most {MAX_SECONDS:.0e} seconds{nullable}"))
        return found

    def _objective_problems(self) -> list[tuple[str, Any, str]]:
        objectives = self.objectives
        if not objectives:
            return [("metric", [], "give a metric, or a list of them")]
        if len(set(objectives)) < len(objectives):
            return [("metric", objectives, "lists a metric twice")]
        if objectives[0] not in METRIC_DIRECTIONS:
            metrics = ", ".join(METRIC_DIRECTIONS)
            rule = f"must begin with an evaluation metric ({metrics}): it picks the best evaluation"
            return [("metric", objectives, rule)]
        directions = self.direction
        if directions is None:
            return []
        if isinstance(directions, str) and len(objectives) > 1:
            return [
                (
                    "direction",
                    directions,
                    f"give one per metric ({len(objectives)}) or leave it out",
                )
            ]
        given = [directions] if isinstance(directions, str) else list(directions)
        if len(given) != len(objectives):
            return [("direction", given, f"give one per metric ({len(objectives)})")]
        for name, direction in zip(objectives, given, strict=True):
            natural = OBJECTIVE_DIRECTIONS[name]
            if direction != natural:
                shown = direction if isinstance(self.direction, str) else given
                return [("direction", shown, f"metric {name} must be {natural}d")]
        return []

    @property
    def resolved_direction(self) -> Direction:
        """The direction of a single-objective study."""
        return self.resolved_directions[0]


def objective_list(metric: str | Sequence[str]) -> list[str]:
    """`study.metric` (as written, or as a study recorded it) as a list of objectives."""
    return [metric] if isinstance(metric, str) else list(metric)


@dataclass
class Config:
    """A whole study config file."""

    study: StudyConfig = field(default_factory=StudyConfig)
    search_space: dict[str, ParamSpec] = field(default_factory=default_search_space)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    task: str = _doc(
        "What the model learns: sequence_classification (the default: a class per text or "
        "text pair), multi_label_classification, regression, token_classification or "
        "causal_lm; or your task class, `package.module:ClassName` (a subclass of "
        "hpo.trainer.tasks.base.Task: how rows become tensors, the loss, the metrics), imported "
        "by hpo run before any trial.",
        DEFAULT_TASK,
    )
    metrics: str | None = _doc(
        "Your metrics function, `package.module:name`: called at every evaluation with the "
        "logits and the labels (numpy arrays, a row per example), it returns a dict of named "
        "numbers added to the task's metrics; study.metric may name them (study.direction is "
        "then required). Tasks with a target per example only. null: the task's metrics alone."
    )
    source: str = "config"
    base_dir: str = ""  # the config file's folder: model choices are relative to it
    # `search_space: package.module:name`: the user's define-by-run function, which samples each
    # trial's parameters itself (search_space is then empty)
    search_space_function: str | None = None
    # The search space's parameters that come from hpo's default (the config does not set
    # them): only these are fitted to a small training set (hpo.config.data_size).
    default_params: list[str] = field(default_factory=lambda: list(default_search_space()))

    def problems(self) -> list[tuple[str, Any, str]]:
        """Rules between sections: the metric must be one the task has (a task class of the
        user's: checked when hpo run imports it)."""
        if is_task_path(self.task):
            return []
        if self.task not in TASKS:
            return [
                (
                    "task",
                    self.task,
                    f"must be one of {', '.join(TASKS)}, or your task class "
                    "as `package.module:ClassName`",
                )
            ]
        info = TASKS[self.task]
        for name in self.study.objectives:
            if name != "samples_per_s" and name in METRIC_DIRECTIONS and name not in info.metrics:
                return [
                    (
                        "study.metric",
                        name,
                        f"the task {self.task} has no metric {name}; its "
                        f"metrics: {', '.join(info.metrics)}",
                    )
                ]
        found: list[tuple[str, Any, str]] = []
        unused = f"means nothing for the task {self.task}; leave it out"
        for path in info.unused_settings():
            section, _, key = path.partition(".")
            value = getattr(getattr(self, section), key)
            if value is not None and value != 0:  # set: not absent, not a zero smoothing
                found.append((path, value, unused))
        return found
