"""Small synthetic data sets for the search benchmark's grids (bench/search_grid.py writes them
when a task's files are missing; or: .venv/bin/python bench/search_data.py --task ner).

- ner: token classification, template sentences with people, places and organisations, among
  many untagged words; a third of the evaluation rows' names never appear in training. A tiny
  model first tags every word 'O' (entity F1 0) and only later finds the entities: curves that
  sit on a plateau, then jump.
- regression: a score from 1 to 5 that a quality word gives, moved by an intensifier and turned
  around by a negation, with noise on the targets; a small evaluation set makes each
  evaluation noisy.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "bench" / "data"

FIRST = (
    "Maria Kenji Olga Pedro Aisha Lars Chen Fatima Ivan Lucia Tomas Amara Yuki Omar Sofia "
    "Rahul Greta Kwame Elena Jonas"
).split()
LAST = ["Okafor", "Tanaka", "Nilsson", "Haddad", "Silva", "Novak", "Kim", "Moreau", "Ortiz"]
PLACES = (
    "Lagos, Oslo, Lima, Buenos Aires, Cape Town, Hanoi, Quito, Riga, Dakar, Kyoto, Porto, "
    "Tunis, San Jose, New Delhi, Graz, Perth"
).split(", ")
ORGS = (
    "Acme Corporation, Summit Bank, Orion Systems, Helix Pharma, Vega Motors, Blue Harbor "
    "Foods, Nimbus Air, Atlas Mining, Crescent Media, Polar Labs"
).split(", ")
TEMPLATES = [
    "{PER} flew to {LOC} on a rainy day last week .",
    "after the long meeting {PER} said that {ORG} will hire more people in {LOC} .",
    "{ORG} opened a small office in {LOC} this spring .",
    "yesterday {PER} met {PER} at the old station .",
    "the weather was fine and the market was quiet all day .",
    "nobody expected the price of bread to rise again so soon .",
    "a report from {ORG} says sales fell in the north .",
    "{PER} , who lives near {LOC} , left {ORG} in june .",
]

SCORES = {"awful": 1.0, "poor": 2.0, "okay": 3.0, "good": 4.0, "superb": 5.0}
FILLER = ["the", "room", "was", "really", "and", "food", "our", "stay", "felt", "staff", "view"]


def ner_rows(n: int, seed: int, held_out: bool = False) -> list[dict[str, list[str]]]:
    """Sentences from the templates; the names of the training rows are the first two thirds of
    each list, those of held-out rows any of the list: a third of the entities to find are
    names never seen, which only where they stand tells (F1 1.0 by memory otherwise)."""
    rng = random.Random(seed)

    def names(words: list[str]) -> list[str]:
        cut = len(words) * 2 // 3
        return words if held_out else words[:cut]

    first, last, places, orgs = names(FIRST), names(LAST), names(PLACES), names(ORGS)
    rows = []
    for _ in range(n):
        words: list[str] = []
        tags: list[str] = []
        for piece in rng.choice(TEMPLATES).split():
            kind = piece[1:-1] if piece.startswith("{") else None
            if kind is None:
                words.append(piece)
                tags.append("O")
                continue
            if kind == "PER":
                entity = [rng.choice(first)] + ([rng.choice(last)] if rng.random() < 0.5 else [])
            else:
                entity = rng.choice(places if kind == "LOC" else orgs).split()
            words += entity
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
        rows.append({"tokens": words, "tags": tags})
    return rows


def regression_rows(n: int, seed: int, held_out: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = rng.choice(list(SCORES))
        score = SCORES[word]
        before = rng.choices(FILLER, k=rng.randint(1, 4))
        after = rng.choices(FILLER, k=rng.randint(0, 3))
        middle = [word]
        if rng.random() < 0.3:  # "very good" is better, "very poor" worse
            middle = ["very", word]
            score = 3.0 + (score - 3.0) * 1.5
        if rng.random() < 0.25:  # "not good" turns the score around the middle
            middle = ["not", *middle]
            score = 6.0 - score
        score += rng.gauss(0.0, 0.4)
        rows.append({"text": " ".join([*before, *middle, *after]), "score": round(score, 2)})
    return rows


# Per task: (train rows, eval rows, the rows' maker).
SETS = {"ner": (320, 96, ner_rows), "regression": (400, 64, regression_rows)}


def files(task: str) -> tuple[Path, Path]:
    return FOLDER / task / "train.jsonl", FOLDER / task / "eval.jsonl"


def write(task: str) -> tuple[Path, Path]:
    """The task's train and eval files (fixed seeds: the same rows every time)."""
    n_train, n_eval, make = SETS[task]
    train, evaluation = files(task)
    train.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in ((train, make(n_train, 1)), (evaluation, make(n_eval, 2, held_out=True))):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return train, evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=sorted(SETS), required=True)
    for path in write(parser.parse_args().task):
        print(path)


if __name__ == "__main__":
    main()
