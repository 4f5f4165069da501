"""What the read commands print: tables and lines of status, best trials and retrain results,
strict JSON, and the one way output reaches standard output.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.errors import HPOError
from hpo.numbers import metric_text, params_text
from hpo.study.names import shown_study_name

if TYPE_CHECKING:
    pass


# Python sets sys.stdout to None when the process starts with it closed, and print() then
# writes nothing without a word: `hpo report >&-` exited 0 with the report nowhere.
CLOSED_STDOUT = (
    "standard output is closed (>&-), and hpo writes its answer there: send it to a file "
    "(> out.txt) or, to drop it, to /dev/null"
)


def stdout_is_closed() -> bool:
    return sys.stdout is None


def emit(text: str, end: str = "\n") -> None:
    """What a command answers, on standard output: `hpo status > /dev/full` (or a full disk
    under a redirect) is one line, not a traceback; so is a closed standard output."""
    if stdout_is_closed():
        raise HPOError(CLOSED_STDOUT)
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        os.close(devnull)
        raise HPOError(f"cannot write the output to standard output ({e.strerror or e})") from e


def artifact_line(store: dict[str, Any]) -> str:
    if "error" in store:
        return f"artifact store {store['url']}: unreachable ({store['error']})"
    return (
        f"artifact store {store['url']}: {store['size_bytes'] / 1e6:.1f} MB in "
        f"{store['trial_folders']} trial folders"
    )


def studies_table(rows: list[dict]) -> str:
    if not rows:
        return "no studies"
    names = [shown_study_name(row["name"]) for row in rows]
    name_width = max(4, *(len(name) for name in names))
    width = max(9, *(len(row["direction"]) for row in rows))
    lines = [f"{'name':<{name_width}}  {'direction':<{width}} {'trials':>6}  best"]
    for name, row in zip(names, rows, strict=True):
        best = "-" if row["best_value"] is None else f"{row['best_value']:.4f}"
        if len(row["directions"]) > 1:
            best = "Pareto front (hpo best)"
        lines.append(
            f"{name:<{name_width}}  {row['direction']:<{width}} {row['n_trials']:>6}  {best}"
        )
    return "\n".join(lines)


def retrain_text(retrained: dict) -> str:
    """`hpo best` after `hpo retrain`: the configuration that won on the mean over seeds."""
    from hpo.reports.model_card import mean_std_text, seeds_text

    params = params_text(retrained["params"])
    full = ", trained on both splits" if retrained.get("full_data") else ""
    if not Path(retrained["model"]).is_dir():
        full += " (not there any more: moved or removed; hpo retrain again writes it)"
    seeds, study = seeds_text(retrained["seeds"]), retrained["study"]
    return (
        f"retrain winner (mean over {seeds}, study {study!r}): "
        f"{retrained['metric']} {mean_std_text(retrained['mean'], retrained['std'])} ({params}), "
        f"search trial #{retrained['search_trial']}\nfinal model: {retrained['model']}{full}"
    )


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON that strict parsers (jq, JSON.parse) read: an infinite or NaN value (a diverged
    trial's, say) is written as the string "inf", "-inf" or "nan", which float() reads back;
    anything else JSON has no type for (a date) as its text."""

    def finite(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return str(item)
        if isinstance(item, dict):
            return {key: finite(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [finite(v) for v in item]
        return item

    return json.dumps(finite(value), indent=indent, default=str, allow_nan=False)


def best_values_text(best: dict[str, Any]) -> str:
    """A best trial's value with its metric's name and its parameters, `accuracy 0.8734
    (learning_rate=3.2e-05)` (best_trials' entries); a Pareto-front trial's, one value per
    objective: `accuracy 0.8734, samples_per_s 412.3 (...)`."""
    if "values" not in best:
        values = metric_text(best.get("metric"), best["value"])
    else:
        names = best.get("metrics") or [None] * len(best["values"])
        values = ", ".join(metric_text(n, v) for n, v in zip(names, best["values"], strict=False))
    return f"{values} ({params_text(best['params'])})" if best["params"] else values


def rank_state_text(user_attrs: dict[str, Any]) -> str | None:
    """`1.25 GiB of weights and optimizer state a rank (2 ranks)`: what each rank of a sharded
    trial held (None for another trial: it holds them whole)."""
    held = user_attrs.get("rank_state_bytes")
    if not isinstance(held, int) or isinstance(held, bool):
        return None
    ranks = user_attrs.get("ranks")
    text = f"{held / 2**30:.3g} GiB of weights and optimizer state a rank"
    return f"{text} ({ranks} ranks)" if isinstance(ranks, int) else text


def best_text(best: dict) -> str:
    """`best trial #3 of 'demo': accuracy 0.8734 (learning_rate=3.2e-05, ...)`: the value with
    its metric's name, four significant digits (--json keeps every digit)."""
    shown = best_values_text(best)
    if "values" in best:  # a trial of the Pareto front
        text = f"Pareto-front trial #{best['number']} of {best['study']!r}: {shown}"
    else:
        text = f"best trial #{best['number']} of {best['study']!r}: {shown}"
    model = best["user_attrs"].get("best_model")
    uri = best["user_attrs"].get("best_model_uri")
    missing = best.get("model_missing")
    if uri and best.get("adapter"):
        text += (
            f"\nmodel: {uri}, a LoRA adapter (hpo best --download DIR fetches it, loadable "
            "with peft; --merge makes it a plain model)"
        )
    elif uri:
        text += f"\nmodel: {uri} (hpo best --download DIR fetches it)"
    elif model and not missing:
        loader = best.get("model_loader", "AutoModelForSequenceClassification.from_pretrained")
        text += f"\nmodel: {model} ({loader})"
    held = rank_state_text(best["user_attrs"])
    if held is not None:
        text += f"\nmemory: {held}"
    error = best["user_attrs"].get("checkpoint_error")
    if missing:
        text += f"\nWARNING: {missing}"
    elif error and not uri:  # why the model is only on the host that trained it
        text += f"\nnot saved or not uploaded: {error}"
    return text
