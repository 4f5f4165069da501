"""The final model's card (hpo retrain): what it is, how it was chosen and trained, how to load
it; as JSON and as the Markdown README.md beside the weights, and the retrain's summary for the
terminal.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import platform
from pathlib import Path
from typing import Any

from hpo import __version__
from hpo.config.schema import Config
from hpo.study.join import factory_loader_text, loader_text
from hpo.study.retrain import ConfigResult, RetrainPlan


def model_card(
    plan: RetrainPlan,
    found: list[ConfigResult],
    winner: ConfigResult,
    chosen: dict[str, Any],
    config: Config,
    metric: str,
    full_data_trial: int | None,
    storage: str,
) -> dict[str, Any]:
    """Everything needed to trust and reproduce the final model (`storage`: the study's
    database, its URL with the password masked)."""
    return {
        "model": card_loader(config),
        "adapter": dataclasses.asdict(config.model.adapter) if config.model.adapter else None,
        "task": config.task,
        "study": plan.source,
        "storage": storage,
        "retrain_study": plan.study_name,
        "metric": metric,
        "winner": {
            "rank_in_search": winner.rank,
            "search_trial": winner.source_trial,
            "params": winner.params,
            "mean": winner.mean,
            "std": winner.std,
            "seeds": len(winner.runs),
        },
        "saved_run": {**chosen, "full_data": full_data_trial is not None}
        if full_data_trial is None
        else {"trial": full_data_trial, "seed": chosen["seed"], "full_data": True},
        "full_data_note": None
        if full_data_trial is None
        else "trained on the training and evaluation splits together; its metric is the mean "
        "of the held-out retrain runs above, not a measurement of this model",
        "configurations": [
            {
                **dataclasses.asdict(r),
                "mean": r.mean if r.runs else None,
                "std": r.std if r.runs else None,
            }
            for r in found
        ],
        "training": {
            k: v
            for k, v in dataclasses.asdict(config.training).items()
            if k not in winner.params and k != "seed"  # each run's seed is listed with it
        },
        "data": data_files(config),
        "versions": versions(),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def card_loader(config: Config) -> str:
    """How the final model loads: a plain model, a LoRA adapter on its base model, or a
    module of the user's factory (its state_dict: HPO_MODEL.md in the folder says how)."""
    if config.model.factory is not None:
        return factory_loader_text(config.model.factory, "<this folder>")
    if config.model.adapter is None:
        return loader_text(config.task, None) + "(<this folder>)"
    return loader_text(config.task, config.model.name_or_path, "<this folder>")


def data_files(config: Config) -> list[dict[str, Any]]:
    from hpo.trainer.digests import content_sha256

    files = []
    for role, location, split in (
        ("train", config.data.train_file, config.data.train_split),
        ("eval", config.data.eval_file, config.data.eval_split),
    ):
        path = Path(location).resolve()
        files.append(
            {
                "role": role,
                "path": str(path),
                "split": split,
                "sha256": content_sha256(path) if path.exists() else None,
            }
        )
    return files


def versions() -> dict[str, str]:
    import optuna
    import peft
    import torch
    import transformers

    return {
        "hpo": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "optuna": optuna.__version__,
    }


def card_markdown(card: dict[str, Any]) -> str:
    """The model card as Markdown (README.md beside the weights)."""
    metric, winner = card["metric"], card["winner"]
    lines = [
        f"# Final model of study {card['study']!r}",
        "",
        f"Retrained by hpo {card['versions']['hpo']} in study {card['retrain_study']!r} on "
        f"{card['created']}. Load it with `{card['model']}`.",
        "",
        f"**{metric}: {mean_std_text(winner['mean'], winner['std'])}** (mean ± standard deviation "
        f"over {seeds_text(winner['seeds'])}), configuration ranked "
        f"{winner['rank_in_search']} in the search (trial {winner['search_trial']}).",
        "",
    ]
    saved = card["saved_run"]
    if saved["full_data"]:
        lines += [
            f"This model: {card['full_data_note']} (trial {saved['trial']}, seed {saved['seed']}).",
            "",
        ]
    else:
        lines += [
            f"This model: the winner's best run (trial {saved['trial']}, seed "
            f"{saved['seed']}, {metric} {saved['value']:.4f}).",
            "",
        ]
    lines += ["## Parameters", ""]
    lines += [f"- `{k}`: {v}" for k, v in winner["params"].items()]
    lines += [
        "",
        "## Configurations retrained",
        "",
        f"| rank | search trial | search {metric} | per seed | mean | std |",
        "|---:|---:|---:|---|---:|---:|",
    ]
    for r in card["configurations"]:
        per_seed = ", ".join(f"{run['value']:.4f} (seed {run['seed']})" for run in r["runs"])
        if r["unfinished"]:
            per_seed += f"; {r['unfinished']} failed or pruned"
        mean = "-" if r["mean"] is None else f"{r['mean']:.4f}"
        std = "-" if r["std"] is None else f"{r['std']:.4f}"  # one run: no spread
        lines.append(
            f"| {r['rank']} | {r['source_trial']} | {r['search_value']:.4f} | "
            f"{per_seed or '-'} | {mean} | {std} |"
        )
    lines += ["", "## Data", ""]
    for f in card["data"]:
        lines.append(f"- {f['role']}: `{f['path']}` (split {f['split']}), sha256 {f['sha256']}")
    lines += ["", "## Training settings", ""]
    lines += [f"- `{k}`: {v}" for k, v in card["training"].items()]
    lines += ["", "## Versions", ""]
    lines += [f"- {k} {v}" for k, v in card["versions"].items()]
    return "\n".join(lines) + "\n"


def summary(card: dict[str, Any], out: Path | None) -> str:
    """The retrain's result for the terminal: every configuration, the winner, the model
    (`out`; None: a training function's retrain, which keeps its own model)."""
    metric = card["metric"]
    lines = [f"retrain of study {card['study']!r} ({card['retrain_study']!r}), {metric}:"]
    for r in card["configurations"]:
        values = ", ".join(f"{run['value']:.4f}" for run in r["runs"]) or "no run completed"
        mean = "" if r["mean"] is None else f"  mean {mean_std_text(r['mean'], r['std'])}"
        mark = "  <- winner" if r["rank"] == card["winner"]["rank_in_search"] else ""
        lines.append(
            f"  #{r['rank']} (search trial {r['source_trial']}, "
            f"{r['search_value']:.4f}): {values}{mean}{mark}"
        )
    params = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in card["winner"]["params"].items()
    )
    lines.append(f"winner: {params}")
    if card["saved_run"]["full_data"]:
        lines.append(f"the final model: {card['full_data_note']}")
    if out is None:
        lines.append(
            "final model: none saved by hpo (training.entrypoint: your function keeps "
            "its own model; retrain the winner's parameters with it)"
        )
    else:
        lines.append(f"final model: {out} (with README.md, its model card)")
    return "\n".join(lines)


def seeds_text(count: int) -> str:
    return f"{count} seed" if count == 1 else f"{count} seeds"


def mean_std_text(mean: float, std: float | None) -> str:
    return f"{mean:.4f} ± {std:.4f}" if std is not None else f"{mean:.4f} (one run, no spread)"
