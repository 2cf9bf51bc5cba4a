"""The text every lecture can use without a network.

Three sources, all documented in ``data/README.md``:

(a) :func:`iter_stories` / :func:`generate_stories` / :func:`write_stories`: a deterministic,
    seedable generator of simple English children's stories, of any size. Documents are
    separated by ``<|endoftext|>``. The same seed gives the same text on every machine (it uses
    only :class:`random.Random`, whose sequence is stable across Python versions).
(b) :func:`pydoc_text`: the English documentation that ships with CPython (``pydoc_data``), real
    technical prose of about 0.5 MB.
(c) :func:`read_text_files`: text files the user names (TinyStories, OpenWebText, ...).

:func:`write_stdlib_source` concatenates the CPython standard library's ``.py`` files: a large,
real, mixed text (code, comments, docstrings) present on every machine, used by benchmarks.
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EOT = "<|endoftext|>"

# The story generator's names, colours and places are public: generated tasks draw their distractors
# from them (lmfs.eval.tasks, lmfs.alignment.tasks).
NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Ella", "Jack",
          "Nora", "Finn", "Ruby", "Omar", "Ava", "Theo", "Ivy", "Kai"]
_ANIMALS = ["cat", "dog", "rabbit", "bird", "fox", "bear", "duck", "frog", "mouse", "owl",
            "turtle", "squirrel", "horse", "puppy", "kitten"]
_ADJ = ["little", "big", "happy", "shy", "brave", "curious", "sleepy", "kind", "silly", "tiny",
        "old", "clever", "gentle", "loud", "quiet"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "white", "gold"]
PLACES = ["the park", "the forest", "the garden", "the beach", "the farm", "the school",
           "the river", "the hill", "the market", "the library", "the kitchen", "the playground"]
_OBJECTS = ["ball", "kite", "hat", "book", "box", "cake", "boat", "drum", "flower", "key",
            "map", "shell", "balloon", "cup", "blanket", "toy car", "crayon", "stone"]
_FEELINGS = ["happy", "sad", "scared", "excited", "proud", "surprised", "worried", "calm", "angry",
             "glad"]
_WEATHER = ["sunny", "rainy", "windy", "snowy", "cloudy", "warm", "cold"]
_TIMES = ["One day", "Once upon a time", "One morning", "Last summer", "On a {w} afternoon",
          "Long ago", "Every morning"]
_PROBLEMS = [
    "{n} lost the {o} near {p}.",
    "The {o} fell into the water and {n} could not reach it.",
    "A strong wind took the {o} high into a tree.",
    "{f} broke the {o} by accident.",
    "{n} wanted to share the {o}, but {f} said no.",
    "The {a} was stuck and could not get out.",
    "{n} could not find the way home from {p}.",
]
_TRIES = [
    "{n} tried to jump, but it was too high.",
    "{n} asked the {adj} {a} for help.",
    "{f} thought hard and had an idea.",
    "They looked under every bush and behind every rock.",
    "{n} counted to {k} and tried again.",
    "They called their mom, and she came to help.",
    "{n} found a long stick and reached out with it.",
]
_ENDS = [
    "At last they found the {o}, and everyone smiled.",
    "In the end, {n} and {f} became best friends.",
    "The {a} said thank you and ran back to its family.",
    "They went home together and had {c} cake for dinner.",
    "{n} felt {feel} and gave {f} a big hug.",
    "From that day on, they always played together at {p}.",
]
_MORALS = [
    "{n} learned that sharing makes everyone happy.",
    "It is good to ask for help when you need it.",
    "Being kind is the best thing you can do.",
    "Even small friends can do big things.",
    "Never give up, even when things are hard.",
    "",
]
_DIALOGUE = [
    '"{q}" asked {n}.',
    '"I can help you!" said {f}.',
    '"Look at my {c} {o}!" said {n}.',
    '"Thank you, {f}," said {n} with a smile.',
    '"Do not be {feel}," said {f}. "We will find a way."',
]
_QUESTIONS = ["Where are you going?", "Can I play too?", "What is that?", "Will you be my friend?",
              "Why are you {feel}?", "How many {os} do you have?"]


def with_article(word: str) -> str:
    """The indefinite article that goes before ``word``."""
    return ("an " if word[0] in "aeiou" else "a ") + word


# Every story's first two sentences state where its child went and what toy and friend it had, in
# these words (see _story): (name, place) and (name, colour, object, friend).
PLACE_SENTENCE = re.compile(r"named (\w+) went to (the [a-z ]+?)\.")
TOY_SENTENCE = re.compile(r"(\w+) had an? (\w+) ([a-z ]+?) and a friend named (\w+)\.")


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _story(rng: random.Random) -> str:
    """One story: opening, a problem, a few tries with some dialogue, an ending and maybe a moral."""
    pick = rng.choice
    n, f = rng.sample(NAMES, 2)
    slots = dict(n=n, f=f, a=pick(_ANIMALS), adj=pick(_ADJ), c=pick(COLORS), p=pick(PLACES),
                 o=pick(_OBJECTS), feel=pick(_FEELINGS), w=pick(_WEATHER), k=rng.randint(2, 10))
    slots["os"] = _plural(slots["o"])
    slots["q"] = pick(_QUESTIONS).format(**slots)
    time = pick(_TIMES).format(**slots)
    sents = [
        f"{time}, {with_article(slots['adj'])} {pick(['girl', 'boy', 'child'])} named {n} went to {slots['p']}.",
        f"{n} had {with_article(slots['c'])} {slots['o']} and a friend named {f}.",
        f"The day was {slots['w']}, and {n} felt {slots['feel']}.",
    ]
    sents.append(pick(_PROBLEMS).format(**slots))
    for _ in range(rng.randint(1, 3)):
        sents.append(pick(_TRIES).format(**slots))
        if rng.random() < 0.5:
            sents.append(pick(_DIALOGUE).format(**slots))
    sents.append(pick(_ENDS).format(**slots))
    moral = pick(_MORALS).format(**slots)
    if moral:
        sents.append(moral)
    # Two or three paragraphs, like the short stories of TinyStories.
    cut = rng.randint(2, len(sents) - 2)
    return " ".join(sents[:cut]) + "\n\n" + " ".join(sents[cut:])


def iter_stories(seed: int = 0) -> Iterator[str]:
    """Yield stories forever; story ``i`` depends only on ``(seed, i)``, so any prefix is stable."""
    i = 0
    while True:
        yield _story(random.Random(f"lmfs-stories:{seed}:{i}"))
        i += 1


def generate_stories(n_bytes: int, seed: int = 0) -> str:
    """At least ``n_bytes`` of UTF-8 stories joined by ``<|endoftext|>`` (whole stories only).

    >>> text = generate_stories(2_000, seed=1)
    >>> len(text.encode()) >= 2_000 and EOT in text
    True
    """
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
    docs, total = [], 0
    for story in iter_stories(seed):
        if total >= n_bytes:
            break
        docs.append(story)
        total += len(story.encode()) + len(EOT)
    return EOT.join(docs)


def write_stories(path: str | os.PathLike, n_bytes: int, seed: int = 0) -> Path:
    """Stream at least ``n_bytes`` of stories to ``path`` (parents created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with open(path, "w", encoding="utf-8") as out:
        for i, story in enumerate(iter_stories(seed)):
            if total >= n_bytes:
                break
            piece = (EOT if i else "") + story
            out.write(piece)
            total += len(piece.encode())
    return path


def pydoc_text() -> str:
    """CPython's bundled English documentation (``pydoc_data.topics``), topics joined by EOT."""
    from pydoc_data.topics import topics

    return EOT.join(topics[key].strip() for key in sorted(topics))


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in a fixed order (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def write_stdlib_source(path: str | os.PathLike, n_bytes: int) -> Path:
    """Concatenate standard-library sources, separated by EOT, until ``n_bytes`` are written.

    When the library is smaller than ``n_bytes`` it is repeated (and the shortfall is stated in a
    warning), so a benchmark always gets the size it asked for.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = stdlib_source_files()
    if not files:
        raise FileNotFoundError("no standard-library .py files found under " + sysconfig.get_paths()["stdlib"])
    total, rounds = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while total < n_bytes:
            rounds += 1
            for f in files:
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue  # a few test files are deliberately not UTF-8
                piece = (EOT if total else "") + text
                out.write(piece)
                total += len(piece.encode())
                if total >= n_bytes:
                    break
    if rounds > 1:
        import warnings

        warnings.warn(f"the standard library holds less than {n_bytes} bytes: it was repeated {rounds} times")
    return path


def read_text_files(paths, max_bytes: int | None = None, encoding: str = "utf-8") -> str:
    """Read and join (with EOT) the text files the user names, e.g. a TinyStories download.

    ``max_bytes`` stops after about that many bytes. A missing file raises FileNotFoundError that
    points to ``data/README.md`` for where to get the corpus.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    parts, total = [], 0
    for p in paths:
        p = Path(p).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"{p} does not exist: download the corpus yourself (see data/README.md) and pass its path"
            )
        with open(p, encoding=encoding, errors="replace") as fh:
            text = fh.read() if max_bytes is None else fh.read(max(max_bytes - total, 0))
        parts.append(text)
        total += len(text.encode())
        if max_bytes is not None and total >= max_bytes:
            break
    return EOT.join(parts)


CORPORA = ("stories", "pydoc", "stdlib")


def load_corpus(name: str, n_bytes: int, seed: int = 0) -> str:
    """About ``n_bytes`` of text from a named corpus or a file path (a lecture's ``CORPUS`` parameter).

    ``"stories"``: the synthetic stories; ``"pydoc"``: CPython's documentation (all of it, about
    0.5 MB, if ``n_bytes`` asks for more); ``"stdlib"``: standard-library source; anything else is
    read as a path to a UTF-8 text file (see ``data/README.md``).
    """
    if name == "stories":
        return generate_stories(n_bytes, seed)
    if name == "pydoc":
        return _cut(pydoc_text(), n_bytes)
    if name == "stdlib":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return write_stdlib_source(Path(tmp) / "stdlib.txt", n_bytes).read_text(encoding="utf-8")
    if not Path(name).expanduser().is_file():
        raise FileNotFoundError(
            f"CORPUS={name!r} is neither one of {', '.join(CORPORA)} nor an existing text file "
            "(see data/README.md for TinyStories and OpenWebText)"
        )
    return read_text_files(name, max_bytes=n_bytes)


def _cut(text: str, n_bytes: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding fits in ``n_bytes`` (never splits a character)."""
    return text.encode()[:n_bytes].decode("utf-8", errors="ignore")
