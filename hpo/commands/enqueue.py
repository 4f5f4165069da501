"""hpo enqueue: configurations queued in a study, checked against its search space, tried before
the sampler's own.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from typing import Any

from hpo.config.loader import load_config
from hpo.errors import ConfigError, HPOError
from hpo.logs import set_optuna_verbosity
from hpo.reports.text import emit
from hpo.study.names import checked_study_name

PARAMS_EXAMPLE = '{"learning_rate": 3e-5, "effective_batch_size": 32}'


def enqueue_command(args: argparse.Namespace) -> int:
    import optuna

    from hpo.config.param_checks import check_function_params, check_params
    from hpo.config.schema import ParamSpec, space_record
    from hpo.storage import open_storage, resolve_storage_url
    from hpo.study.join import SPACE_FUNCTION_ATTR, enqueue

    args.study = checked_study_name(args.study)
    raw = _json_params(args.params)
    config = load_config(args.config) if args.config is not None else None
    storage_url = resolve_storage_url(args.storage, config.study.storage if config else None)
    set_optuna_verbosity(logging.getLogger().level)
    storage = open_storage(storage_url, must_exist=True)
    try:
        study_id = storage.get_study_id_from_name(args.study)
    except KeyError as e:
        raise HPOError(
            f"no study {args.study!r} in {storage_url.masked}; start it with `hpo "
            "run` (or check --study with `hpo studies`)"
        ) from e
    attrs = storage.get_study_user_attrs(study_id)
    recorded = attrs.get("search_space")
    if config is not None:
        space = config.search_space
        if recorded is not None:
            # hpo's default parameters as the study fitted them to its training set
            # (hpo.config.data_size): the config alone cannot say.
            fitted = {
                name: ParamSpec(**recorded[name])
                for name in config.default_params
                if name in recorded and name in space
            }
            space = {name: fitted.get(name, spec) for name, spec in space.items()}
        if recorded is not None and recorded != space_record(space):
            raise HPOError(
                f"--config: its search space is not the one study {args.study!r} was created "
                "with; use the study's config or leave --config out"
            )
    elif recorded is None:
        raise HPOError(
            f"study {args.study!r} has no search space recorded by hpo; pass the "
            "--config it runs with"
        )
    else:
        space = {name: ParamSpec(**spec) for name, spec in recorded.items()}
    problems: list[str] = []
    grid = (config.study.sampler.type if config else attrs.get("sampler")) == "grid"
    if attrs.get(SPACE_FUNCTION_ATTR) or (config and config.search_space_function):
        params = check_function_params(raw, "--params", problems)  # the function's own names
    else:
        params = check_params(space, raw, "--params", problems, complete=grid)
    if problems:
        raise ConfigError(problems, "--params")
    study = optuna.load_study(study_name=args.study, storage=storage)
    # Optuna's own INFO lines are left out: hpo says what it queued.
    optuna.logging.set_verbosity(max(logging.getLogger().level, logging.WARNING))
    with storage.lock(study_id):
        queued = enqueue(study, params)
    shown = json.dumps(params)
    if not queued:
        emit(f"hpo: study {args.study!r} already holds a trial with {shown}; nothing queued")
    elif (spent := _budget_spent(study, attrs.get("n_trials"))) is not None:
        emit(f"hpo: queued {shown} in study {args.study!r}, but {spent}")
    else:
        emit(
            f"hpo: queued {shown} in study {args.study!r}: the next worker to start a trial "
            "trains it, if the study's n_trials leaves room (queued trials count once "
            "started)"
        )
    return 0


def _budget_spent(study: Any, budget: object) -> str | None:
    """Why no worker will start the queued trials (the study's budget is spent, counted as its
    workers count it), and what will; None when there is room or no budget."""
    from optuna.trial import TrialState

    from hpo.study.trials import counted_trials

    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return None
    trials = study.get_trials(deepcopy=False)
    counted = counted_trials(trials)
    if counted < budget:
        return None
    waiting = sum(t.state == TrialState.WAITING for t in trials)
    return (
        f"its budget is spent ({counted} of n_trials {budget} started): a worker starts no "
        "trial, and `hpo run` stops at once. The queued trials run only with a larger "
        f"budget, e.g. hpo run --study {shlex.quote(study.study_name)} --config ... "
        f"--n-trials {counted + waiting}"
    )


def _json_params(text: str) -> dict[str, Any]:
    """--params: a JSON object, no key twice (the last would win silently)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise HPOError(f"--params gives {repeated[0][:80]!r} twice; give each parameter once")
        return dict(pairs)

    try:
        raw = json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise HPOError(f"--params is not JSON ({reason}); write e.g. '{PARAMS_EXAMPLE}'") from e
    if not isinstance(raw, dict) or not raw:
        raise HPOError(
            f"--params must be a JSON object of search-space parameters, e.g. '{PARAMS_EXAMPLE}'"
        )
    return raw
