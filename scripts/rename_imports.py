#!/usr/bin/env python3
"""Issue 49: `trainer` and `storage` are imported as `hpo.trainer` and `hpo.storage`. Rewrites
every tracked text file of the repository in place; idempotent, so it can run again after a
merge that brought new `from trainer...` lines (`python scripts/rename_imports.py`, then review
`git diff`). The folders stay where they are: hpo/trainer and hpo/storage link to them.

What it rewrites, for X in trainer and storage (and only for X's real submodules, read from
the folders, so a config key or an English sentence is left alone):
  - `from X import ...`, `from X.sub import ...` (code, notebooks, docs) -> `from hpo.X...`
  - `import X.sub` -> `import hpo.X.sub`, and that file's uses of `X.sub.` likewise;
    `import X.sub as name` -> `import hpo.X.sub as name`; a bare `import X` -> `from hpo import X`
  - a module named in a string, a log name or a doc: "X.sub", 'X.sub', `X.sub` -> hpo.X.sub
  - `import a, X.sub` (a list, in code or in a string of code) -> `import a, hpo.X.sub`
Then ruff sorts the imports and formats the Python files it changed (the names are longer).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "storage")
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".ipynb", ".sh", ".cfg", ".ini", ".txt"}
# Its own patterns, its test's examples of the old names, the history.
SKIPPED = {"scripts/rename_imports.py", "tests/test_release.py", "CHANGELOG.md"}


def submodules(package: str) -> list[str]:
    """The names directly under the package's folder: its modules and subpackages."""
    folder = REPO / package
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return sorted(names, key=len, reverse=True)  # the longest first: a name that prefixes another


def rules() -> list[tuple[re.Pattern[str], str]]:
    found = []
    for package in PACKAGES:
        subs = "|".join(submodules(package))
        # from X import ..., from X.sub... import ...: not after a dot (hpo.X already) or a word.
        found.append(
            (
                re.compile(rf"(?<![\w.])from {package}((?:\.[\w.]+)? import )"),
                rf"from hpo.{package}\1",
            )
        )
        # import X.sub as name
        found.append(
            (
                re.compile(rf"^(\s*)import {package}(\.[\w.]+ as \w+)", re.MULTILINE),
                rf"\1import hpo.{package}\2",
            )
        )
        # import X (bare): the name X keeps meaning the package in that file
        found.append(
            (
                re.compile(rf"^(\s*)import {package}\s*$", re.MULTILINE),
                rf"\1from hpo import {package}",
            )
        )
        # a module named in a string or between backticks
        found.append((re.compile(rf"([\"'`]){package}\.({subs})\b"), rf"\1hpo.{package}.\2"))
    return found


def listed_imports(text: str) -> str:
    """`import a, X.sub` (in code, or in a string of code a test runs): the listed X.sub too."""
    names = "|".join(PACKAGES)
    listed = re.compile(rf"(import |, )({names})\.(?=\w)")

    def line(match: re.Match[str]) -> str:
        return listed.sub(r"\1hpo.\2.", match.group(0))

    return re.sub(r"\bimport [\w.]+(?:, [\w.]+)+", line, text)


def plain_imports(text: str) -> list[str]:
    """The dotted names of `import X.sub` (no alias) in the file: its uses name them in full."""
    names = []
    for package in PACKAGES:
        pattern = rf"^\s*import ({package}\.[\w.]+)\s*$"
        names += re.findall(pattern, text, re.MULTILINE)
    return names


def rewrite(text: str) -> str:
    for dotted in sorted(set(plain_imports(text)), key=len, reverse=True):
        text = re.sub(rf"(?<![\w.]){re.escape(dotted)}\b", f"hpo.{dotted}", text)
    for pattern, replacement in rules():
        text = pattern.sub(replacement, text)
    return listed_imports(text)


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    paths = []
    for name in filter(None, listed.split("\0")):
        path = REPO / name
        shell = name.startswith("scripts/") and "." not in Path(name).name
        if name in SKIPPED or path.is_symlink() or not path.is_file():
            continue
        if path.suffix in SUFFIXES or shell:
            paths.append(path)
    return paths


def tidy(paths: list[Path]) -> None:
    """The longer names move imports in their sorted order and lengthen lines: ruff puts both
    right, as scripts/test checks them."""
    ruff = REPO / ".venv" / "bin" / "ruff"
    python = [str(p) for p in paths if p.suffix == ".py"]
    if not python:
        return
    if not ruff.exists():
        print(
            "rename_imports: no .venv/bin/ruff; run ruff check --fix and ruff format",
            file=sys.stderr,
        )
        return
    subprocess.run([str(ruff), "check", "-q", "--fix", "--select", "I", *python], cwd=REPO)
    subprocess.run([str(ruff), "format", "-q", *python], cwd=REPO)


def main() -> int:
    changed = []
    for path in tracked_files():
        text = path.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
            print(path.relative_to(REPO))
    tidy(changed)
    print(f"rename_imports: {len(changed)} files rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
