"""What a study's size costs each command: `hpo status`, `hpo best --json`, `hpo studies`, `hpo
report --format md` and one more `hpo run` trial, on a study of a handful of real trials and on
copies grown to 20,000 and 100,000 trials, in one run on one PostgreSQL; and the sampler's own
cost per trial (TPE against random) at those sizes, measured apart.

The handful are real trials of the demo config (`hpo run`); the large studies repeat their rows
in SQL (trials, values, parameters, attributes, learning curves), as a long-lived study holds
them. Each command runs as a user runs it (a new process); medians of `--repeat` runs.

Run: .venv/bin/python bench/study_size.py [--admin-url URL] [--sizes 20000,100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.scratch_db import scratch_database  # noqa: E402

ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo.yaml"
BASE = "base"

# Copy `k` finished template trials of study :base into study :new, `n` trials in all.
_GROW = [
    """CREATE TEMP TABLE tmpl AS SELECT trial_id, (row_number() OVER (ORDER BY number)) - 1 AS i
       FROM trials WHERE study_id = :base AND state IN ('COMPLETE', 'PRUNED')""",
    """INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete)
       SELECT g, :new, t.state, t.datetime_start, t.datetime_complete
       FROM generate_series(0, :n - 1) g JOIN tmpl ON tmpl.i = g % :k
       JOIN trials t ON t.trial_id = tmpl.trial_id""",
    """CREATE TEMP TABLE map AS SELECT nt.trial_id AS new_id, tmpl.trial_id AS old_id
       FROM trials nt JOIN tmpl ON tmpl.i = nt.number % :k WHERE nt.study_id = :new""",
    """INSERT INTO trial_values (trial_id, objective, value, value_type)
       SELECT map.new_id, v.objective, v.value, v.value_type
       FROM trial_values v JOIN map ON v.trial_id = map.old_id""",
    """INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json)
       SELECT map.new_id, p.param_name, p.param_value, p.distribution_json
       FROM trial_params p JOIN map ON p.trial_id = map.old_id""",
    """INSERT INTO trial_user_attributes (trial_id, key, value_json)
       SELECT map.new_id, a.key, a.value_json
       FROM trial_user_attributes a JOIN map ON a.trial_id = map.old_id""",
    """INSERT INTO trial_system_attributes (trial_id, key, value_json)
       SELECT map.new_id, a.key, a.value_json
       FROM trial_system_attributes a JOIN map ON a.trial_id = map.old_id""",
    """INSERT INTO trial_intermediate_values
           (trial_id, step, intermediate_value, intermediate_value_type)
       SELECT map.new_id, v.step, v.intermediate_value, v.intermediate_value_type
       FROM trial_intermediate_values v JOIN map ON v.trial_id = map.old_id""",
    "DROP TABLE tmpl",
    "DROP TABLE map",
]
_STUDY_ROWS = [
    """INSERT INTO study_directions (direction, study_id, objective)
       SELECT direction, :new, objective FROM study_directions WHERE study_id = :base""",
    """INSERT INTO study_user_attributes (study_id, key, value_json)
       SELECT :new, key, value_json FROM study_user_attributes WHERE study_id = :base""",
    """INSERT INTO study_system_attributes (study_id, key, value_json)
       SELECT :new, key, value_json FROM study_system_attributes WHERE study_id = :base""",
]


def hpo(*args: str, cwd: Path, url: str) -> float:
    """Seconds one hpo command takes, as a user runs it."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hpo", *args, "--storage", url],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"hpo {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return took


def grow(url: str, name: str, size: int) -> None:
    """Study `name`: the base study's settings and `size` trials copied from its finished ones."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        base = conn.execute(
            sa.text("SELECT study_id FROM studies WHERE study_name = :b"), {"b": BASE}
        ).scalar_one()
        new = conn.execute(
            sa.text("INSERT INTO studies (study_name) VALUES (:n) RETURNING study_id"), {"n": name}
        ).scalar_one()
        k = conn.execute(
            sa.text(
                "SELECT count(*) FROM trials WHERE study_id = :b AND state IN "
                "('COMPLETE', 'PRUNED')"
            ),
            {"b": base},
        ).scalar_one()
        params = {"base": base, "new": new, "n": size, "k": k}
        for statement in _STUDY_ROWS + _GROW:
            conn.execute(sa.text(statement), params)
    with engine.begin() as conn:
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()


def sampler_seconds(url: str, name: str, sampler: optuna.samplers.BaseSampler) -> float:
    """Seconds per `ask` (then a tell, so the next ask sees one more trial) once the study's
    trials are read: the sampler's own cost, apart from reading the study."""
    from hpo.config.loader import load_config
    from hpo.trial.search_space import sample

    config = load_config(CONFIG)
    study = optuna.load_study(study_name=name, storage=url, sampler=sampler)
    study.get_trials(deepcopy=False)  # read once: Optuna's cache keeps finished trials
    times = []
    for _ in range(3):
        started = time.perf_counter()
        trial = study.ask()
        sample(trial, config.search_space)
        times.append(time.perf_counter() - started)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--sizes", default="20000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    # A stop (timeout, Ctrl-C) still drops the scratch database: exit through its `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with (
        scratch_database(args.admin_url, "hpo_bench_size") as url,
        tempfile.TemporaryDirectory() as work,
    ):
        cwd = Path(work)
        env_cache = {"HPO_CACHE_DIR": str(cwd / "cache")}
        os.environ.update(env_cache)
        print("study of a handful: 4 real trials of the demo config ...", flush=True)
        hpo(
            "run",
            "--study",
            BASE,
            "--config",
            str(CONFIG),
            "--n-trials",
            "4",
            "--quiet",
            cwd=cwd,
            url=url,
        )
        names = {4: BASE}
        for size in sizes:
            started = time.perf_counter()
            grow(url, f"size-{size}", size)
            names[size] = f"size-{size}"
            print(
                f"grew a study of {size} trials in {time.perf_counter() - started:.0f} s",
                flush=True,
            )
        rows = []
        for size, name in names.items():
            commands = {
                "status": ("status", "--study", name),
                "best --json": ("best", "--study", name, "--json"),
                "report --format md": ("report", "--study", name, "--format", "md"),
            }
            row = {
                label: statistics.median(
                    hpo(*command, cwd=cwd, url=url) for _ in range(args.repeat)
                )
                for label, command in commands.items()
            }
            done = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
            row["new trial"] = hpo(
                "run",
                "--study",
                name,
                "--config",
                str(CONFIG),
                "--n-trials",
                str(len(done) + 1),
                "--quiet",
                cwd=cwd,
                url=url,
            )
            row["TPE ask"] = sampler_seconds(
                url, name, optuna.samplers.TPESampler(multivariate=True, constant_liar=True, seed=0)
            )
            row["random ask"] = sampler_seconds(url, name, optuna.samplers.RandomSampler(seed=0))
            rows.append((size, row))
            print(
                f"{size} trials: " + ", ".join(f"{k} {v:.2f} s" for k, v in row.items()), flush=True
            )
        studies = statistics.median(hpo("studies", cwd=cwd, url=url) for _ in range(args.repeat))
        report(rows, studies, sum(names))


def report(rows: list[tuple[int, dict[str, float]]], studies_s: float, total: int) -> None:
    labels = list(rows[0][1])
    print()
    print("| trials | " + " | ".join(f"{label} (s)" for label in labels) + " |")
    print("|---:|" + "---:|" * len(labels))
    small = rows[0][1]
    for size, row in rows:
        cells = [
            f"{row[k]:.2f}" + ("" if size == rows[0][0] else f" ({row[k] / small[k]:.2f}x)")
            for k in labels
        ]
        print(f"| {size} | " + " | ".join(cells) + " |")
    print(
        f"\n`hpo studies` over all of them ({total} trials in {len(rows)} studies): "
        f"{studies_s:.2f} s"
    )


if __name__ == "__main__":
    main()
