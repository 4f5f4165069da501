"""Study names as they enter hpo (CLI and Python API): checked, normalised to Unicode NFC, kept
apart from look-alikes already in the database, and shown so that look-alikes differ on screen.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from hpo.errors import HPOError

MAX_STUDY_NAME_CHARS = 512  # Optuna's studies.study_name column


def checked_study_name(name: str, flag: str = "--study") -> str:
    """`name` in Unicode NFC, the form every study hpo creates is named in: `café` typed with a
    combined é or with e and a combining accent is one study. Any name the database can hold is
    valid (quotes, slashes, unicode: on disk it becomes a slug and a hash, see
    hpo.trial.folders); these it cannot, or nobody means, are one line."""
    name = unicodedata.normalize("NFC", name)
    if not name.strip():
        example = f"{flag} demo" if flag.startswith("--") else f'{flag}="demo"'
        raise HPOError(f"{flag}: the study name is empty; give a name, e.g. {example}")
    if len(name) > MAX_STUDY_NAME_CHARS:
        raise HPOError(
            f"{flag}: the study name has {len(name)} characters; Optuna's database holds at "
            f"most {MAX_STUDY_NAME_CHARS}: use a shorter name"
        )
    if any(ord(c) < 32 for c in name):
        raise HPOError(
            f"{flag}: the study name contains a control character (NUL, newline, tab...); "
            "use printable characters"
        )
    return name


def lookalike_key(name: str) -> str:
    """What a reader sees of `name`: compatibility-normalised (NFKC: the ligature ﬁ is fi),
    case-folded, without invisible characters (zero-width spaces, soft hyphens, direction
    marks). Two names with the same key print alike or nearly so."""
    folded = unicodedata.normalize("NFKC", name).casefold()
    return "".join(c for c in folded if unicodedata.category(c) not in ("Cf", "Cc"))


def check_no_lookalike(name: str, existing: Iterable[str]) -> None:
    """A new study `name` must not look like a study the database already holds: workers
    that typed the name differently would split the budget between two studies that `hpo
    studies` prints alike. `name` itself existing is no look-alike (that study is joined)."""
    names = set(existing)
    if name in names:
        return
    key = lookalike_key(name)
    alike = sorted(other for other in names if lookalike_key(other) == key)
    if alike:
        raise HPOError(
            f"study {quoted_study_name(name)}: the database already holds study "
            f"{quoted_study_name(alike[0])}, which differs only in case or Unicode form; "
            "pass that name exactly to join it, or choose a name that reads differently"
        )


def is_plain(name: str) -> bool:
    """Whether `name` shows as what it is: NFC, every character printable and visible."""
    if unicodedata.normalize("NFC", name) != name:
        return False
    return all(c.isprintable() and unicodedata.category(c) != "Cf" for c in name)


def shown_study_name(name: str) -> str:
    """`name` for a table: as it is when plain, else escaped (`'cafe\\u0301'`) so that a
    look-alike or a name with an invisible character does not pass for another."""
    return name if is_plain(name) else ascii(name)


def quoted_study_name(name: str) -> str:
    """`name` in quotes for a sentence: its repr when plain, else escaped as shown_study_name."""
    return repr(name) if is_plain(name) else ascii(name)
