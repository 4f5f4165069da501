"""Create or join a study: the same directions and search space as its other workers, the budget of
the latest worker, configurations queued before the sampler's own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.storages import BaseStorage

from hpo.config.budget import price_record
from hpo.config.schema import (
    Config,
    StudyConfig,
    objective_list,
    space_record,
)
from hpo.errors import ConfigError
from hpo.storage.engine import StudyStorage
from hpo.storage.tables import check_version
from hpo.study import warm_start
from hpo.study.device_time import BUDGET_ATTR, PRICE_ATTR
from hpo.study.front import TOLERANCE_ATTR
from hpo.study.kept_models import KEEP_ATTR
from hpo.study.names import check_no_lookalike
from hpo.study.pruners import ExplainedPruner
from hpo.study.sampling import build_pruner, build_sampler, experimental_features, tpe_group
from hpo.study.setup_record import (
    TEST_FILE_ATTR,
    check_setup,
    setup_record,
    test_file_record,
)
from hpo.trainer.tasks import DEFAULT_TASK, TASKS, is_task_path
from hpo.trial.objective_pruning import ObjectivePruner
from hpo.trial.protocol import ADAPTER_ATTR

log = logging.getLogger(__name__)


# How many workers have joined the study: the next one's index, for its sampler seed.
WORKERS_ATTR = "hpo:workers_joined"
QUEUED_BY_ATTR = "queued_by"  # study.enqueue or hpo enqueue, on a queued trial
TASK_ATTR = "task"  # what the study's models learn (trainer.tasks), set by its first worker
FACTORY_ATTR = "model_factory"  # model.factory, where the user's function builds the models


def study_task(user_attrs: dict[str, Any]) -> str:
    """The task of a study from its user attributes; studies from before tasks classified."""
    task = user_attrs.get(TASK_ATTR)
    if isinstance(task, str) and (task in TASKS or is_task_path(task)):
        return task
    return DEFAULT_TASK


def model_loader(user_attrs: dict[str, Any], trial_attrs: dict[str, Any] | None = None) -> str:
    """How a trial's saved model loads: `AutoModelFor<its head>.from_pretrained`, or for a LoRA
    adapter, peft's loader on the base model."""
    factory = user_attrs.get(FACTORY_ATTR)
    if isinstance(factory, str):
        return factory_loader_text(factory)
    adapter = trial_adapter(user_attrs, trial_attrs or {})
    return loader_text(study_task(user_attrs), adapter["base_model"] if adapter else None)


def factory_loader_text(factory: str, folder: str = "DIR") -> str:
    """How a model of the user's factory loads: its state_dict into the module the factory
    builds (a transformers model it returned: from_pretrained, as usual)."""
    return (
        f"{factory}(request), then model.load_state_dict(torch.load('{folder}/"
        "model_state_dict.pt')): see HPO_MODEL.md there; a transformers model it returned: "
        f"from_pretrained({folder})"
    )


def trial_adapter(study_attrs: dict[str, Any], trial_attrs: dict[str, Any]) -> dict | None:
    """The adapter a trial trained (its own record, ADAPTER_ATTR: a search may turn LoRA on and
    off), else the study's (trials of hpo before that record); None for full fine-tuning."""
    adapter = (
        trial_attrs[ADAPTER_ATTR] if ADAPTER_ATTR in trial_attrs else study_attrs.get(ADAPTER_ATTR)
    )
    return adapter if isinstance(adapter, dict) else None


def loader_text(task: str, base_model: str | None, folder: str = "DIR") -> str:
    """The call that loads a saved model of `task` from `folder`; with `base_model`, a LoRA
    adapter that peft loads on that base (its config.json holds the head's labels)."""
    # A task class of the user's: its model class is what its describe() says (not imported here).
    auto_model = TASKS[task].auto_model if task in TASKS else f"<{task}'s model class>"
    if base_model is None:
        return f"{auto_model}.from_pretrained"
    base = f"{auto_model}.from_pretrained(BASE, config=AutoConfig.from_pretrained({folder}))"
    return f"a LoRA adapter on {base_model}: PeftModel.from_pretrained({base}, {folder})"


def adapter_record(config: Config) -> dict[str, Any] | None:
    """What a study records of its adapter (ADAPTER_ATTR); None for full fine-tuning."""
    return config.model.adapter_record()


def open_study(
    storage: StudyStorage,
    name: str,
    config: Config,
    allow_changed_setup: bool = False,
    in_python: bool = False,
) -> optuna.Study:
    """Create the study, or join it if it exists with the same direction, search space and
    setup (data, model, evaluation schedule, pruner: hpo.study.setup_record; another one only
    with `allow_changed_setup`, recorded). The checks and the first worker's record happen
    under the study's lock: two workers creating one study with different spaces cannot both
    succeed. `in_python`: a refusal names hpo.run's arguments, not hpo run's flags."""
    check_version(storage.engine)  # a database of another hpo's layout: refused, nothing written
    _check_new_name(storage, name)
    # The earlier studies' best configurations, read before anything is written: a source
    # that does not exist is refused with nothing created.
    warm = warm_start.plan(storage, config)
    # Before the lock: a file's first hash (the token cache has usually read it) holds no one up.
    setup = setup_record(config)
    test_file = test_file_record(config)
    directions = config.study.resolved_directions
    optuna.create_study(
        storage=storage,
        study_name=name,
        directions=directions,
        load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(),  # this worker's own sampler is built below
    )
    study_id = storage.get_study_id_from_name(name)
    existing = [d.name.lower() for d in storage.get_study_directions(study_id)]
    if existing != directions:
        raise ConfigError(
            [
                f"study.direction: study {name!r} already exists and is {_said(existing)}, but "
                f"this config says {_said(directions)}; use another --study name or the same "
                "metric"
            ],
            config.source,
        )
    with storage.lock(study_id):
        _check_study_settings(storage, study_id, name, config)
        check_setup(storage, study_id, name, config, setup, allow_changed_setup, in_python)
        _say_budget_change(storage, study_id, name, config.study.n_trials)
        # The budget of the latest worker to join, for `hpo status --watch` to know the end.
        storage.set_study_user_attr(study_id, "n_trials", config.study.n_trials)
        # Its device-hour budget and price, for `hpo status` and `hpo report` (hpo.reports.cost).
        storage.set_study_user_attr(study_id, BUDGET_ATTR, config.study.budget_device_hours)
        price = price_record(config.study.price_per_device_hour)
        storage.set_study_user_attr(study_id, PRICE_ATTR, price)
        # The Pareto front's tolerance of throughput noise (hpo.study.front), the latest worker's.
        storage.set_study_user_attr(study_id, TOLERANCE_ATTR, config.study.throughput_tolerance)
        # How many best trials keep their model (hpo.study.kept_models), the latest worker's.
        storage.set_study_user_attr(study_id, KEEP_ATTR, config.study.keep_models)
        if test_file is not None:  # what hpo ensemble --study scores on (not matched)
            storage.set_study_user_attr(study_id, TEST_FILE_ATTR, test_file)
        # The grace period (how long a running trial's worker may be silent before it counts
        # as gone), for `hpo status`.
        storage.set_study_user_attr(study_id, "grace_period_s", liveness(config.study)[1])
        worker_index = int(storage.get_study_system_attrs(study_id).get(WORKERS_ATTR, 0))
        storage.set_study_system_attr(study_id, WORKERS_ATTR, worker_index + 1)
    _say_group(config)
    pruner = study_pruner(storage, name, config)
    study = optuna.load_study(
        study_name=name,
        storage=storage,
        sampler=build_sampler(config.study.sampler, worker_index, config.search_space),
        pruner=pruner,
    )
    # Named metrics: the dashboard shows "accuracy", not "Objective 0".
    if study.metric_names != config.study.objectives:
        with experimental_features():
            study.set_metric_names(config.study.objectives)
    if config.study.enqueue:
        budget = config.study.n_trials
        if budget is not None and len(config.study.enqueue) > budget:
            count = len(config.study.enqueue)
            log.warning(
                "study.enqueue lists %d configurations but n_trials is %d: the ones "
                "past the budget stay queued",
                count,
                budget,
            )
        with storage.lock(study_id):
            for params in config.study.enqueue:
                enqueue(study, params, "study.enqueue")
    warm_start.apply(study, storage, config, warm, enqueue)
    return study


def _check_new_name(storage: StudyStorage, name: str) -> None:
    """A study that does not exist yet must not look like one that does (hpo.study.names)."""
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        check_no_lookalike(name, (study.study_name for study in storage.get_all_studies()))


def enqueue(study: optuna.Study, params: dict[str, Any], by: str = "hpo enqueue") -> bool:
    """Queue a configuration to try next, unless a trial of the study (in any state) was
    queued or ran with exactly these parameters; whether it was queued. Call it under the
    study's lock: two workers must not both queue it. `by` (the trial's `queued_by`) is said
    in the log when the trial starts."""
    before = len(study.get_trials(deepcopy=False))
    study.enqueue_trial(params, user_attrs={QUEUED_BY_ATTR: by}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) > before


def _say_group(config: Config) -> None:
    """A conditional space turns TPE's `group` on unless the config set it: said, once."""
    sampler = config.study.sampler
    if sampler.group is None and tpe_group(sampler, config.search_space):
        log.info(
            "the search space has conditional parameters (`when`): TPE models the "
            "parameters that appear together jointly (study.sampler.group: true, Optuna's "
            "advice for conditional spaces); set study.sampler.group to choose"
        )


def _say_budget_change(storage: StudyStorage, study_id: int, name: str, budget: int | None) -> None:
    """Each worker counts the study's trials against its own budget: one that joins with
    another n_trials than the last one's (a rerun without --n-trials, say) grows or ends the
    study at its own; said in one line, as it may not be what was meant."""
    attrs = storage.get_study_user_attrs(study_id)
    if "n_trials" not in attrs or attrs["n_trials"] == budget:  # a new study, or the same
        return
    log.warning(
        "study %r had a budget of %s; this worker's is %s (--n-trials or "
        "study.n_trials), which now applies",
        name,
        _budget_text(attrs["n_trials"]),
        _budget_text(budget),
    )


def _budget_text(budget: int | None) -> str:
    return "no limit" if budget is None else f"{budget} trials"


def _check_study_settings(storage: StudyStorage, study_id: int, name: str, config: Config) -> None:
    """The first worker records the study's metrics, search space and sampler; every later one
    must have the same metrics and search space (a study that mixed accuracy and macro-F1
    values would compare unlike numbers)."""
    space = space_record(config.search_space)
    attrs = storage.get_study_user_attrs(study_id)
    if "search_space" not in attrs:
        storage.set_study_user_attr(study_id, TASK_ATTR, config.task)
        if config.model.factory is not None:
            storage.set_study_user_attr(study_id, FACTORY_ATTR, config.model.factory)
        if config.model.adapter is not None:
            storage.set_study_user_attr(study_id, ADAPTER_ATTR, adapter_record(config))
        storage.set_study_user_attr(study_id, "metric", config.study.metric)
        storage.set_study_user_attr(study_id, "search_space", space)
        if config.search_space_function is not None:
            storage.set_study_user_attr(study_id, SPACE_FUNCTION_ATTR, config.search_space_function)
        storage.set_study_user_attr(study_id, "sampler", config.study.sampler.type)
        return
    stored_task = study_task(attrs)
    if stored_task != config.task:
        raise ConfigError(
            [
                f"task: study {name!r} trains {stored_task}, but this config says {config.task}; "
                "use the study's task or another --study name"
            ],
            config.source,
        )
    stored_metric = attrs.get("metric")
    if stored_metric is not None and objective_list(stored_metric) != config.study.objectives:
        raise ConfigError(
            [
                f"study.metric: study {name!r} optimises {stored_metric}, but this config says "
                f"{config.study.metric}; use the study's metric or another --study name"
            ],
            config.source,
        )
    stored_function = attrs.get(SPACE_FUNCTION_ATTR)
    if stored_function != config.search_space_function:
        raise ConfigError(
            [
                f"search_space: study {name!r} samples with "
                f"{stored_function or 'a search space mapping'}, but this config with "
                f"{config.search_space_function or 'a search space mapping'}; use the study's "
                "config or another --study name"
            ],
            config.source,
        )
    stored = attrs["search_space"]
    differ = sorted(k for k in stored.keys() | space.keys() if stored.get(k) != space.get(k))
    if differ:
        raise ConfigError(
            [
                f"search_space: study {name!r} was created with another search space "
                f"(it differs in {', '.join(differ)}); every worker of a study needs the "
                "same search space: use the study's config or another --study name"
            ],
            config.source,
        )


# The study's define-by-run search space (`search_space: package.module:name`), if it has one.
SPACE_FUNCTION_ATTR = "search_space_function"


def liveness(study_config: StudyConfig) -> tuple[float, float, int]:
    """Heartbeat interval, grace period and retries of the study's running trials."""
    return study_config.heartbeat_interval, study_config.grace_period_s, study_config.max_retries


def study_pruner(storage: BaseStorage, name: str, config: Config) -> optuna.pruners.BasePruner:
    """study.pruner, which also says why it prunes; with several objectives, judging
    pruner.objective (hpo.trial.objective_pruning), or nothing when none is named."""
    pruner = build_pruner(config.study.pruner)
    metric, objectives = config.study.pruned_metric, config.study.objectives
    if isinstance(pruner, optuna.pruners.NopPruner):
        return pruner
    if metric is None:
        log.info(
            "study %r has %d objectives: pruning is off (study.pruner.objective names the one "
            "to prune on)",
            name,
            len(objectives),
        )
        return optuna.pruners.NopPruner()
    step_word = "step" if config.training.entrypoint is not None else "evaluation"
    pruner = ExplainedPruner(pruner, config.study.pruner, metric, step_word)
    if len(objectives) == 1:
        return pruner
    log.info("study %r has %d objectives: the pruner judges %s", name, len(objectives), metric)
    throughput = None
    if "samples_per_s" in objectives:  # judged against trials at least as fast
        throughput = (objectives.index("samples_per_s"), config.study.throughput_tolerance)
    return ObjectivePruner(pruner, objectives.index(metric), storage, throughput)


def _said(directions: Sequence[str]) -> str:
    return " and ".join(f"{d}d" for d in directions)
