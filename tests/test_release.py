"""hpo as users install it: one version in one place, what `hpo --version` reports, the
demo shipped in the package, the wheel's contents and the extras."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import hpo.version
from tests.conftest import REPO, exit_code, run_hpo, tiny_config, write_config


def _pyproject_version() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    assert found is not None
    return found.group(1)


def test_the_version_is_pyprojects() -> None:
    assert hpo.version.hpo_version() == _pyproject_version()


def test_a_checkout_without_install_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hpo.version.metadata, "version", not_installed)
    assert hpo.version.hpo_version() == _pyproject_version()
    monkeypatch.setattr(hpo.version, "_PYPROJECT", Path("/nonexistent/pyproject.toml"))
    assert hpo.version.hpo_version() == "unknown"


def test_version_names_what_a_bug_report_needs(tmp_path: Path) -> None:
    done = run_hpo("--version", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"hpo {_pyproject_version()}"
    names = [line.split()[0] for line in lines]
    assert names == ["hpo", "python", "torch", "transformers", "optuna", "device"]
    assert lines[-1] in {"device cpu", "device mps"} or lines[-1].startswith("device cuda")
    assert f"torch {metadata.version('torch')}" in lines


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, as `python -m build` makes them (the wheel from the sdist):
    scripts/test's, named by HPO_DIST, else built here."""
    given = os.environ.get("HPO_DIST")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("hpo-*.whl")
    return wheel


def test_the_wheel_ships_the_demo_laid_out_as_in_the_repository(dist: Path, tmp_path: Path) -> None:
    """Installed (no checkout beside it), hpo finds its demo config, and the config's relative
    data paths reach the demo's data inside the package."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(_wheel(dist))],
        check=True,
        timeout=120,
    )
    code = (
        "from hpo.config.loader import DEMO_CONFIG, load_config; c = load_config(DEMO_CONFIG); "
        "print(DEMO_CONFIG); print(c.data.train_file); print(c.data.eval_file)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    config, train, evaluation = (Path(line) for line in done.stdout.splitlines())
    assert config == target / "hpo" / "_demo" / "configs" / "demo.yaml"
    for data, name in ((train, "train.csv"), (evaluation, "eval.csv")):
        assert data.resolve().is_relative_to(target / "hpo")
        assert data.read_bytes() == (REPO / "data" / "demo" / name).read_bytes()
    assert config.read_bytes() == (REPO / "configs" / "demo.yaml").read_bytes()


def test_the_wheel_holds_one_top_level_package(dist: Path) -> None:
    """trainer and storage are hpo.trainer and hpo.storage: installed beside Coqui's `trainer`
    or PyPI's `storage`, hpo overwrites none of their files."""
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        names = wheel.namelist()
        metadata_text = wheel.read(next(n for n in names if n.endswith("/METADATA"))).decode()
        top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"hpo"}
    assert "hpo/trainer/loop.py" in names and "hpo/storage/url.py" in names
    assert "License-Expression: Apache-2.0" in metadata_text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_sdist_holds_trainer_and_storage_once_and_no_links(dist: Path) -> None:
    (sdist,) = dist.glob("hpo-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    assert not [m.name for m in members if m.issym() or m.islnk()]
    assert "trainer/loop.py" in names and "storage/url.py" in names
    assert not [n for n in names if n.startswith(("hpo/trainer", "hpo/storage"))]
    assert {"setup.py", "LICENSE", "configs/demo.yaml", "data/demo/train.csv"} <= names


# The extras: a feature used without its extra is one line naming the extra, exit 2.


def test_an_s3_store_without_boto3_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    hpo_main: Callable[[list[str]], int],
    easy_data: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` meets uninstalled
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    db = f"sqlite:///{tmp_path / 'h.db'}"
    args = ["run", "--study", "s", "--config", str(config), "--storage", db]
    code = exit_code(hpo_main, [*args, "--artifact-store", "s3://bucket/hpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].endswith(
        "an s3:// artifact store needs boto3, not installed; pip install 'hpo[s3]'"
    )
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "h.db").exists()


def test_a_local_stores_errors_need_no_botocore(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpo.storage.artifacts.errors import is_refusal

    monkeypatch.delitem(sys.modules, "botocore.exceptions", raising=False)
    monkeypatch.setitem(sys.modules, "botocore", None)
    assert is_refusal(RuntimeError("a store's error")) is False


@pytest.mark.parametrize("missing", ["sklearn", "skops"])
def test_stacking_without_scikit_learn_or_skops_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    import hpo.ensemble.errors
    from hpo.ensemble.errors import EnsembleError
    from hpo.ensemble.learners import resolve_learners
    from hpo.ensemble.skops_files import meta_learner_from_bytes

    real = importlib.util.find_spec
    monkeypatch.setattr(
        hpo.ensemble.errors.importlib.util,
        "find_spec",
        lambda name, *a: None if name == missing else real(name, *a),
    )
    package = {"sklearn": "scikit-learn", "skops": "skops"}[missing]
    with pytest.raises(
        EnsembleError,
        match=rf"^stacking needs {package}, not installed; pip install 'hpo\[ensemble\]'$",
    ):
        resolve_learners("sequence_classification", None)
    with pytest.raises(EnsembleError, match=r"pip install 'hpo\[ensemble\]'"):
        meta_learner_from_bytes(b"", "ensemble/meta.skops")


def test_hpo_ensemble_without_skops_says_so_before_any_member_predicts(
    monkeypatch: pytest.MonkeyPatch,
    hpo_main: Callable[[list[str]], int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import hpo.ensemble.errors

    real = importlib.util.find_spec
    monkeypatch.setattr(
        hpo.ensemble.errors.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "skops" else real(name, *a),
    )
    db = f"sqlite:///{tmp_path / 'none.db'}"
    args = ["ensemble", "--study", "s", "--storage", db, "--out", str(tmp_path / "e")]
    assert exit_code(hpo_main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    needs = "hpo ensemble needs skops, not installed; pip install 'hpo[ensemble]'"
    assert err == [f"hpo: error: {needs}"]


def _rename_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "rename_imports", REPO / "scripts/rename_imports.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rename_script_rewrites_what_a_merged_branch_brings_and_only_that() -> None:
    """The lead reruns scripts/rename_imports.py after merging a branch written against the old
    names: each form of import and module name is rewritten, once, and words are left alone."""
    before = (
        "from trainer.loop import train\n"
        "from storage import open_storage\n"
        "import trainer.tasks.base as base\n"
        "import storage\n"
        "    import trainer.inference\n"
        "    trainer.inference.Predictor(p)\n"
        'log = logging.getLogger("trainer.checkpoint")\n'
        'code = "import sys, storage.engine, trainer.loop"\n'
        "# read from storage when the trainer.x is set; config.storage.url; study.storage\n"
    )
    after = (
        "from hpo.trainer.loop import train\n"
        "from hpo.storage import open_storage\n"
        "import hpo.trainer.tasks.base as base\n"
        "from hpo import storage\n"
        "    import hpo.trainer.inference\n"
        "    hpo.trainer.inference.Predictor(p)\n"
        'log = logging.getLogger("hpo.trainer.checkpoint")\n'
        'code = "import sys, hpo.storage.engine, hpo.trainer.loop"\n'
        "# read from storage when the trainer.x is set; config.storage.url; study.storage\n"
    )
    script = _rename_script()
    assert script.rewrite(before) == after
    assert script.rewrite(after) == after


def test_version_names_the_cuda_devices_where_there_are_some(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H200 #{i}")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    report = hpo.version.version_report().splitlines()
    assert report[-1] == "device cuda 12.8: NVIDIA H200 #0, NVIDIA H200 #1"
