"""`hpo run --gpus` and `--workers-per-gpu`: which GPUs, how many workers each, and one Ctrl-C
stops them all.

This host has no GPU: HPO_TEST_FAKE_GPUS makes hpo see N GPUs whose workers train on the CPU,
which exercises everything but CUDA itself (the `gpu` tests do that where a GPU exists)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpo.cli.parser import build_parser
from hpo.commands import launcher
from hpo.commands.launcher import choose_workers_per_gpu, select_gpus, worker_argv
from hpo.errors import ConfigError
from hpo.trainer.memory import BUDGET_ENV
from tests.conftest import run_hpo, start_hpo, tiny_config, wait_until_training, write_config


def test_gpu_lists_are_checked_against_the_visible_gpus() -> None:
    assert select_gpus("auto", ["0", "1"]) == ["0", "1"]
    assert select_gpus("auto", []) == []
    assert select_gpus("none", ["0"]) == []
    assert select_gpus("0, 3", ["0", "1", "3"]) == ["0", "3"]
    with pytest.raises(ConfigError, match="GPU 2 is not visible on this host"):
        select_gpus("0,2", ["0", "1"])
    with pytest.raises(ConfigError, match="listed twice"):
        select_gpus("1,1", ["0", "1"])
    with pytest.raises(ConfigError, match=r"GPU 0 is not visible on this host \(visible: none"):
        select_gpus("0,0", [])  # named once


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("auto,1", "auto stands alone and cannot be combined with GPU ids: give --gpus auto or"),
        ("none,0", "none stands alone and cannot be combined with GPU ids: give --gpus none or"),
        ("0.5", "'0.5' is not a GPU id: GPU ids are the whole numbers nvidia-smi lists (0, 1"),
        ("0,gpu1", "'gpu1' is not a GPU id"),
    ],
)
def test_a_gpu_list_that_is_not_one_says_why(spec: str, expected: str) -> None:
    """Hostile try F9: each was refused as 'GPU auto, 1 is not visible on this host'."""
    with pytest.raises(ConfigError) as refused:
        select_gpus(spec, ["0", "1"])
    assert expected in str(refused.value) and "not visible" not in str(refused.value)
    assert "\n" not in str(refused.value)  # one line


def test_gpus_named_by_uuid_pass_as_cuda_visible_devices_names_them() -> None:
    visible = ["GPU-8f6e2d1c", "MIG-4a1b"]
    assert select_gpus("GPU-8f6e2d1c", visible) == ["GPU-8f6e2d1c"]
    with pytest.raises(ConfigError, match="GPU GPU-0000 is not visible"):
        select_gpus("GPU-0000", visible)


def test_workers_get_the_users_arguments_without_gpus() -> None:
    argv = ["run", "--study", "s", "--gpus", "0,1", "--n-trials=4", "--gpus=auto", "--quiet"]
    assert worker_argv(argv) == ["run", "--study", "s", "--n-trials=4", "--quiet"]


def _cpu_only_env() -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "", "HPO_TEST_FAKE_GPUS": ""}


def test_an_absent_gpu_is_one_clear_line_and_nothing_is_written(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'g.db'}"
    result = run_hpo(
        "run",
        "--study",
        "g",
        "--config",
        str(config),
        "--storage",
        url,
        "--gpus",
        "0",
        cwd=tmp_path,
        env=_cpu_only_env(),
    )
    assert result.returncode == 2
    assert "GPU 0 is not visible on this host (visible: none)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "g.db").exists()


def test_auto_without_a_gpu_runs_one_cpu_worker(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    training = {"max_steps": 2, "device": "cuda"}
    # The trial trains in the worker (trial_isolation: none): no fork server's imports.
    raw = tiny_config(
        *easy_data, study={"n_trials": 1, "trial_isolation": "none"}, training=training
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    result = run_hpo(
        "run",
        "--study",
        "g",
        "--config",
        str(config),
        "--storage",
        url,
        "--gpus",
        "auto",
        cwd=tmp_path,
        env=_cpu_only_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no GPU visible on this host: one worker on the CPU" in result.stderr
    trial = optuna.load_study(study_name="g", storage=url).get_trials()[0]
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["device_name"].startswith("cpu")


def test_one_worker_per_gpu_shares_the_study(tmp_path: Path, easy_data: tuple[Path, Path]) -> None:
    # The trials train in their workers (trial_isolation: none): no fork server per worker.
    raw = tiny_config(
        *easy_data, study={"n_trials": 6, "trial_isolation": "none"}, training={"max_steps": 2}
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    result = run_hpo(
        "run",
        "--study",
        "g",
        "--config",
        str(config),
        "--storage",
        url,
        "--gpus",
        "auto",
        cwd=tmp_path,
        env={"HPO_TEST_FAKE_GPUS": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="g", storage=url).get_trials()
    assert sorted(t.number for t in trials) == list(range(6))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert {t.user_attrs["gpu"] for t in trials} == {"gpu0", "gpu1"}
    assert len({t.user_attrs["worker"] for t in trials}) == 2
    assert "[gpu1 " in result.stderr  # each worker's log lines name its GPU


def test_one_ctrl_c_stops_every_worker_and_hands_their_trials_back(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # The trials train in their workers (trial_isolation: none): the stop is the workers'.
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 4, "stop_timeout": 5, "trial_isolation": "none"},
        training={"epochs": 1000},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    args = ("run", "--study", "g", "--config", str(config), "--storage", url, "--gpus", "0,1")
    supervisor = start_hpo(*args, cwd=tmp_path, env={"HPO_TEST_FAKE_GPUS": "2"}, own_group=True)
    wait_until_training(url, "g", [supervisor], trials=2)  # both workers at once
    os.killpg(supervisor.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    _, stderr = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 130, stderr[-3000:]
    trials = optuna.load_study(study_name="g", storage=url).get_trials()
    states = sorted(t.state.name for t in trials)
    assert states == ["FAIL", "FAIL", "WAITING", "WAITING"], stderr[-3000:]
    assert {t.user_attrs.get("interrupted") for t in trials if t.state == TrialState.FAIL} == {
        "SIGINT"
    }


def test_workers_per_gpu_values_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["run", "--study", "s", "--workers-per-gpu", "2"]).workers_per_gpu == 2
    assert parse(["run", "--study", "s", "--workers-per-gpu", "AUTO"]).workers_per_gpu == "auto"
    for bad in ("0", "-1", "17", "two", "1.5", ""):
        with pytest.raises(SystemExit) as exited:
            parse(["run", "--study", "s", f"--workers-per-gpu={bad}"])
        assert exited.value.code == 2
        assert "argument --workers-per-gpu: got" in capsys.readouterr().err
    argv = ["run", "--workers-per-gpu", "2", "--study", "s", "--workers-per-gpu=auto", "--quiet"]
    assert worker_argv(argv) == ["run", "--study", "s", "--quiet"]


def test_auto_picks_the_most_workers_whose_share_holds_the_largest_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fits = {0.25: 6, 0.5: 13}  # physical batch within a quarter and a half of the GPU
    asked: list[float] = []
    bounds: list[int | None] = []

    def within(config: str, gpu: str, share: float, bound: int | None) -> int:
        asked.append(share)
        bounds.append(bound)
        return fits[share]

    monkeypatch.setattr(launcher, "_largest_batch_within", within)
    assert choose_workers_per_gpu("c.yaml", "0", 6, 7)[0] == 4 and asked == [0.25]
    assert bounds == [7]  # searched no further than the decision needs
    assert choose_workers_per_gpu("c.yaml", "0", 8)[0] == 2
    workers, why = choose_workers_per_gpu("c.yaml", "0", 64)
    assert workers == 1 and "does not fit the largest effective batch (64)" in why


def test_explicit_workers_per_gpu_without_a_gpu_is_one_line(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'g.db'}"
    result = run_hpo(
        "run",
        "--study",
        "g",
        "--config",
        str(config),
        "--storage",
        url,
        "--workers-per-gpu",
        "2",
        cwd=tmp_path,
        env=_cpu_only_env(),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--workers-per-gpu 2: no GPU to share on this host" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "g.db").exists()


def test_workers_per_gpu_auto_without_a_gpu_says_what_it_chose(
    tmp_path: Path, easy_data: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """--workers-per-gpu 2 is refused without a GPU: auto's one CPU worker is not silent."""
    from hpo.commands.run import _auto_workers_per_gpu
    from hpo.config.loader import load_config

    path = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    with caplog.at_level("INFO", logger="hpo"):
        assert _auto_workers_per_gpu(load_config(path), path, []) == 1
    assert caplog.messages == [
        "--workers-per-gpu auto: 1 worker, on the CPU (no GPU on this host to share)"
    ]


def test_workers_per_gpu_auto_shares_one_gpu_and_keeps_the_budget_exact(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # The physical batch is searched, within a simulated GPU whose quarter holds the largest
    # effective batch of the space (8): auto starts 4 workers, each capped at a quarter.
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 4, "trial_isolation": "none"},
        training={"max_steps": 2, "physical_batch_size": "auto", "batch_search_max": 16},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    env = {"HPO_TEST_FAKE_GPUS": "1", BUDGET_ENV: str(2 << 30)}
    result = run_hpo(
        "run",
        "--study",
        "g",
        "--config",
        str(config),
        "--storage",
        url,
        "--workers-per-gpu",
        "auto",
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--workers-per-gpu auto: 4 workers per GPU" in result.stderr
    trials = optuna.load_study(study_name="g", storage=url).get_trials()
    assert sorted(t.number for t in trials) == list(range(4))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert {t.user_attrs["memory_share"] for t in trials} == {0.25}
    assert {t.user_attrs["gpu"] for t in trials} <= {f"gpu0.{k}" for k in range(4)}
    assert len({t.user_attrs["worker"] for t in trials}) >= 2
    assert {t.user_attrs["batch_size_source"] for t in trials} <= {"search", "cache"}
