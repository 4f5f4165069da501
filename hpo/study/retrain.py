"""The retrain plan and its results (`hpo retrain` runs it: hpo/commands/retrain.py): a final
model from a study. The best configurations of the search are trained
again with new seeds, in a study of their own (`<study> [retrain top K x S seeds, PLAN]`, where
PLAN is a short hash of the configurations and seeds; run by the same workers, heartbeats,
retries and resume as `hpo run`, which run its queued runs only); the configuration with the
best mean metric wins, and its best run's model and tokenizer are saved with a model card
(hpo.reports.model_card writes it).

A single training run's score is partly the luck of its seed (Dodge et al. 2020): the mean and
spread over seeds is what tells two close configurations apart.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import json
import logging
import os
import shlex
import shutil
import socket
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.config.schema import Config, ParamSpec, PrunerConfig, SamplerConfig, space_record
from hpo.errors import HPOError
from hpo.storage.engine import StudyStorage
from hpo.study.setup_record import SETUP_ATTR, differences, setup_record
from hpo.trial.folders import study_folder_name

log = logging.getLogger(__name__)

PLAN_ATTR = "retrain_plan"  # on the retrain study: what it trains
OUTCOME_ATTR = "retrain"  # on the searched study: the latest retrain's winner
CARD_JSON = "hpo_model_card.json"
CARD_MD = "README.md"
ASIDE_MARKER = ".hpo-writing"  # in a final model being written aside: who writes it
MAX_TOP = 100
MAX_SEEDS = 100
_SEED_LIMIT = 2**32  # numpy's RandomState takes seeds below this


@dataclass(frozen=True)
class RetrainPlan:
    """What a retrain study trains: each configuration (ranked by its search value) once per
    seed. Stored with the retrain study, so a resumed retrain trains what it began with."""

    source: str
    configs: list[dict[str, Any]]  # {"rank", "trial", "value", "params"}, best first
    seeds: list[int]

    @property
    def study_name(self) -> str:
        """Named by what it trains: a search that went on (new top configurations) or other
        seeds make another retrain study; the same plan resumes the same study."""
        return retrain_study_name(self.source, len(self.configs), len(self.seeds), self.digest)

    @property
    def full_data_study_name(self) -> str:
        """The winner trained on both splits: a study apart, as its metric is measured on
        data it trained on and must not stand beside the held-out runs."""
        return retrain_study_name(
            self.source, len(self.configs), len(self.seeds), f"{self.digest}, full data"
        )

    @property
    def digest(self) -> str:
        what = [[c["trial"], c["params"]] for c in self.configs], self.seeds
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:6]

    @property
    def runs(self) -> int:
        return len(self.configs) * len(self.seeds)


@dataclass
class ConfigResult:
    """One configuration's retrain runs: their values, mean and spread."""

    rank: int
    source_trial: int
    params: dict[str, Any]
    search_value: float
    runs: list[dict[str, Any]]  # {"trial", "seed", "value"} of its complete runs
    unfinished: int  # runs that failed or were pruned (a failure, an OOM, a divergence)

    @property
    def mean(self) -> float:
        return statistics.fmean(r["value"] for r in self.runs)

    @property
    def std(self) -> float | None:
        """The spread over seeds; None with one run (a spread of one value is not zero)."""
        values = [r["value"] for r in self.runs]
        return statistics.stdev(values) if len(values) > 1 else None


def retrain_study_name(source: str, top: int, seeds: int, tag: str) -> str:
    suffix = f" [retrain top {top} x {seeds} seeds, {tag}]"
    return source[: 512 - len(suffix)] + suffix


def check_demo_config(study_attrs: dict[str, Any], config: Config, name: str) -> None:
    """No --config given, so `config` is the demo's: refused, in one line, unless the study
    ran with it (the same search space and setup: data, model, schedule). Cheap (the demo's
    files are hashed, nothing prepared): called before the data is prepared."""
    recorded = study_attrs.get("search_space")
    differ = ["search_space"] if recorded not in (None, space_record(config.search_space)) else []
    setup = study_attrs.get(SETUP_ATTR)
    if isinstance(setup, dict):
        differ += differences(setup, setup_record(config))
    if differ:
        verb = "differs" if len(differ) == 1 else "differ"
        raise HPOError(
            f"no --config given, and the demo config is not the one study {name!r} "
            f"ran with (its {', '.join(differ)} {verb}); pass the study's config: "
            f"hpo retrain --study {shlex.quote(name)} --config FILE"
        )


def make_plan(
    source: optuna.Study, config: Config, top: int, seeds: int, config_given: bool = True
) -> RetrainPlan:
    """The `top` best complete configurations of the search (distinct parameters; with several
    objectives, ranked by the first), each to train with `seeds` seeds not used by the search."""
    searched = source.user_attrs.get("retrain_of")
    if searched is not None:
        raise HPOError(
            f"study {source.study_name!r} is the retrain of study {searched!r}: give "
            "that one to --study"
        )
    if not config_given:
        check_demo_config(source.user_attrs, config, source.study_name)
    recorded = source.user_attrs.get("search_space")
    if recorded is not None and recorded != space_record(config.search_space):
        raise HPOError(
            f"--config: its search space is not the one study {source.study_name!r} "
            "was created with; pass the config the study ran with"
        )
    if config.search_space_function is not None:
        raise HPOError(
            f"search_space: {config.search_space_function} samples in Python; retrain "
            "needs the search space as a mapping: give the winner's parameters to a "
            "config of their own, or tune with a mapping"
        )
    if "seed" in config.search_space:
        raise HPOError(
            "search_space tunes training.seed, but retrain varies the seed to measure "
            "its effect: remove seed from the search space"
        )
    sign = 1.0 if source.directions[0] == StudyDirection.MAXIMIZE else -1.0
    complete = [
        t for t in source.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values
    ]
    complete.sort(key=lambda t: (-sign * t.values[0], t.number))
    configs: list[dict[str, Any]] = []
    seen: list[dict[str, Any]] = []
    for trial in complete:
        if trial.params in seen:
            continue  # the same configuration trained twice (enqueued again, say)
        seen.append(trial.params)
        configs.append(
            {
                "rank": len(configs) + 1,
                "trial": trial.number,
                "value": trial.values[0],
                "params": trial.params,
            }
        )
        if len(configs) == top:
            break
    if len(source.directions) > 1:
        log.info(
            "study %r has %d objectives: configurations are ranked, and the winner is "
            "picked, by the first (%s)",
            source.study_name,
            len(source.directions),
            config.study.primary_metric,
        )
    if not configs:
        raise HPOError(
            f"study {source.study_name!r} has no completed trial to retrain; run it "
            "first (hpo run), or check --study with `hpo studies`"
        )
    if len(configs) < top:
        log.info(
            "study %r has %d distinct completed configurations; retraining those",
            source.study_name,
            len(configs),
        )
    first = config.training.seed + 1
    new_seeds = [(first + i) % _SEED_LIMIT for i in range(seeds)]
    return RetrainPlan(source.study_name, configs, new_seeds)


def stored_plan(storage: StudyStorage, name: str) -> RetrainPlan | None:
    """The plan of an existing retrain study (a resumed retrain), if there is one."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    stored = storage.get_study_user_attrs(study_id).get(PLAN_ATTR)
    return None if stored is None else RetrainPlan(**stored)


def study_config(config: Config, plan: RetrainPlan) -> Config:
    """The searched study's config, made to train the plan's runs: the seed joins the search
    space, nothing is pruned, and every run keeps its best model. The workers run queued runs
    only (nothing is sampled), with no budget or worker timeout: a retrain ends when every
    queued run (and every retry of one) has ended."""
    retrain = copy.deepcopy(config)
    retrain.search_space = {
        **config.search_space,
        "seed": ParamSpec(type="categorical", choices=list(plan.seeds)),
    }
    retrain.study.n_trials = None
    retrain.study.timeout = None  # a worker that left queued runs behind would wait for ever
    retrain.study.sampler = SamplerConfig(type="random", seed=0)
    retrain.study.pruner = PrunerConfig(type="none")
    retrain.study.enqueue = []
    # The search's warm start and device-hour budget are the search's: the final runs are
    # queued by the retrain, and each one queued is run.
    retrain.study.warm_start = None
    retrain.study.budget_device_hours = None
    retrain.study.checkpoints = True
    return retrain


def queue_runs(storage: StudyStorage, study: optuna.Study, plan: RetrainPlan) -> int:
    """Queue each configuration x seed the retrain study does not hold yet; how many. Under the
    study's lock: workers of several GPUs or hosts queue each run once."""
    study_id = storage.get_study_id_from_name(study.study_name)
    queued = 0
    with storage.lock(study_id):
        if PLAN_ATTR not in storage.get_study_user_attrs(study_id):
            storage.set_study_user_attr(study_id, PLAN_ATTR, dataclasses.asdict(plan))
            storage.set_study_user_attr(study_id, "retrain_of", plan.source)
        held = {_run_key(t) for t in study.get_trials(deepcopy=False)}
        for config in plan.configs:
            for seed in plan.seeds:
                if (config["rank"], seed, False) in held:
                    continue
                attrs = {
                    "retrain_config": config["rank"],
                    "source_trial": config["trial"],
                    "seed": seed,
                }
                study.enqueue_trial({**config["params"], "seed": seed}, user_attrs=attrs)
                queued += 1
    return queued


def queue_full_data_run(
    storage: StudyStorage, study: optuna.Study, plan: RetrainPlan, winner: ConfigResult
) -> None:
    """Queue the winner once more in the full-data study, trained on both splits, with the seed
    of its best run (once: a resumed retrain finds it there)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    seed = best_run(winner, study.directions[0])["seed"]
    with storage.lock(study_id):
        if PLAN_ATTR not in storage.get_study_user_attrs(study_id):
            storage.set_study_user_attr(study_id, PLAN_ATTR, dataclasses.asdict(plan))
            storage.set_study_user_attr(study_id, "retrain_of", plan.source)
        if any(_run_key(t) == (winner.rank, seed, True) for t in study.get_trials(deepcopy=False)):
            return
        attrs = {
            "retrain_config": winner.rank,
            "source_trial": winner.source_trial,
            "seed": seed,
            "full_data": True,
        }
        study.enqueue_trial({**winner.params, "seed": seed}, user_attrs=attrs)


def full_data_trial(study: optuna.Study, winner: ConfigResult) -> int | None:
    """The number of the winner's complete full-data run, if there is one."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return next((t.number for t in done if _run_key(t)[0] == winner.rank and _run_key(t)[2]), None)


def model_folder(study: optuna.Study, number: int) -> Path:
    """Where a run of the retrain study saved its best model (with the tokenizer)."""
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    return Path(trial.user_attrs.get("best_model", "(no model recorded)"))


def _run_key(trial: FrozenTrial) -> tuple[Any, Any, bool]:
    attrs = trial.user_attrs
    return attrs.get("retrain_config"), attrs.get("seed"), bool(attrs.get("full_data"))


def unfinished(study: optuna.Study) -> int:
    """Runs still running or queued (by other workers, or handed back meanwhile)."""
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)))


def results(study: optuna.Study, plan: RetrainPlan) -> list[ConfigResult]:
    """Each configuration's complete runs (the full-data run is not one: its evaluation split
    was trained on)."""
    trials = study.get_trials(deepcopy=False)
    out = []
    for config in plan.configs:
        mine = [t for t in trials if _run_key(t)[0] == config["rank"] and not _run_key(t)[2]]
        runs = [
            {"trial": t.number, "seed": t.user_attrs.get("seed"), "value": t.values[0]}
            for t in mine
            if t.state == TrialState.COMPLETE and t.values
        ]
        failed = {t.user_attrs.get("seed") for t in mine if t.state in _ENDED_BADLY}
        unfinished = len(failed - {r["seed"] for r in runs})
        out.append(
            ConfigResult(
                config["rank"], config["trial"], config["params"], config["value"], runs, unfinished
            )
        )
    return out


_ENDED_BADLY = (TrialState.FAIL, TrialState.PRUNED)


def pick_winner(
    found: list[ConfigResult], direction: StudyDirection, seeds: int
) -> ConfigResult | None:
    """The configuration with the best mean over its seeds (ties: the better search rank), among
    those that completed most of their `seeds` runs: one that diverged or failed on most seeds
    is unreliable, and one lucky surviving run must not win. When none did, among those with
    the most complete runs."""
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    eligible = [r for r in found if 2 * len(r.runs) > seeds]
    if not eligible:
        most = max((len(r.runs) for r in found), default=0)
        eligible = [r for r in found if r.runs and len(r.runs) == most]
    return min(eligible, key=lambda r: (-sign * r.mean, r.rank), default=None)


def best_run(result: ConfigResult, direction: StudyDirection) -> dict[str, Any]:
    sign = 1.0 if direction == StudyDirection.MAXIMIZE else -1.0
    return min(result.runs, key=lambda r: (-sign * r["value"], r["trial"]))


def check_out(out: Path, source: str, storage: str) -> None:
    """--out, before any training: a folder to create, an empty one, or the final model hpo
    wrote there before for the same study of the same database (replaced whole); and a place
    this process can write in."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise HPOError(f"--out {out}: exists and is not a final model hpo wrote; name a new folder")
    if out.is_dir() and any(out.iterdir()):
        card = _card_owner(out)
        if card is None:
            raise HPOError(
                f"--out {out}: exists and is not a final model hpo wrote; name a new folder"
            )
        if card != (source, storage) and card != (source, None):
            raise HPOError(
                f"--out {out}: holds the final model of study {card[0]!r} of "
                f"{card[1] or 'another database'}, not of study {source!r} of "
                f"{storage}; name another folder"
            )
    parent = out.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist; create it first"
        raise HPOError(f"--out {out}: its parent {parent} {what}")
    _probe_writable(out)


def _probe_writable(out: Path) -> None:
    """Write where saving will write (permissions say nothing to root; an immutable folder
    refuses root too): a folder beside `out`, and a file inside `out` if it exists."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.probe."))
        if out.is_dir():
            probe = out / f".hpo-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
    except OSError as e:
        raise HPOError(
            f"--out {out}: cannot write there ({e.strerror or e}); name a folder you can write in"
        ) from e


def _card_owner(out: Path) -> tuple[str, str | None] | None:
    """(study, database) of the model card in `out`, if it holds one hpo wrote."""
    try:
        card = json.loads((out / CARD_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(card, dict) or not isinstance(card.get("study"), str):
        return None
    return card["study"], card.get("storage")


def _remove_abandoned(out: Path) -> None:
    """Folders a killed save left beside `out` (each names its writer; only this host's dead
    writers' are removed)."""
    for folder in out.parent.glob(f".{glob.escape(out.name)}.*.tmp"):
        try:
            writer = json.loads((folder / ASIDE_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if writer.get("host") == socket.gethostname() and not _alive(int(writer.get("pid", 0))):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_final_model(model_dir: Path, out: Path, card: dict[str, Any], card_text: str) -> None:
    """Copy the model and tokenizer to `out` with its card (`card_text`: as Markdown, the
    folder's README.md; hpo.reports.model_card writes both): written aside, then renamed in, so
    `out` is never half a model; a final model hpo wrote there before is replaced."""
    from hpo.trainer.checkpoint import STATE_DICT_FILE  # a factory's module of the user's

    if not any((model_dir / name).is_file() for name in ("config.json", STATE_DICT_FILE)):
        raise HPOError(
            f"the winning run's model {model_dir} is missing (removed, or on another "
            "host's disk); run hpo retrain on the host that trained it"
        )
    check_out(out, str(card.get("study")), str(card.get("storage")))
    _remove_abandoned(out)
    aside, old = None, None
    try:
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        writer = {"host": socket.gethostname(), "pid": os.getpid()}
        (aside / ASIDE_MARKER).write_text(json.dumps(writer), encoding="utf-8")
        shutil.copytree(model_dir, aside, dirs_exist_ok=True)
        (aside / CARD_JSON).write_text(
            json.dumps(card, indent=2, default=str) + "\n", encoding="utf-8"
        )
        (aside / CARD_MD).write_text(card_text, encoding="utf-8")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(aside, 0o777 & ~umask)  # as any new folder, not mkdtemp's owner-only mode
        for path in aside.rglob("*"):  # and files as any new file (checkpoints are private)
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        (aside / ASIDE_MARKER).unlink()
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(aside, out)
    except BaseException as e:  # a full disk, or a stop: nothing half-written stays
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
        if isinstance(e, OSError):
            raise HPOError(f"--out {out}: cannot write the final model ({e.strerror or e})") from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def default_out(source: str) -> Path:
    return Path(f"hpo-final-{study_folder_name(source)}")


def outcome(card: dict[str, Any], out: Path) -> dict[str, Any]:
    """What the searched study records of its latest retrain, for `hpo best`."""
    winner = card["winner"]
    return {
        "study": card["retrain_study"],
        "params": winner["params"],
        "mean": winner["mean"],
        "std": winner["std"],
        "seeds": winner["seeds"],
        "search_trial": winner["search_trial"],
        "model": str(out.resolve()),
        "full_data": card["saved_run"]["full_data"],
        "metric": card["metric"],
    }


def recorded_outcome(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The latest retrain's winner as `outcome` recorded it in a study's attributes, or None
    when there is none, or when the attribute is not hpo's (a plain Optuna study may hold a
    `retrain` attribute of its own)."""
    found = attrs.get(OUTCOME_ATTR)
    if not isinstance(found, dict):
        return None
    number: tuple[type, ...] = (int, float)
    kinds: dict[str, type | tuple[type, ...]] = {
        "study": str,
        "params": dict,
        "mean": number,
        "seeds": int,
        "model": str,
        "metric": str,
        "search_trial": int,
    }
    if any(not isinstance(found.get(key), kind) for key, kind in kinds.items()):
        return None
    if found.get("std") is not None and not isinstance(found["std"], number):
        return None
    return found
