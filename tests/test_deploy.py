"""The cluster launchers in deploy/: the Slurm batch script run with a fake `srun` and a fake
`hpo` (its command line, and a SIGTERM passed on and waited for), and the Kubernetes manifests
validated against the Kubernetes API schemas (kubernetes-validate) and checked for what hpo needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpo.cli.parser import build_parser
from hpo.config.schema import StudyConfig
from tests.conftest import REPO

SBATCH = REPO / "deploy" / "slurm" / "hpo-workers.sbatch"
K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"

FAKE_SRUN = """#!/usr/bin/env bash
# srun's own options, then the command of each task (here: one task, run in place).
echo "$@" > "$FAKE_LOG/srun-args"
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
FAKE_HPO = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_LOG/hpo-args"
echo "$HPO_STORAGE $HPO_CACHE_DIR" > "$FAKE_LOG/hpo-env"
log="$FAKE_LOG/hpo-signals"
trap 'echo TERM >> "$log"; sleep 1; echo handed-back >> "$log"; exit 0' TERM
touch "$FAKE_LOG/started"
while true; do sleep 0.1; done
"""


def _fakes(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("hpo", FAKE_HPO)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HPO_CACHE_DIR"}
    return {
        **env,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path),
        "HOME": str(tmp_path),
    }


def test_the_slurm_script_starts_the_workers_and_hands_a_sigterm_on(tmp_path: Path) -> None:
    env = {**_fakes(tmp_path), "HPO_STORAGE": "postgresql+psycopg2://hpo:pw@db:5432/hpo"}
    job = subprocess.Popen(
        ["bash", str(SBATCH), "nli run", "configs/nli.yaml", "--n-trials", "50"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # what Slurm sends before the time limit, or to preempt
    _, stderr = job.communicate(timeout=30)
    assert job.returncode == 0, stderr
    assert "SIGTERM received; the workers hand their trials back" in stderr
    # The workers got it and the script waited for them to hand their trials back.
    assert (tmp_path / "hpo-signals").read_text().split() == ["TERM", "handed-back"]
    args = (tmp_path / "hpo-args").read_text().split("\n")[:-1]
    assert args == [
        "run",
        "--study",
        "nli run",
        "--config",
        "configs/nli.yaml",
        "--gpus",
        "auto",
        "--n-trials",
        "50",
    ]
    parsed = build_parser().parse_args(args)  # what hpo itself accepts
    assert parsed.study == "nli run" and parsed.gpus == "auto" and parsed.n_trials == 50
    assert "--ntasks-per-node=1" in (tmp_path / "srun-args").read_text()
    storage, cache = (tmp_path / "hpo-env").read_text().split()
    assert storage == env["HPO_STORAGE"] and cache == f"{tmp_path}/.cache/hpo"


@pytest.mark.parametrize(
    ("args", "storage", "message"),
    [(["s", "c.yaml"], None, "set HPO_STORAGE"), (["s"], "sqlite:///x.db", "usage:")],
    ids=["no storage", "no config"],
)
def test_the_slurm_script_refuses_to_start_without_its_inputs(
    tmp_path: Path, args: list[str], storage: str | None, message: str
) -> None:
    env = _fakes(tmp_path)
    env.pop("HPO_STORAGE", None)
    if storage:
        env["HPO_STORAGE"] = storage
    done = subprocess.run(
        ["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "started").exists()


def test_the_slurm_script_asks_for_a_signal_before_the_time_limit() -> None:
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:TERM@120" in directives  # time to hand trials back
    assert "#SBATCH --requeue" in directives


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, document)
        for path in sorted(K8S.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def test_the_kubernetes_manifests_are_valid_kubernetes_objects() -> None:
    validate = pytest.importorskip("kubernetes_validate")
    documents = _documents()
    kinds = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for _, doc in documents)
    assert kinds == [
        "Deployment/hpo-dashboard",
        "Job/hpo-workers",
        "Service/hpo-dashboard",
        "Service/hpo-db",
        "StatefulSet/hpo-db",
    ]
    for name, document in documents:
        try:
            validate.validate(document, KUBERNETES_VERSION, strict=True)
        except validate.ValidationError as e:
            pytest.fail(f"{name}: {document['kind']}: {e.message} at {list(e.path)}")


def test_the_workers_get_a_gpu_time_to_hand_back_and_the_secret_never_written_down() -> None:
    documents = {doc["kind"]: doc for _, doc in _documents()}
    pod = documents["Job"]["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= StudyConfig().stop_timeout + 30
    args = build_parser().parse_args(worker["args"])
    assert args.command == "run" and args.study
    config = Path(args.config)  # the image holds the repository's configs/ under /app
    assert (
        config.parts[:3] == ("/", "app", "configs") and (REPO / "configs" / config.name).is_file()
    )
    for _, document in _documents():
        text = yaml.safe_dump(document)
        assert "password:" not in text.replace("key: password", "")  # only references
        for container in _containers(document):
            env = {e["name"]: e for e in container.get("env", [])}
            secret = env.get("HPO_DB_PASSWORD") or env.get("POSTGRES_PASSWORD")
            assert secret is not None, container["name"]
            assert secret["valueFrom"]["secretKeyRef"] == {"name": "hpo-db", "key": "password"}
            if "HPO_STORAGE" in env:  # the password, by reference, declared before its use
                names = list(env)
                assert names.index("HPO_DB_PASSWORD") < names.index("HPO_STORAGE")
                assert "$(HPO_DB_PASSWORD)@hpo-db:5432/hpo" in env["HPO_STORAGE"]["value"]
    database = documents["StatefulSet"]["spec"]
    assert database["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {})
    return list(spec.get("template", {}).get("spec", {}).get("containers", []))


def test_the_image_runs_hpo_under_an_init_that_reaps_orphans() -> None:
    """In Kubernetes the container's first process inherits every orphan; hpo is not an init."""
    import json

    lines = (REPO / "Dockerfile").read_text(encoding="utf-8").splitlines()
    entrypoints = [
        json.loads(line.split(None, 1)[1]) for line in lines if line.startswith("ENTRYPOINT")
    ]
    assert entrypoints == [["tini", "-s", "--", "hpo"]]
    assert any("apt-get install" in line and "tini" in line for line in lines)
