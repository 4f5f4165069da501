"""hpo's version, read from the installed package's metadata (pyproject.toml's `version`, the one
place it is written), and the report `hpo --version` prints for a bug report.
"""

from __future__ import annotations

import platform
import re
from importlib import metadata
from pathlib import Path

# A checkout run with PYTHONPATH=. and nothing installed has no metadata: pyproject.toml is then
# beside the hpo/ folder.
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def hpo_version() -> str:
    """The version of the installed hpo, else the one pyproject.toml of this checkout names."""
    try:
        return metadata.version("hpo")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = _PYPROJECT.read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return found.group(1) if found else "unknown"


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _device() -> str:
    """What a trial would train on here: CUDA's device names, Apple's MPS, else the CPU."""
    import torch  # the one heavy import: the device is what a bug report most needs

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"cuda {torch.version.cuda}: " + ", ".join(names)
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def version_report() -> str:
    """hpo's version, then what a bug report needs: Python's, torch's, transformers' and
    Optuna's versions and the device."""
    lines = [
        f"hpo {hpo_version()}",
        f"python {platform.python_version()}",
        f"torch {_installed('torch')}",
        f"transformers {_installed('transformers')}",
        f"optuna {_installed('optuna')}",
        f"device {_device()}",
    ]
    return "\n".join(lines)
