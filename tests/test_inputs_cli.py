"""Strange command-line values through the real CLI: storage URLs, dashboard host and port,
--device. Each is one line naming the fix, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import torch

from tests.conftest import REPO, exit_code, run_hpo, tiny_config, write_config

# A password with unescaped `@` and `/`: SQLAlchemy would read `Zq9` as the password and
# `Xk7/w@127.0.0.1` as the host, so a message naming the host printed the password's tail.
AT_PASSWORD_URL = "postgresql+psycopg2://hpo:Zq9@Xk7/w@127.0.0.1:5432/hpo"


def _monitor_args(command: str, url: str) -> list[str]:
    study = ["--study", "s"] if command in ("status", "best") else []
    return [command, "--storage", url, *study]


@pytest.mark.parametrize("command", ["run", "studies", "status", "best", "dashboard"])
def test_no_fragment_of_a_password_with_an_at_sign_is_printed(
    tmp_path: Path, easy_data: tuple[Path, Path], command: str
) -> None:
    if command == "run":
        config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
        args = ["run", "--study", "s", "--config", str(config), "--storage", AT_PASSWORD_URL]
    else:
        args = _monitor_args(command, AT_PASSWORD_URL)
    result = run_hpo(*args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    for fragment in ("Zq9", "Xk7", "Xk7/w"):
        assert fragment not in output, output
    assert "write an '@' inside the user name or password as %40" in result.stderr
    assert "hpo:***@127.0.0.1:5432/hpo" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.glob("*.db")) == []


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg2://u:Zq9@host:abc/db", "is not a database URL"),
        ("postgresql+psycopg2://u:Zq9@host:70000/db", "has port 70000, outside 1-65535"),
        ("postgresql+asyncpg://u:Zq9@host/db", "which Optuna cannot use; write postgresql+psy"),
    ],
    ids=["port not a number", "port out of range", "async driver"],
)
def test_a_bad_storage_url_is_one_line(tmp_path: Path, url: str, expected: str) -> None:
    result = run_hpo("studies", "--storage", url, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert "Zq9" not in result.stdout + result.stderr


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("notes.txt", "names 'notes.txt', which is not an SQLite database"),
        ("no-folder/hpo.db", "a folder that does not exist; create the folder or fix the path"),
    ],
    ids=["not a database", "no such folder"],
)
def test_a_bad_sqlite_path_is_one_line_and_leaves_no_lock_file(
    tmp_path: Path, target: str, expected: str
) -> None:
    (tmp_path / "notes.txt").write_text("my notes\n")
    result = run_hpo("run", "--study", "s", "--storage", f"sqlite:///{target}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_postgresql_without_a_driver_uses_psycopg2(tmp_path: Path, postgres_url: str) -> None:
    optuna.create_study(study_name="bare-url", storage=postgres_url)
    bare = postgres_url.replace("postgresql+psycopg2://", "postgresql://", 1)
    assert bare != postgres_url
    result = run_hpo("studies", "--storage", bare, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bare-url" in result.stdout


@pytest.fixture
def study_db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'watch.db'}"
    optuna.create_study(storage=url, study_name="x")
    return url


def test_dashboard_on_a_port_in_use_is_one_line(tmp_path: Path, study_db: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = run_hpo(
            "dashboard", "--storage", study_db, "--port", str(port), cwd=tmp_path, timeout=30
        )
    assert time.monotonic() - started < 20
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"hpo: error: dashboard: cannot listen on 127.0.0.1:{port} (" in result.stderr
    assert "another program listens there: choose another --port" in result.stderr
    assert "Traceback" not in result.stderr and "http://" not in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--port", "99999"], "argument --port: 99999 is outside 1-65535"),
        (["--port", "-1"], "argument --port: -1 is outside 1-65535"),
        (["--port", "http"], "argument --port: 'http' is not a port number"),
        (["--host", "no-such-host.invalid"], "--host must name this machine: 127.0.0.1"),
        (["--host", " "], "argument --host: is empty; give 127.0.0.1"),  # not every interface
    ],
    ids=["port too large", "negative port", "port not a number", "unknown host", "empty host"],
)
def test_dashboard_with_a_bad_host_or_port_is_one_line(
    tmp_path: Path, study_db: str, args: list[str], expected: str
) -> None:
    result = run_hpo("dashboard", "--storage", study_db, *args, cwd=tmp_path, timeout=30)
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_dashboard_host_as_the_banner_writes_it() -> None:
    from hpo.cli.parser import build_parser

    args = build_parser().parse_args(["dashboard", "--host", "[::1]"])
    assert args.host == "::1"


@pytest.fixture
def float_choices_config(tmp_path: Path, easy_data: tuple[Path, Path]) -> Path:
    """A categorical learning rate with float choices: it used to fail to load (TypeError)."""
    raw = tiny_config(*easy_data)
    raw["search_space"]["learning_rate"] = {"type": "categorical", "choices": [1e-4, 3e-4]}
    path = write_config(tmp_path / "c.yaml", raw)
    path.write_text(path.read_text().replace("0.0001", "1e-4"))  # as YAML 1.1 users write it
    return path


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU"])
def test_batch_size_with_a_bad_device_name_is_one_line(
    tmp_path: Path,
    float_choices_config: Path,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    batch_size = ["batch-size", "--config", str(float_choices_config), "--device", device]
    assert exit_code(hpo_main, batch_size) == 2
    err = capsys.readouterr().err
    assert f"--device: got {device!r}; must be auto, cpu, cuda or cuda:N" in err, err[-3000:]
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_batch_size_on_cuda_without_cuda_is_one_line(
    tmp_path: Path,
    float_choices_config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    started = time.monotonic()
    batch_size = ["batch-size", "--config", str(float_choices_config), "--device", "cuda"]
    assert exit_code(hpo_main, batch_size) == 2
    err = capsys.readouterr().err
    assert "--device is 'cuda' but CUDA is not available; use auto or cpu" in err, err[-3000:]
    assert "Traceback" not in err
    assert time.monotonic() - started < 60  # before the data is tokenized


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_run_on_cuda_without_cuda_is_one_line_and_writes_nothing(
    tmp_path: Path,
    float_choices_config: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    database = tmp_path / "s.db"
    run = ["run", "--study", "s", "--config", str(float_choices_config), "--device", "cuda"]
    assert exit_code(hpo_main, [*run, "--storage", f"sqlite:///{database}"]) == 2
    err = capsys.readouterr().err
    assert "--device is 'cuda' but CUDA is not available; use auto or cpu" in err, err[-3000:]
    assert "Traceback" not in err and not database.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_cuda_names_where_the_user_asked_for_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
    float_choices_config: Path,
) -> None:
    """`--device cuda` typed on the command line is not `training.device` in a config."""
    storage = ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
    run = ["run", "--study", "s", *storage]
    assert hpo_main([*run, "--config", str(float_choices_config), "--device", "cuda:0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hpo: error: --device is 'cuda:0' but CUDA is not available; use auto or cpu"
    )
    in_config = tmp_path / "cuda.yaml"
    in_config.write_text(
        float_choices_config.read_text().replace("device: cpu", "device: cuda"), "utf-8"
    )
    assert hpo_main([*run, "--config", str(in_config)]) == 2
    assert "hpo: error: training.device is 'cuda' but CUDA" in capsys.readouterr().err
    assert not (tmp_path / "s.db").exists()


def test_a_database_without_optunas_tables_is_one_line_for_monitoring(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    import sqlite3

    database = tmp_path / "other.db"
    with sqlite3.connect(database) as conn:
        conn.execute("CREATE TABLE unrelated (x INTEGER)")
    before = database.read_bytes()
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    assert hpo_main(["studies", "--storage", f"sqlite:///{database}"]) == 2
    err = capsys.readouterr().err
    # Not "check the host, port and credentials": the connection worked.
    assert "holds no Optuna tables: no study was ever created in it" in err, err[-3000:]
    assert "Traceback" not in err and database.read_bytes() == before


def test_output_that_cannot_be_written_is_one_line(tmp_path: Path, study_db: str) -> None:
    """`hpo studies > /dev/full`: a full disk under a redirect."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "hpo", "studies", "--storage", study_db],
            cwd=tmp_path,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot write the output to standard output (No space left on device)" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["report", "--study", "x", "--format", "md"],
        ["studies"],
        ["enqueue", "--study", "x", "--params", '{"learning_rate": 0.002}'],
        ["run", "--study", "new", "--n-trials", "1"],
    ],
    ids=["report", "studies", "enqueue", "run"],
)
def test_a_closed_standard_output_is_one_line(
    tmp_path: Path, study_db: str, args: list[str]
) -> None:
    """`hpo report --format md >&-` exited 0 with the report nowhere (hostile try F11); now
    every command refuses at once, as for /dev/full, and does nothing."""
    database = tmp_path / "watch.db"
    before = database.read_bytes()
    done = subprocess.run(
        [
            "bash",
            "-c",
            'exec "$@" >&-',
            "bash",
            sys.executable,
            "-m",
            "hpo",
            *args,
            "--storage",
            study_db,
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "hpo: error: standard output is closed (>&-), and hpo writes its answer there: send it "
        "to a file (> out.txt) or, to drop it, to /dev/null"
    ]
    assert database.read_bytes() == before  # nothing queued, no study created
