"""Generate the synthetic datasets under data/: sentiment (demo), NLI, instructions (causal LM)
and regression as CSV files; NER and multi-label as JSON Lines.
Deterministic: fixed seeds and stdlib ``random`` only; run ``python data/generate.py``."""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent

SENTIMENT_SEED = 20240501
NLI_SEED = 20240502
SENTIMENT_TRAIN_PER_LABEL = 1200
SENTIMENT_EVAL_PER_LABEL = 240
NLI_TRAIN_PREMISES = 1000
NLI_EVAL_PREMISES = 200
MIN_WORDS = 6
MAX_WORDS = 30

# --------------------------------------------------------------------------------------------
# Sentiment ("demo") dataset
# --------------------------------------------------------------------------------------------

SUBJECTS: tuple[str, ...] = (
    "the pasta",
    "this hotel",
    "the service",
    "our guide",
    "the room",
    "the breakfast",
    "this phone",
    "the battery life",
    "the movie",
    "the ending",
    "the soundtrack",
    "the coffee",
    "the checkout process",
    "the delivery",
    "our waiter",
    "this laptop",
    "the concert",
    "the tour",
    "the museum",
    "our driver",
    "the pizza",
    "the camera",
    "the app",
    "the customer support",
    "the view",
    "the bed",
    "this book",
    "the game",
    "the spa",
    "the wine",
    "the dessert",
    "the staff",
    "the flight",
    "the rental car",
    "this blender",
    "the course",
    "the teacher",
    "the playlist",
    "the hike",
    "the menu",
)

# Relative clauses inserted after the subject; they contain commas, so CSV quoting is exercised.
SUBJECT_CLAUSES: tuple[str, ...] = (
    "recommended by my sister",
    "praised in every online review",
    "chosen almost at random",
    "suggested by a colleague",
    "new to all of us",
    "talked about by everyone",
    "the reason we came",
    "a last-minute choice",
)

POSITIVE_ADJECTIVES: tuple[str, ...] = (
    "great",
    "excellent",
    "wonderful",
    "fantastic",
    "lovely",
    "good",
    "brilliant",
)
NEGATIVE_ADJECTIVES: tuple[str, ...] = (
    "terrible",
    "awful",
    "disappointing",
    "bad",
    "horrible",
    "poor",
    "boring",
)
INTENSIFIERS: tuple[str, ...] = (
    "really",
    "truly",
    "very",
    "absolutely",
    "quite",
    "extremely",
    "incredibly",
    "so",
    "pretty",
)

# "I <verb> <subject>" and the matching negated auxiliary form.
POSITIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("loved", "love"),
    ("enjoyed", "enjoy"),
    ("liked", "like"),
)
NEGATIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("hated", "hate"),
    ("disliked", "dislike"),
    ("regretted", "regret"),
)
# "<subject> <verb phrase>" with past-tense and bare forms.
POSITIVE_SUBJECT_VERBS: tuple[tuple[str, str], ...] = (
    ("impressed us", "impress us"),
    ("exceeded our expectations", "exceed our expectations"),
    ("won us over", "win us over"),
)
NEGATIVE_SUBJECT_VERBS: tuple[tuple[str, str], ...] = (
    ("disappointed us", "disappoint us"),
    ("let us down", "let us down"),
    ("annoyed everyone", "annoy anyone"),
)

OPENERS: tuple[str, ...] = (
    "Honestly,",
    "Overall,",
    "To be fair,",
    "I have to say",
    "After two visits,",
    "Last weekend",
    "On our trip to Lisbon,",
    "For the price,",
    "In my opinion,",
    "This time",
    "As expected,",
    "To my surprise,",
    "Just like last year,",
    "Once again",
    "Speaking as a regular,",
)
FILLERS: tuple[str, ...] = (
    "when we visited in March",
    "on a rainy Tuesday evening",
    "during our second week there",
    "after a long day of travelling",
    "while my parents were in town",
    "on the first night",
    "at the start of the holidays",
    "around lunchtime",
    "the day after we arrived",
    "when I tried it for the second time",
)
POSITIVE_VERDICTS: tuple[str, ...] = (
    "and we will definitely come back",
    "so I would happily go again",
    "and it was worth every penny",
    "and I would not change a thing",
    "so I told all my friends",
    "and we left with big smiles",
)
NEGATIVE_VERDICTS: tuple[str, ...] = (
    "and we will not be back",
    "so I asked for a refund",
    "and it was a waste of money",
    "and I want my money back",
    "so I warned all my friends",
    "and we left early",
)
NEUTRAL_SENTENCES: tuple[str, ...] = (
    "We went there with two friends.",
    "It was my first time.",
    "We paid by card.",
    "My brother picked it.",
    "We stayed for about an hour.",
    "The weather was cloudy.",
)


def _adjective_phrase(rng: random.Random, positive: bool, negated: bool) -> str:
    """Return e.g. 'was really great' or 'was not that bad'."""
    adjective = rng.choice(POSITIVE_ADJECTIVES if positive else NEGATIVE_ADJECTIVES)
    if not negated:
        if rng.random() < 0.5:
            return f"was {rng.choice(INTENSIFIERS)} {adjective}"
        return f"{rng.choice(('was', 'is', 'turned out to be', 'felt'))} {adjective}"
    form = rng.randrange(6)
    if form == 0:
        return f"was not {adjective}"
    if form == 1:
        return f"wasn't {adjective}"
    if form == 2:
        return f"was never {adjective}"
    if form == 3:
        return f"was not {rng.choice(('very', 'that', 'particularly', 'really'))} {adjective}"
    if form == 4:
        return f"was not {adjective} at all"
    return f"is not {adjective}"


def _sentiment_core(rng: random.Random, subject: str, positive: bool, negated: bool) -> str:
    """Return an opinion clause whose literal polarity is `positive`, optionally negated."""
    kind = rng.random()
    if kind < 0.55:
        return f"{subject} {_adjective_phrase(rng, positive, negated)}"
    if kind < 0.8:
        past, bare = rng.choice(POSITIVE_VERBS if positive else NEGATIVE_VERBS)
        who = rng.choice(("I", "we", "my wife", "my kids", "my friends"))
        if not negated:
            return f"{who} {rng.choice(('', 'really ', 'truly ', ''))}{past} {subject}"
        aux = rng.choice(("did not", "didn't", "never"))
        verb = past if aux == "never" else bare
        return f"{who} {aux} {verb} {subject}"
    past, bare = rng.choice(POSITIVE_SUBJECT_VERBS if positive else NEGATIVE_SUBJECT_VERBS)
    if not negated:
        return f"{subject} {rng.choice(('', 'really ', 'completely ', ''))}{past}"
    aux = rng.choice(("did not", "didn't", "never"))
    verb = past if aux == "never" else bare
    return f"{subject} {aux} {verb}"


def _sentiment_text(rng: random.Random, label_positive: bool) -> str:
    """Build one review sentence whose overall sentiment is `label_positive`."""
    negated = rng.random() < 0.3
    literal_positive = label_positive != negated
    subject = rng.choice(SUBJECTS)
    if rng.random() < 0.15:
        subject = f"{subject}, {rng.choice(SUBJECT_CLAUSES)},"
    core = _sentiment_core(rng, subject, literal_positive, negated)
    parts: list[str] = []
    if rng.random() < 0.35:
        parts.append(rng.choice(OPENERS))
    parts.append(core)
    if rng.random() < 0.25:
        parts.append(rng.choice(FILLERS))
    if rng.random() < 0.4:
        verdicts = POSITIVE_VERDICTS if label_positive else NEGATIVE_VERDICTS
        parts[-1] += ","
        parts.append(rng.choice(verdicts))
    sentence = " ".join(parts).replace(",,", ",").rstrip(",")
    sentence = sentence[0].upper() + sentence[1:] + rng.choice((".", ".", ".", "!"))
    if rng.random() < 0.15:
        extra = rng.choice(NEUTRAL_SENTENCES)
        sentence = f"{extra} {sentence}" if rng.random() < 0.5 else f"{sentence} {extra}"
    return sentence


def _unique_texts(
    rng: random.Random, label_positive: bool, count: int, seen: set[str]
) -> list[str]:
    """Draw `count` texts of one label that are not in `seen` (which is updated)."""
    texts: list[str] = []
    while len(texts) < count:
        text = _sentiment_text(rng, label_positive)
        if text in seen or not MIN_WORDS <= len(text.split()) <= MAX_WORDS:
            continue
        seen.add(text)
        texts.append(text)
    return texts


def build_sentiment(seed: int = SENTIMENT_SEED) -> tuple[list[list[str]], list[list[str]]]:
    """Return (train, eval) rows of [text, label], balanced and without shared texts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    train: list[list[str]] = []
    evaluation: list[list[str]] = []
    per_label = SENTIMENT_TRAIN_PER_LABEL + SENTIMENT_EVAL_PER_LABEL
    for label in ("positive", "negative"):
        texts = _unique_texts(rng, label == "positive", per_label, seen)
        train.extend([text, label] for text in texts[:SENTIMENT_TRAIN_PER_LABEL])
        evaluation.extend([text, label] for text in texts[SENTIMENT_TRAIN_PER_LABEL:])
    rng.shuffle(train)
    rng.shuffle(evaluation)
    return train, evaluation


# --------------------------------------------------------------------------------------------
# NLI dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Person:
    noun: str
    generic: str
    pronoun: str
    possessive: str


@dataclass(frozen=True)
class Activity:
    phrase: str
    generalisations: tuple[str, ...]
    conflicts: tuple[str, ...]
    role: str
    details: tuple[str, ...]
    places: tuple[str, ...]


@dataclass(frozen=True)
class Place:
    key: str
    phrase: str
    outdoor: bool


PEOPLE: tuple[Person, ...] = (
    Person("woman", "person", "She", "her"),
    Person("man", "person", "He", "his"),
    Person("young woman", "woman", "She", "her"),
    Person("young man", "man", "He", "his"),
    Person("old woman", "woman", "She", "her"),
    Person("old man", "man", "He", "his"),
    Person("girl", "child", "She", "her"),
    Person("boy", "child", "He", "his"),
    Person("teenage girl", "girl", "She", "her"),
    Person("teenage boy", "boy", "He", "his"),
    Person("bearded man", "man", "He", "his"),
    Person("tall woman", "woman", "She", "her"),
)

COLOURS: tuple[str, ...] = (
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "orange",
    "purple",
    "grey",
    "brown",
)
GARMENTS: tuple[str, ...] = (
    "coat",
    "hat",
    "jacket",
    "scarf",
    "sweater",
    "shirt",
    "t-shirt",
    "hoodie",
    "cap",
    "raincoat",
)
GARMENT_PREPOSITIONS: tuple[str, ...] = ("in", "wearing", "with")

PLACES: tuple[Place, ...] = (
    Place("park", "in the park", True),
    Place("beach", "on the beach", True),
    Place("street", "on a busy street", True),
    Place("garden", "in a garden", True),
    Place("forest", "in a forest", True),
    Place("market", "at an outdoor market", True),
    Place("lake", "by a lake", True),
    Place("square", "in the town square", True),
    Place("kitchen", "in a kitchen", False),
    Place("library", "in a library", False),
    Place("cafe", "in a cafe", False),
    Place("classroom", "in a classroom", False),
    Place("office", "in an office", False),
    Place("pool", "at an indoor pool", False),
    Place("living room", "in a living room", False),
    Place("garage", "in a garage", False),
    Place("studio", "in a studio", False),
)
PLACE_BY_KEY: dict[str, Place] = {place.key: place for place in PLACES}

ANYWHERE = ("park", "beach", "garden", "square", "cafe", "living room", "studio", "library")

ACTIVITIES: tuple[Activity, ...] = (
    Activity(
        "playing the guitar",
        ("making music", "playing an instrument", "playing music"),
        ("sleeping", "swimming", "driving a bus"),
        "famous musician",
        ("playing for tips", "practising for a concert", "playing a song {pos} wrote"),
        ("park", "beach", "street", "square", "cafe", "living room", "studio"),
    ),
    Activity(
        "reading a book",
        ("reading", "holding a book", "looking at a book"),
        ("running a race", "sleeping", "swimming in the sea"),
        "literature student",
        ("reading a mystery novel", "studying for an exam", "reading {pos} favourite novel"),
        ("park", "beach", "garden", "library", "cafe", "living room", "lake"),
    ),
    Activity(
        "riding a bicycle",
        ("riding a bike", "cycling", "on a bike"),
        ("sitting on a sofa", "sleeping", "swimming"),
        "professional cyclist",
        ("riding to work", "late for work", "riding home from school"),
        ("park", "street", "square", "forest", "lake"),
    ),
    Activity(
        "eating a sandwich",
        ("eating", "eating some food", "having a snack"),
        ("swimming underwater", "sleeping", "playing the trumpet"),
        "professional food critic",
        ("very hungry", "eating {pos} lunch", "eating a cheese sandwich"),
        ("park", "beach", "street", "garden", "cafe", "office", "kitchen", "square"),
    ),
    Activity(
        "painting a picture",
        ("making art", "painting", "holding a brush"),
        ("riding a horse", "sleeping", "swimming"),
        "famous painter",
        (
            "painting a portrait of {pos} mother",
            "painting for an exhibition",
            "selling {pos} paintings",
        ),
        ("park", "beach", "garden", "studio", "classroom", "lake"),
    ),
    Activity(
        "walking a dog",
        ("walking an animal", "out with a pet", "walking"),
        ("sitting on a couch", "sleeping", "driving a car"),
        "professional dog walker",
        ("walking {pos} neighbour's dog", "looking for a lost ball", "heading home"),
        ("park", "beach", "street", "forest", "lake", "square"),
    ),
    Activity(
        "jogging",
        ("running", "exercising", "moving quickly"),
        ("sitting still", "sleeping", "lying in bed"),
        "marathon runner",
        ("training for a marathon", "trying to lose weight", "running late"),
        ("park", "beach", "street", "forest", "lake"),
    ),
    Activity(
        "cooking soup",
        ("cooking", "making food", "preparing a meal"),
        ("sleeping", "swimming", "riding a bicycle"),
        "professional chef",
        ("cooking for {pos} family", "following a recipe", "making soup for a party"),
        ("kitchen",),
    ),
    Activity(
        "taking a photo",
        ("using a camera", "taking a picture", "photographing something"),
        ("sleeping", "swimming underwater", "washing dishes"),
        "professional photographer",
        ("taking a photo of a bird", "on a photography course", "taking photos for a magazine"),
        ("park", "beach", "street", "garden", "forest", "market", "square", "lake"),
    ),
    Activity(
        "playing soccer",
        ("playing a sport", "playing with a ball", "kicking a ball"),
        ("sleeping", "sitting at a desk", "reading in bed"),
        "professional athlete",
        ("playing in a tournament", "playing with {pos} cousins", "trying out for a team"),
        ("park", "beach", "street", "square"),
    ),
    Activity(
        "typing on a laptop",
        ("using a computer", "typing", "working on a laptop"),
        ("swimming", "sleeping", "riding a horse"),
        "software engineer",
        ("writing an email", "finishing a report", "writing a novel"),
        ("library", "cafe", "office", "classroom", "living room"),
    ),
    Activity(
        "singing a song",
        ("singing", "making music", "using {pos} voice"),
        ("sleeping", "swimming underwater", "eating soup"),
        "famous singer",
        ("singing for a talent show", "singing a song {pos} wrote", "singing for tips"),
        ("park", "street", "square", "studio", "living room", "beach"),
    ),
    Activity(
        "swimming",
        ("in the water", "swimming", "getting wet"),
        ("riding a bicycle", "sleeping in bed", "reading a newspaper"),
        "olympic swimmer",
        ("training for a race", "swimming laps", "learning to swim"),
        ("lake", "beach", "pool"),
    ),
    Activity(
        "climbing a tree",
        ("climbing", "climbing something", "in a tree"),
        ("sitting on a bench", "sleeping", "swimming"),
        "professional climber",
        ("trying to rescue a cat", "climbing to pick apples", "showing off to friends"),
        ("park", "garden", "forest"),
    ),
    Activity(
        "selling vegetables",
        ("selling food", "working", "selling something"),
        ("sleeping", "swimming", "flying a plane"),
        "farmer",
        ("selling vegetables from {pos} farm", "about to close the stall", "selling carrots"),
        ("market", "street", "square"),
    ),
    Activity(
        "drinking coffee",
        ("drinking", "having a drink", "holding a cup"),
        ("sleeping", "swimming", "playing the trumpet"),
        "barista",
        ("waiting for a friend", "drinking {pos} third coffee", "taking a break from work"),
        ("cafe", "office", "kitchen", "park", "square", "living room"),
    ),
    Activity(
        "dancing",
        ("dancing", "moving around", "moving"),
        ("sitting still", "sleeping", "lying on a sofa"),
        "professional dancer",
        ("practising for a show", "dancing at a wedding", "dancing to {pos} favourite song"),
        ("park", "beach", "square", "studio", "living room", "street"),
    ),
    Activity(
        "fixing a car",
        ("repairing a vehicle", "working on a car", "fixing something"),
        ("sleeping", "swimming", "playing the piano"),
        "mechanic",
        ("fixing {pos} own car", "changing a tyre", "repairing the engine"),
        ("garage", "street"),
    ),
    Activity(
        "writing a letter",
        ("writing", "holding a pen", "writing something"),
        ("swimming", "sleeping", "riding a bicycle"),
        "famous author",
        ("writing to an old friend", "writing a love letter", "writing to {pos} grandmother"),
        ("cafe", "library", "office", "classroom", "living room", "park", "garden"),
    ),
    Activity(
        "feeding pigeons",
        ("feeding birds", "feeding animals", "near some birds"),
        ("sleeping", "swimming", "driving a truck"),
        "bird expert",
        ("feeding the pigeons with bread", "retired", "there every morning"),
        ("park", "square", "street"),
    ),
    Activity(
        "watering plants",
        ("gardening", "watering something", "taking care of plants"),
        ("sleeping", "swimming", "driving a car"),
        "professional gardener",
        ("watering {pos} tomatoes", "growing vegetables", "looking after a neighbour's garden"),
        ("garden", "living room", "office"),
    ),
    Activity(
        "teaching a class",
        ("teaching", "talking to students", "working"),
        ("sleeping", "swimming", "riding a horse"),
        "maths teacher",
        ("teaching history", "giving an exam", "teaching {pos} last class of the day"),
        ("classroom", "library", "park", "studio"),
    ),
)

EMOTIONS: tuple[str, ...] = (
    "happy",
    "tired",
    "bored",
    "nervous",
    "in a hurry",
    "excited",
    "sad",
    "proud",
)
RELATIVES: tuple[str, ...] = (
    "brother",
    "sister",
    "best friend",
    "grandmother",
    "cousin",
    "father",
    "mother",
    "neighbour",
)
HABITS: tuple[str, ...] = (
    "every weekend",
    "for the first time",
    "before work",
    "to relax",
    "every morning",
    "after school",
    "to pass the time",
)
COMPANIONS: tuple[str, ...] = ("old", "new", "close", "school")
AGES: tuple[str, ...] = ("nineteen", "twenty-five", "thirty", "forty", "fifty-two", "seventy")


def _premise(rng: random.Random) -> tuple[str, Person, str, str, Activity, Place]:
    """Return (premise, person, colour, garment, activity, place)."""
    person = rng.choice(PEOPLE)
    colour = rng.choice(COLOURS)
    garment = rng.choice(GARMENTS)
    activity = rng.choice(ACTIVITIES)
    place = PLACE_BY_KEY[rng.choice(activity.places)]
    preposition = rng.choice(GARMENT_PREPOSITIONS)
    premise = (
        f"{_article(person.noun).capitalize()} {person.noun} {preposition} {_article(colour)} "
        f"{colour} {garment} is {activity.phrase} {place.phrase}."
    )
    return premise, person, colour, garment, activity, place


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _fill(template: str, person: Person) -> str:
    return template.replace("{pos}", person.possessive)


def _entailment(
    rng: random.Random,
    person: Person,
    colour: str,
    garment: str,
    activity: Activity,
    place: Place,
) -> str:
    general = _fill(rng.choice(activity.generalisations), person)
    where = "outside" if place.outdoor else "inside"
    someone = rng.choice((f"A {person.generic}", "Someone", "A person", f"The {person.noun}"))
    form = rng.randrange(9)
    if form == 0:
        return f"{someone} is {general}."
    if form == 1:
        return f"{someone} is {general} {where}."
    if form == 2:
        return (
            f"{someone} is {rng.choice(('outdoors', 'outside'))}."
            if place.outdoor
            else (f"{someone} is {rng.choice(('indoors', 'inside a building'))}.")
        )
    if form == 3:
        worn = rng.choice((garment, f"{colour} {garment}"))
        return f"{someone} is wearing {_article(worn)} {worn}."
    if form == 4:
        return f"There is a {person.generic} {place.phrase}."
    if form == 5:
        return f"{someone} wearing {colour} is {general}."
    if form == 6:
        return f"{someone} {place.phrase} is {general}."
    if form == 7:
        return f"The {person.noun} is {place.phrase}."
    return f"The {person.noun} is {activity.phrase}."


def _contradiction(
    rng: random.Random,
    person: Person,
    colour: str,
    garment: str,
    activity: Activity,
    place: Place,
) -> str:
    general = _fill(rng.choice(activity.generalisations), person)
    the = f"The {person.noun}"
    others = [p for p in PLACES if p.outdoor != place.outdoor]
    form = rng.randrange(8)
    if form == 0:
        return f"{the} is {rng.choice(activity.conflicts)}."
    if form == 1:
        return f"{rng.choice(('Nobody', 'No one'))} is {general}."
    if form == 2:
        return f"{the} is sleeping {rng.choice(('at home', 'in bed at home'))}."
    if form == 3:
        if place.outdoor:
            return f"{the} is {rng.choice(('indoors', 'inside a building'))}."
        return f"{the} is {rng.choice(('outdoors', 'outside'))}."
    if form == 4:
        return f"{the} is {activity.phrase} {rng.choice(others).phrase}."
    if form == 5:
        return f"{rng.choice(('Nobody', 'No one'))} is {place.phrase}."
    if form == 6:
        return f"{the} is {rng.choice(others).phrase}."
    return f"{the} is not wearing {_article(garment)} {garment}."


def _neutral(
    rng: random.Random,
    person: Person,
    colour: str,
    garment: str,
    activity: Activity,
    place: Place,
) -> str:
    the = f"The {person.noun}"
    form = rng.randrange(10)
    if form == 0:
        return f"{the} is a {activity.role}."
    if form == 1:
        return f"{person.pronoun} is waiting for a friend."
    if form == 2:
        return f"{person.pronoun} is {_fill(rng.choice(activity.details), person)}."
    if form == 3:
        return f"{the} is {rng.choice(EMOTIONS)}."
    if form == 4:
        return f"{the} is {activity.phrase} with {person.possessive} {rng.choice(RELATIVES)}."
    if form == 5:
        return f"{the} is {rng.choice(AGES)} years old."
    if form == 6:
        return (
            f"{person.possessive.capitalize()} {garment} was a gift from {person.possessive} "
            f"{rng.choice(RELATIVES)}."
        )
    if form == 7:
        return f"{the} is {activity.phrase} {place.phrase} {rng.choice(HABITS)}."
    if form == 8:
        companion = rng.choice(COMPANIONS)
        return f"{the} is {place.phrase} with {_article(companion)} {companion} friend."
    return f"{the} is {rng.choice(('on vacation', 'new in town', 'skipping work'))}."


def build_nli(seed: int = NLI_SEED) -> tuple[list[list[str]], list[list[str]]]:
    """Return (train, eval) rows of [premise, hypothesis, label]; splits share no premise."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: list[list[list[str]]] = []
    for n_premises in (NLI_TRAIN_PREMISES, NLI_EVAL_PREMISES):
        rows: list[list[str]] = []
        while len(rows) < 3 * n_premises:
            premise, *facts = _premise(rng)
            if premise in seen:
                continue
            seen.add(premise)
            rows.append([premise, _entailment(rng, *facts), "entailment"])
            rows.append([premise, _neutral(rng, *facts), "neutral"])
            rows.append([premise, _contradiction(rng, *facts), "contradiction"])
        rng.shuffle(rows)
        splits.append(rows)
    return splits[0], splits[1]


# --------------------------------------------------------------------------------------------
# NER dataset (token classification)
# --------------------------------------------------------------------------------------------

NER_SEED = 20240503
NER_TRAIN_ROWS = 2000
NER_EVAL_ROWS = 400
NER_EVAL_ONLY_EVERY = 5  # every 5th name of each list appears only in eval: tagged by context

FIRST_NAMES: tuple[str, ...] = (
    "Maria", "James", "Aisha", "Kenji", "Olga", "Pedro", "Fatima", "Liam", "Chen", "Amara",
    "Lars", "Priya", "Tom", "Nadia", "Omar", "Elena", "Ravi", "Sofia", "Hugo", "Ingrid",
    "Kwame", "Yuki", "Diego", "Leila", "Anna", "Felix", "Zara", "Mateo", "Ines", "Samuel",
)  # a table of names  # fmt: skip
# First names that are also places (NER_PLACE_NAMES): only the context says which is meant.
FIRST_NAMES_OF_PLACES: tuple[str, ...] = (
    "Jordan", "Florence", "Georgia", "Austin", "Victoria", "Sydney", "Charlotte", "Chelsea",
    "Paris", "Madison", "Adelaide", "Savannah",
)  # a table of names  # fmt: skip
LAST_NAMES: tuple[str, ...] = (
    "Smith", "Garcia", "Okafor", "Tanaka", "Ivanova", "Silva", "Haddad", "Murphy", "Wang",
    "Mensah", "Nilsson", "Sharma", "Rossi", "Novak", "Kowalski", "Dubois", "Petrov", "Nguyen",
    "Hansen", "Moreau", "Costa", "Adeyemi", "Fischer", "Lopez", "Kim",
    # also places or companies
    "Washington", "Lincoln", "Houston", "London", "Berlin", "Jackson", "Florence",
)  # a table of names  # fmt: skip
NER_PLACE_NAMES: tuple[str, ...] = (
    "Lagos", "Lima", "Tokyo", "Oslo", "Cairo", "Nairobi", "Madrid", "Toronto", "Mumbai",
    "Hanoi", "Berlin", "London", "Quito", "Dakar", "Vienna", "Seoul", "Lisbon", "Dublin",
    "New York", "Buenos Aires", "Cape Town", "Hong Kong", "Rio de Janeiro", "San Francisco",
    "Kuala Lumpur", "Sri Lanka", "New Zealand",
    # also first names, last names or part of a company's name
    "Jordan", "Florence", "Georgia", "Austin", "Victoria", "Sydney", "Charlotte", "Paris",
    "Washington", "Lincoln", "Houston", "Madison", "Adelaide", "Savannah", "Amazon",
)  # a table of names  # fmt: skip
ORGANISATIONS: tuple[str, ...] = (
    "Northwind Traders", "Acme Corporation", "Blue River Bank", "Global Health Fund",
    "Orion Systems", "Redwood Analytics", "Summit Bank", "Greenleaf Foods", "Helix Pharma",
    "Atlas Logistics", "Red Cross", "Union Rail", "Polar Air", "Nova Media Group",
    # with a place or a person's name inside: the whole span is the organisation
    "University of Lagos", "Bank of Jordan", "Lincoln Labs", "Houston Dynamics",
    "Victoria Textiles", "Sydney Harbour Trust", "Florence Capital", "Amazon",
    "Jackson and Okafor", "Smith Brothers", "Tokyo Electric", "Paris Opera",
)  # a table of names  # fmt: skip

# Templates: {PER}, {LOC} and {ORG} are entities; the other words are tagged O.
NER_TEMPLATES: tuple[str, ...] = (
    "{PER} flew from {LOC} to {LOC} last week .",
    "{PER} works for {ORG} .",
    "{ORG} opened a new office in {LOC} .",
    "{PER} , the new head of {ORG} , lives in {LOC} .",
    "yesterday {PER} met {PER} in {LOC} .",
    "talks between {ORG} and {ORG} ended without a deal .",
    "{LOC} is famous for its old harbour .",
    "according to {PER} , prices in {LOC} will rise .",
    "shares of {ORG} fell sharply after the report .",
    "{PER} studied at {ORG} before moving to {LOC} .",
    "we spent the summer in {LOC} with {PER} .",
    "{PER} said that {ORG} will hire more staff in {LOC} .",
    "the weather in {LOC} was warm and sunny .",
    "a spokesperson for {ORG} declined to comment .",
    "{PER} thanked {PER} for the invitation .",
    "the road from {LOC} to {LOC} was closed for repairs .",
    "{ORG} hired {PER} as its chief engineer .",
    "in {LOC} , {PER} opened a small bakery .",
    "the flight to {LOC} was delayed by two hours .",
    "{PER} and {PER} founded {ORG} in {LOC} .",
    "visitors to {LOC} often ask {PER} for directions .",
    "{ORG} bought a warehouse near {LOC} .",
    "the meeting was moved to next monday .",
    "prices rose again this month .",
    "she said the results were better than expected .",
    "our team will visit the new factory soon .",
)


def _ner_people(rng: random.Random, firsts: Sequence[str], lasts: Sequence[str]) -> list[str]:
    """A person's name as words: first and last name, or one of them alone."""
    form = rng.randrange(4)
    if form == 0:
        return [rng.choice(firsts)]
    if form == 1:
        return [rng.choice(lasts)]
    return [rng.choice(firsts), rng.choice(lasts)]


def _ner_sentence(
    rng: random.Random, names: dict[str, Sequence[str]]
) -> tuple[list[str], list[str]]:
    """One templated sentence: its words and their BIO tags."""
    words: list[str] = []
    tags: list[str] = []
    for piece in rng.choice(NER_TEMPLATES).split():
        if piece in ("{PER}", "{LOC}", "{ORG}"):
            kind = piece[1:-1]
            if kind == "PER":
                entity = _ner_people(rng, names["first"], names["last"])
            else:
                entity = rng.choice(names[kind]).split()
            words.extend(entity)
            tags.extend([f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1))
        else:
            words.append(piece)
            tags.append("O")
    words[0] = words[0][0].upper() + words[0][1:]
    return words, tags


def _ner_names(eval_split: bool) -> dict[str, Sequence[str]]:
    """The names a split draws from: eval has all, train all but every NER_EVAL_ONLY_EVERY-th."""

    def kept(names: Sequence[str]) -> Sequence[str]:
        if eval_split:
            return names
        return [name for i, name in enumerate(names) if i % NER_EVAL_ONLY_EVERY != 0]

    return {
        "first": kept(FIRST_NAMES + FIRST_NAMES_OF_PLACES),
        "last": kept(LAST_NAMES),
        "LOC": kept(NER_PLACE_NAMES),
        "ORG": kept(ORGANISATIONS),
    }


NerRow = dict[str, list[str]]  # {"tokens": words, "tags": their BIO tags}


def build_ner(seed: int = NER_SEED) -> tuple[list[NerRow], list[NerRow]]:
    """Return (train, eval) rows of {"tokens": words, "tags": BIO tags}; no shared sentence."""
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    splits: list[list[NerRow]] = []
    for rows_wanted, eval_split in ((NER_TRAIN_ROWS, False), (NER_EVAL_ROWS, True)):
        names = _ner_names(eval_split)
        rows: list[NerRow] = []
        while len(rows) < rows_wanted:
            words, tags = _ner_sentence(rng, names)
            if tuple(words) in seen:
                continue
            seen.add(tuple(words))
            rows.append({"tokens": words, "tags": tags})
        splits.append(rows)
    return splits[0], splits[1]


# --------------------------------------------------------------------------------------------
# Instruction dataset (causal_lm): a prompt, and a completion that follows a rule
# --------------------------------------------------------------------------------------------

INSTRUCT_SEED = 20240525
INSTRUCT_TRAIN_ROWS = 2000
INSTRUCT_EVAL_ROWS = 200
INSTRUCT_WORDS: tuple[str, ...] = (
    "cat", "dog", "fish", "bird", "tree", "house", "car", "book", "lamp", "door", "river",
    "stone", "apple", "bread", "milk", "chair", "table", "clock", "shoe", "hat", "ship", "moon",
    "star", "rain",
)  # a table of names  # fmt: skip
OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("left", "right"),
    ("open", "closed"), ("early", "late"), ("light", "dark"), ("happy", "sad"), ("old", "new"),
    ("full", "empty"), ("rich", "poor"), ("hard", "soft"), ("wet", "dry"), ("loud", "quiet"),
    ("high", "low"),
)  # a table of names  # fmt: skip


def _word_list_instruction(rng: random.Random) -> tuple[str, str]:
    """reverse / first word / last word / count of a list of 2 to 5 words."""
    words = rng.sample(INSTRUCT_WORDS, rng.randint(2, 5))
    listed = " ".join(words)
    kind = rng.choice(("reverse", "reverse", "first", "last", "count"))
    if kind == "reverse":
        return f"reverse: {listed}", " ".join(reversed(words))
    if kind == "count":
        return f"count the words: {listed}", str(len(words))
    return f"{kind} word: {listed}", words[0] if kind == "first" else words[-1]


def _fact_instruction(rng: random.Random) -> tuple[str, str]:
    """A lookup the model must memorise: the sum of two digits, or a word's opposite."""
    if rng.random() < 0.5:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"add {a} and {b}", str(a + b)
    word, opposite = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        word, opposite = opposite, word
    return f"opposite of {word}", opposite


def build_instruct(seed: int = INSTRUCT_SEED) -> tuple[list[list[str]], list[list[str]]]:
    """Return (train, eval) rows of [prompt, completion, text]; `text` is the row as one plain
    text ("prompt -> completion"). Two rows in three operate on a word list (no list prompt is
    in both splits); one in three asks a fact from a fixed table (seen in training)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: list[list[list[str]]] = []
    for size in (INSTRUCT_TRAIN_ROWS, INSTRUCT_EVAL_ROWS):
        rows: list[list[str]] = []
        while len(rows) < size:
            if rng.random() < 2 / 3:
                prompt, completion = _word_list_instruction(rng)
                if prompt in seen:
                    continue
                seen.add(prompt)
            else:
                prompt, completion = _fact_instruction(rng)
            rows.append([prompt, completion, f"{prompt} -> {completion}"])
        splits.append(rows)
    return splits[0], splits[1]


# --------------------------------------------------------------------------------------------
# Regression dataset: a review's score, 1 to 5, that follows what it says of each aspect
# --------------------------------------------------------------------------------------------

REGRESSION_SEED = 20240503
REGRESSION_TRAIN_ROWS = 2000
REGRESSION_EVAL_ROWS = 400
REGRESSION_NOISE = 0.25  # standard deviation of the score around what the words say

ASPECTS: tuple[str, ...] = (
    "the food",
    "the service",
    "the room",
    "the staff",
    "the location",
    "the breakfast",
    "the price",
    "the view",
    "the bed",
    "the wifi",
    "the coffee",
    "the music",
)
# Quality words by how good they say an aspect is, -2 (worst) to +2 (best).
QUALITIES: dict[int, tuple[str, ...]] = {
    -2: ("awful", "terrible", "dreadful", "horrible"),
    -1: ("poor", "mediocre", "disappointing", "bland"),
    0: ("okay", "average", "acceptable", "ordinary"),
    1: ("good", "nice", "pleasant", "decent"),
    2: ("excellent", "superb", "outstanding", "perfect"),
}
# Degree words and how much they scale the quality word's value.
DEGREES: tuple[tuple[str, float], ...] = (
    ("", 1.0),
    ("", 1.0),
    ("really ", 1.5),
    ("very ", 1.5),
    ("a bit ", 0.5),
    ("slightly ", 0.5),
)
REVIEW_OPENERS: tuple[str, ...] = (
    "We stayed three nights.",
    "I came here for a business trip.",
    "Booked it for our anniversary.",
    "Second visit this year.",
    "Stopped by on a Sunday.",
    "A friend recommended it.",
)
ASPECT_JOINERS: tuple[str, ...] = (", and ", ", but ", "; ", ", while ")


def _aspect_clause(rng: random.Random, aspect: str) -> tuple[str, float]:
    """One clause on one aspect ('the food was really good') and the value it says, -3 to 3."""
    quality = rng.choice(tuple(QUALITIES))
    word = rng.choice(QUALITIES[quality])
    degree, scale = rng.choice(DEGREES) if quality else ("", 1.0)
    verb = rng.choice(("was", "was", "felt", "seemed"))
    if quality and rng.random() < 0.2:  # "not good" is mildly bad; "not awful" mildly good
        return f"{aspect} {verb} not {word}", -0.5 * quality
    return f"{aspect} {verb} {degree}{word}", quality * scale


def _review(rng: random.Random) -> tuple[str, float]:
    """A review of one to three aspects and its score: 3 plus the mean of what the aspect
    clauses say, with noise, within 1 to 5, to one decimal."""
    aspects = rng.sample(ASPECTS, rng.choice((1, 2, 2, 3)))
    clauses, values = zip(*(_aspect_clause(rng, aspect) for aspect in aspects), strict=True)
    text = clauses[0]
    for clause in clauses[1:]:
        text += rng.choice(ASPECT_JOINERS) + clause
    text = text[0].upper() + text[1:] + "."
    if rng.random() < 0.3:
        text = f"{rng.choice(REVIEW_OPENERS)} {text}"
    score = 3 + sum(values) / len(values) + rng.gauss(0, REGRESSION_NOISE)
    return text, min(5.0, max(1.0, round(score, 1)))


def build_regression(seed: int = REGRESSION_SEED) -> tuple[list[list[str]], list[list[str]]]:
    """Return (train, eval) rows of [text, score]; no text in both."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[list[str]] = []
    while len(rows) < REGRESSION_TRAIN_ROWS + REGRESSION_EVAL_ROWS:
        text, score = _review(rng)
        if text not in seen:
            seen.add(text)
            rows.append([text, f"{score:.1f}"])
    return rows[:REGRESSION_TRAIN_ROWS], rows[REGRESSION_TRAIN_ROWS:]


# --------------------------------------------------------------------------------------------
# Multi-label dataset: the topics of a news article, which co-occur
# --------------------------------------------------------------------------------------------

MULTILABEL_SEED = 20240504
MULTILABEL_TRAIN_ROWS = 2000
MULTILABEL_EVAL_ROWS = 400
NO_TOPIC_SHARE = 0.05  # articles about none of the topics: their list of labels is empty

# Sentences that are about each topic; {place} and {when} are filled in.
TOPIC_SENTENCES: dict[str, tuple[str, ...]] = {
    "politics": (
        "The parliament voted on the new election law {when}.",
        "The minister resigned after a heated debate in {place}.",
        "Opposition parties called for a vote of no confidence.",
        "The mayor of {place} announced a campaign for a second term.",
        "Senators argued over the reform until late at night.",
    ),
    "economy": (
        "Inflation in {place} rose faster than analysts had expected.",
        "The central bank kept interest rates unchanged {when}.",
        "Shares of the largest retailer fell after weak quarterly profits.",
        "Unemployment dropped to its lowest level in a decade.",
        "Exporters warned that the strong currency would hurt sales.",
    ),
    "sports": (
        "The home team won the final with a goal in extra time.",
        "The coach praised the defence after a narrow victory {when}.",
        "A young striker from {place} signed a three-year contract.",
        "The marathon drew thousands of runners through {place}.",
        "The champion lost in straight sets in the semi-final.",
    ),
    "health": (
        "Hospitals in {place} reported a rise in flu patients {when}.",
        "Doctors recommend a second dose of the vaccine for older patients.",
        "The clinic cut waiting times for surgery by half.",
        "Nurses warned that the wards were short of staff.",
        "A new treatment lowered blood pressure in most patients.",
    ),
    "technology": (
        "The company unveiled a faster smartphone chip {when}.",
        "A software update fixed a security flaw in millions of laptops.",
        "Start-ups in {place} raised record sums for their apps.",
        "The new network promises faster internet in rural areas.",
        "Engineers built a robot that sorts parcels in a warehouse.",
    ),
    "science": (
        "Astronomers observed a distant galaxy with the new telescope.",
        "Researchers in {place} published a study on ancient genomes.",
        "Physicists measured the particle's mass more precisely than before.",
        "The laboratory confirmed the results of the experiment {when}.",
        "A team of biologists described a new species of frog.",
    ),
    "environment": (
        "Floods forced hundreds of families in {place} from their homes.",
        "The city planted ten thousand trees to cool its streets.",
        "Air pollution reached dangerous levels {when}.",
        "Farmers struggled with the longest drought on record.",
        "Volunteers cleared plastic waste from the beaches near {place}.",
    ),
    "culture": (
        "The museum in {place} opened an exhibition of early photographs.",
        "Critics praised the novel that won the literary prize {when}.",
        "The orchestra played to a full concert hall.",
        "A film about a family of bakers topped the box office.",
        "The festival brought painters and poets to {place}.",
    ),
}
# How likely a second topic is, given the first: the topics that news stories share.
TOPIC_AFFINITY: dict[str, dict[str, float]] = {
    "politics": {"economy": 0.35, "environment": 0.15, "health": 0.1},
    "economy": {"politics": 0.3, "technology": 0.2},
    "sports": {"health": 0.15, "economy": 0.1, "culture": 0.1},
    "health": {"science": 0.35, "politics": 0.15},
    "technology": {"science": 0.3, "economy": 0.3},
    "science": {"technology": 0.3, "health": 0.2, "environment": 0.2},
    "environment": {"science": 0.3, "politics": 0.3},
    "culture": {"economy": 0.1, "politics": 0.1},
}
NEWS_PLACES: tuple[str, ...] = (
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Osaka",
    "Leeds",
    "Tartu",
    "Perth",
)
NEWS_WHENS: tuple[str, ...] = ("on Monday", "last week", "this morning", "in March", "overnight")
# Sentences about none of the topics, some with a word one of them uses ("market", "stadium").
PLAIN_SENTENCES: tuple[str, ...] = (
    "The reporter walked past the stadium on her way to the office.",
    "Readers can send their letters to the editor by post.",
    "The weekly farmers' market will open an hour later.",
    "A cat was rescued from a tree by a neighbour.",
    "Roadworks will close the bridge for two nights.",
    "The bakery on the corner celebrated its fiftieth year.",
    "Trains will run on a holiday timetable.",
    "A lost wallet was handed in at the library.",
)


def _topics(rng: random.Random) -> list[str]:
    """The topics of one article: none (rarely), one, or one and the topics it draws in."""
    if rng.random() < NO_TOPIC_SHARE:
        return []
    first = rng.choice(tuple(TOPIC_SENTENCES))
    topics = [first]
    for other, chance in TOPIC_AFFINITY[first].items():
        if rng.random() < chance:
            topics.append(other)
    return topics


def _topic_article(rng: random.Random, topics: list[str]) -> str:
    """One or two sentences on each topic and up to two plain ones, in a random order."""
    sentences = [
        sentence.format(place=rng.choice(NEWS_PLACES), when=rng.choice(NEWS_WHENS))
        for topic in topics
        for sentence in rng.sample(TOPIC_SENTENCES[topic], rng.choice((1, 1, 2)))
    ]
    sentences += rng.sample(PLAIN_SENTENCES, rng.choice((0, 1, 1, 2) if topics else (1, 2, 3)))
    rng.shuffle(sentences)
    return " ".join(sentences)


def build_multilabel(seed: int = MULTILABEL_SEED) -> tuple[list[dict], list[dict]]:
    """Return (train, eval) rows of {"text", "topics"} (topics sorted); no text in both."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < MULTILABEL_TRAIN_ROWS + MULTILABEL_EVAL_ROWS:
        topics = _topics(rng)
        text = _topic_article(rng, topics)
        if text not in seen:
            seen.add(text)
            rows.append({"text": text, "topics": sorted(topics)})
    return rows[:MULTILABEL_TRAIN_ROWS], rows[MULTILABEL_TRAIN_ROWS:]


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Write `rows` under `header` to `path` as UTF-8 CSV with LF line endings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write `rows` to `path` as JSON Lines (UTF-8, one object per line, LF line endings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    sentiment_train, sentiment_eval = build_sentiment()
    write_csv(DATA_DIR / "demo" / "train.csv", ("text", "label"), sentiment_train)
    write_csv(DATA_DIR / "demo" / "eval.csv", ("text", "label"), sentiment_eval)
    nli_train, nli_eval = build_nli()
    write_csv(DATA_DIR / "nli" / "train.csv", ("premise", "hypothesis", "label"), nli_train)
    write_csv(DATA_DIR / "nli" / "eval.csv", ("premise", "hypothesis", "label"), nli_eval)
    instruct_train, instruct_eval = build_instruct()
    write_csv(DATA_DIR / "instruct" / "train.csv", ("prompt", "completion", "text"), instruct_train)
    write_csv(DATA_DIR / "instruct" / "eval.csv", ("prompt", "completion", "text"), instruct_eval)
    for name, rows in (
        ("demo/train.csv", sentiment_train),
        ("demo/eval.csv", sentiment_eval),
        ("nli/train.csv", nli_train),
        ("nli/eval.csv", nli_eval),
        ("instruct/train.csv", instruct_train),
        ("instruct/eval.csv", instruct_eval),
    ):
        print(f"wrote {DATA_DIR / name} ({len(rows)} rows)")
    ner_train, ner_eval = build_ner()
    for name, ner_rows in (("ner/train.jsonl", ner_train), ("ner/eval.jsonl", ner_eval)):
        write_jsonl(DATA_DIR / name, ner_rows)
        print(f"wrote {DATA_DIR / name} ({len(ner_rows)} rows)")

    regression_train, regression_eval = build_regression()
    for name, rows in (("train.csv", regression_train), ("eval.csv", regression_eval)):
        write_csv(DATA_DIR / "regression" / name, ("text", "score"), rows)
        print(f"wrote {DATA_DIR / 'regression' / name} ({len(rows)} rows)")
    multilabel_train, multilabel_eval = build_multilabel()
    for name, topic_rows in (("train.jsonl", multilabel_train), ("eval.jsonl", multilabel_eval)):
        write_jsonl(DATA_DIR / "multilabel" / name, topic_rows)
        print(f"wrote {DATA_DIR / 'multilabel' / name} ({len(topic_rows)} rows)")


if __name__ == "__main__":
    main()
