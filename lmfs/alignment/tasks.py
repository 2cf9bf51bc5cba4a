"""The alignment lectures' data: verifiable problems, instructions with responses, preference pairs.

Everything is GENERATED here, deterministically for a seed (only :class:`random.Random` and
SHA-256, both stable across machines and Python versions):

* :func:`arithmetic_problems`: sums and differences, ``"What is 37 + 58?"`` -> ``"95"``;
  difficulty = the number of digits of the operands.
* :func:`countdown_problems`: reach a target from a few numbers with ``+ - *`` and brackets,
  each number used at most once (the "Countdown" numbers game); difficulty = how many numbers.
* :func:`instruction_examples`: ``(instruction, response)`` pairs for supervised fine-tuning:
  arithmetic, "which is larger", reading questions about the course's generated stories and
  countdown puzzles, each answered in the course's format (free text, then a last line
  ``Answer: <value>``).
* :func:`preference_pairs`: ``(prompt, chosen, rejected)`` triples for the reward model and DPO:
  the chosen response is right and well formatted; the rejected one gives a wrong value, drops
  the ``Answer:`` line, or rambles off the question.

**Held-out split.** Every item has a *key* (the question without its wording: ``"37+58"``, the
story's index, the countdown numbers and target) and belongs to the test split when the SHA-256
of its key falls in the last fifth (:func:`split_of`). A problem is therefore in the same split
wherever it appears: the test arithmetic never shows up in the instructions, the preference
pairs or the pre-training text of :mod:`lmfs.alignment.base`, which all draw from the train split.

The splits are stored in ``data/alignment/NAME-SPLIT.jsonl`` (small, committed) and read with
:func:`load_split`; ``python -m lmfs.alignment data`` rebuilds them (:func:`write_data`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import os
import random
import re
import warnings
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from lmfs.data.corpora import COLORS, NAMES, PLACES, PLACE_SENTENCE, TOY_SENTENCE, iter_stories

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "alignment"
SPLITS = ("train", "test")
TEST_SHARE = 0.2          # share of keys (questions) held out for the test split
ANSWER_PREFIX = "Answer:"
STORY_SEED = 2000         # stories of the reading questions; lecture 12's items use 1000, training 0


@dataclass(frozen=True)
class Problem:
    """A verifiable problem: the ``prompt`` (the user's question, without any chat template), the
    reference ``answer`` (a value, or for countdown one solution), its ``kind``
    (``"arithmetic"``/``"countdown"``), ``difficulty`` (digits, or how many numbers) and ``meta``
    (what :func:`check_answer` needs: the operands, or the numbers and the target)."""

    prompt: str
    answer: str
    kind: str
    difficulty: int
    meta: dict = field(default_factory=dict, hash=False)


def split_of(key: str) -> str:
    """``"test"`` for the fifth of keys whose SHA-256 falls last, else ``"train"``.

    A hash, not a random draw, so the split of a question depends on the question alone: the
    same sum is held out in every list, file and corpus built from these generators.
    """
    value = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64
    return "test" if value >= 1 - TEST_SHARE else "train"


def _check_split(split: str | None) -> None:
    if split not in (None, *SPLITS):
        raise ValueError(f"split={split!r}: use 'train', 'test' or None (both)")


def _draw_unique(n: int, draw, key, split: str | None, what: str, max_tries: int | None = None) -> list:
    """``n`` distinct items ``draw()`` whose ``key(item)`` lies in ``split``; fails clearly when the
    space of items is too small for ``n``."""
    _check_split(split)
    seen, out, tries = set(), [], 0
    max_tries = max_tries or 50 * n + 1000
    while len(out) < n:
        tries += 1
        if tries > max_tries:
            raise ValueError(f"found only {len(out)} distinct {what} in the {split or 'whole'} split after "
                             f"{max_tries} draws, {n} asked: ask for fewer or make them harder")
        item = draw()
        k = key(item)
        if k in seen or (split is not None and split_of(k) != split):
            continue
        seen.add(k)
        out.append(item)
    return out


# ----------------------------------------------------------------------------------------------
# Verifiable problems


def _apply(a: int, op: str, b: int) -> int:
    return {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](a, b)


def arithmetic_problems(n: int, digits: int = 2, ops: str = "+-", seed: int = 0,
                        split: str | None = None, unique: bool = True) -> list[Problem]:
    """``n`` distinct problems ``"What is a op b?"`` with operands of exactly ``digits`` digits
    (0-9 for one digit), ``op`` drawn from ``ops`` (``+ - *``); ``split`` keeps only the train or
    test ones; ``unique=False`` allows repeats (for more text than there are problems).

    >>> p = arithmetic_problems(1, digits=2, ops="+", seed=3)[0]
    >>> p.prompt, p.answer, p.difficulty
    ('What is 92 + 55?', '147', 2)
    """
    if digits < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(f"digits={digits} must be >= 1 and ops={ops!r} a non-empty string of '+-*'")
    rng = random.Random(f"lmfs-alignment-arithmetic:{seed}:{digits}:{ops}")
    low = 0 if digits == 1 else 10 ** (digits - 1)

    def draw():
        return rng.randrange(low, 10 ** digits), rng.choice(ops), rng.randrange(low, 10 ** digits)

    if unique:
        triples = _draw_unique(n, draw, lambda t: f"{t[0]}{t[1]}{t[2]}", split, f"{digits}-digit problems")
    else:
        _check_split(split)
        triples = []
        while len(triples) < n:
            a, op, b = draw()
            if split is None or split_of(f"{a}{op}{b}") == split:
                triples.append((a, op, b))
    return [Problem(f"What is {a} {op} {b}?", str(_apply(a, op, b)), "arithmetic", digits,
                    {"a": a, "op": op, "b": b}) for a, op, b in triples]


def _countdown_expression(numbers: list[int], rng: random.Random) -> tuple[str, int]:
    """A random expression using every number once, and its value: combine two of the values left
    (inner steps bracketed), repeatedly, keeping every intermediate value non-negative."""
    values = [(str(x), x) for x in numbers]
    while len(values) > 1:
        i, j = rng.sample(range(len(values)), 2)
        (ea, a), (eb, b) = values[i], values[j]
        op = rng.choice("+-*")
        if op == "-" and a < b:  # swap the operands
            (ea, a), (eb, b) = (eb, b), (ea, a)
        expr = f"{ea} {op} {eb}" if len(values) == 2 else f"({ea} {op} {eb})"
        values = [v for k, v in enumerate(values) if k not in (i, j)] + [(expr, _apply(a, op, b))]
    return values[0]


def countdown_problems(n: int, n_numbers: int = 3, seed: int = 0, split: str | None = None,
                       max_number: int = 20, max_target: int = 200) -> list[Problem]:
    """``n`` distinct puzzles: ``n_numbers`` numbers in ``1..max_number`` and a target in
    ``1..max_target`` that some expression with ``+ - *`` and brackets reaches, each number used
    at most once. ``answer`` is one such expression; any other that reaches the target counts.

    >>> p = countdown_problems(1, seed=0)[0]
    >>> p.meta["target"] == eval(p.answer)
    True
    """
    if n_numbers < 2:
        raise ValueError(f"n_numbers={n_numbers}: a countdown puzzle needs at least 2 numbers")
    rng = random.Random(f"lmfs-alignment-countdown:{seed}:{n_numbers}")

    def draw():
        while True:
            numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
            expr, target = _countdown_expression(numbers, rng)
            if 1 <= target <= max_target:
                return numbers, expr, target

    found = _draw_unique(n, draw, lambda t: f"{sorted(t[0])}->{t[2]}", split, f"{n_numbers}-number puzzles")
    return [Problem(f"Use the numbers {', '.join(map(str, numbers))} to make {target}. "
                    "You may use + - * and brackets, each number at most once.",
                    expr, "countdown", n_numbers, {"numbers": numbers, "target": target})
            for numbers, expr, target in found]


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in ``response``, up to the end of its line (stripped);
    ``None`` when there is no ``Answer:``.

    >>> extract_answer("12 + 30 = 42.\\nAnswer: 42")
    '42'
    >>> extract_answer("forty-two") is None
    True
    """
    at = response.rfind(ANSWER_PREFIX)
    if at < 0:
        return None
    return response[at + len(ANSWER_PREFIX):].split("\n", 1)[0].strip()


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node, used: list[int]) -> Fraction:
    """Evaluate an arithmetic syntax tree of integers and ``+ - * /`` exactly, collecting the
    integers it uses; anything else (names, calls, powers, floats) raises ``ValueError``."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in an answer: {ast.dump(node)[:40]}")


def check_countdown(numbers: list[int], target: int, expression: str) -> bool:
    """Whether ``expression`` (``"(3 * 7) + 25"``, optionally followed by ``= 46``) reaches
    ``target`` using only integers from ``numbers``, each at most as often as it is given.

    The expression is parsed, never executed: only integers, ``+ - * /`` and brackets are
    accepted (at most 200 characters), and it is evaluated in exact fractions.
    """
    expression = expression.split("=", 1)[0].strip()
    if not expression or len(expression) > 200:
        return False
    used: list[int] = []
    try:
        with warnings.catch_warnings():  # text such as "1." parses with a SyntaxWarning: not an error here
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression, mode="eval")
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, RecursionError):
        return False
    pool = list(numbers)
    for x in used:
        if x not in pool:
            return False
        pool.remove(x)
    return value == target


def check_answer(problem: Problem, response: str) -> float:
    """1.0 when ``response``'s last ``Answer:`` line is right, else 0.0.

    Arithmetic: the answer must be the integer (a trailing full stop is forgiven). Countdown: the
    answer must be an expression that reaches the target (:func:`check_countdown`).
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    answer = answer.rstrip(".").strip()
    if problem.kind == "arithmetic":
        return float(re.fullmatch(r"-?\d+", answer) is not None and int(answer) == int(problem.answer))
    if problem.kind == "countdown":
        return float(check_countdown(problem.meta["numbers"], problem.meta["target"], answer))
    raise ValueError(f"unknown problem kind {problem.kind!r}: expected 'arithmetic' or 'countdown'")


# ----------------------------------------------------------------------------------------------
# Instructions and responses (SFT)


def arithmetic_response(problem: Problem) -> str:
    """The course's answer to an arithmetic problem: ``"37 + 58 = 95.\\nAnswer: 95"``."""
    m = problem.meta
    return f"{m['a']} {m['op']} {m['b']} = {problem.answer}.\n{ANSWER_PREFIX} {problem.answer}"


def countdown_response(problem: Problem) -> str:
    """The worked steps of the reference solution, then the expression as the answer."""
    numbers = problem.meta["numbers"]
    # Replay the generator's steps from the expression itself: evaluate each bracket in turn.
    steps, expr = [], problem.answer
    inner = re.compile(r"\((\d+) ([-+*]) (\d+)\)")
    while (m := inner.search(expr)) is not None:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        steps.append(f"{a} {op} {b} = {_apply(a, op, b)}.")
        expr = expr[:m.start()] + str(_apply(a, op, b)) + expr[m.end():]
    last = re.fullmatch(r"(\d+) ([-+*]) (\d+)", expr)
    if last:
        a, op, b = int(last.group(1)), last.group(2), int(last.group(3))
        steps.append(f"{a} {op} {b} = {_apply(a, op, b)}.")
    head = f"From {', '.join(map(str, numbers))}: " + " ".join(steps)
    return f"{head}\n{ANSWER_PREFIX} {problem.answer}"


def _story_fact_example(rng: random.Random, index: int, story: str) -> tuple[str, str, str]:
    """Reading questions about one story's first paragraph: ``(instruction, right, wrong)``
    responses for where the child went, the colour of the toy and the friend's name."""
    (name, place), (_, colour, obj, friend) = PLACE_SENTENCE.search(story).groups(), TOY_SENTENCE.search(story).groups()
    paragraph = story.split("\n\n")[0]
    asks = [
        (f"Where did {name} go?", f"{name} went to {place}.", place,
         rng.choice([p for p in PLACES if p != place])),
        (f"What colour was the {obj} of {name}?", f"The {obj} was {colour}.", colour,
         rng.choice([c for c in COLORS if c != colour])),
        (f"What was the name of the friend of {name}?", f"The friend was called {friend}.", friend,
         rng.choice([x for x in NAMES if x not in (friend, name)])),
    ]
    question, text, right, wrong = asks[index % 3]
    instruction = f"Read the story and answer the question.\n\n{paragraph}\n\nQuestion: {question}"
    wrong_text = text.replace(right, wrong)
    return instruction, f"{text}\n{ANSWER_PREFIX} {right}", f"{wrong_text}\n{ANSWER_PREFIX} {wrong}"


def _compare_example(rng: random.Random) -> tuple[str, str, str, str]:
    """``(key, instruction, right, wrong)`` for "which is larger" on two 1-3 digit numbers."""
    digits = rng.choice((1, 2, 3))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    a, b = rng.sample(range(low, 10 ** digits), 2)
    big, small = max(a, b), min(a, b)
    right = f"{big} is larger than {small}.\n{ANSWER_PREFIX} {big}"
    wrong = f"{small} is larger than {big}.\n{ANSWER_PREFIX} {small}"
    return f"max{a},{b}", f"Which number is larger, {a} or {b}?", right, wrong


def _wrong_number(rng: random.Random, value: int) -> int:
    """A near miss, the kind of mistake a model makes: off by one, by ten, a swapped digit."""
    return value + rng.choice((-10, -2, -1, 1, 2, 10))


def _items(n: int, seed: int, split: str | None, what: str) -> list[tuple[str, str, str, str, str]]:
    """``n`` items ``(kind, key, instruction, right response, wrong response)`` in a fixed mix:
    arithmetic 40% (1-3 digits, + and -), reading questions 30%, "which is larger" 15%,
    countdown 15% (3 numbers). Keys are distinct and lie in ``split``."""
    _check_split(split)
    rng = random.Random(f"lmfs-alignment-{what}:{seed}")
    stories = iter(enumerate(iter_stories(STORY_SEED)))
    seen: set[str] = set()
    out = []
    while len(out) < n:
        kind = rng.choices(("arithmetic", "story", "compare", "countdown"), (40, 30, 15, 15))[0]
        if kind == "arithmetic":
            digits = rng.choices((1, 2, 3), (2, 6, 2))[0]
            low = 0 if digits == 1 else 10 ** (digits - 1)
            a, op, b = rng.randrange(low, 10 ** digits), rng.choice("+-"), rng.randrange(low, 10 ** digits)
            key = f"{a}{op}{b}"
            p = Problem(f"What is {a} {op} {b}?", str(_apply(a, op, b)), "arithmetic", digits,
                        {"a": a, "op": op, "b": b})
            right = arithmetic_response(p)
            wrong_value = _wrong_number(rng, int(p.answer))
            wrong = f"{a} {op} {b} = {wrong_value}.\n{ANSWER_PREFIX} {wrong_value}"
            item = (kind, key, p.prompt, right, wrong)
        elif kind == "story":
            index, story = next(stories)
            key = f"story{STORY_SEED}:{index}"
            instruction, right, wrong = _story_fact_example(rng, index, story)
            item = (kind, key, instruction, right, wrong)
        elif kind == "compare":
            key, instruction, right, wrong = _compare_example(rng)
            item = (kind, key, instruction, right, wrong)
        else:
            numbers = [rng.randint(1, 20) for _ in range(3)]
            expr, target = _countdown_expression(numbers, rng)
            if not 1 <= target <= 200:
                continue
            key = f"{sorted(numbers)}->{target}"
            p = Problem(f"Use the numbers {', '.join(map(str, numbers))} to make {target}. "
                        "You may use + - * and brackets, each number at most once.",
                        expr, "countdown", 3, {"numbers": numbers, "target": target})
            right = countdown_response(p)
            wrong = right.rsplit("\n", 1)[0] + f"\n{ANSWER_PREFIX} {_broken_expression(p)}"
            item = (kind, key, p.prompt, right, wrong)
        if key in seen or (split is not None and split_of(key) != split):
            continue
        seen.add(key)
        out.append(item)
    return out


def instruction_examples(n: int, seed: int = 0, split: str | None = None) -> list[tuple[str, str]]:
    """``n`` generated ``(instruction, response)`` pairs for SFT (mix: see :func:`_items`).

    >>> instruction_examples(1, seed=0)[0]
    ('What is 23 - 32?', '23 - 32 = -9.\\nAnswer: -9')
    """
    return [(instruction, right) for _, _, instruction, right, _ in _items(n, seed, split, "instructions")]


def _broken_expression(problem: Problem) -> str:
    """The reference expression with its first operator changed so that it misses the target."""
    expr = problem.answer
    at = re.search(r" [-+*] ", expr).start() + 1
    for op in "+-*":
        candidate = expr[:at] + op + expr[at + 1:]
        if not check_countdown(problem.meta["numbers"], problem.meta["target"], candidate):
            return candidate
    return expr + " + 1"  # every operator reaches the target (e.g. 2 + 2 = 2 * 2): add a stray 1


def _rambling(rng: random.Random) -> str:
    """An off-topic reply that never answers: the base model's favourite failure, a story."""
    story = next(iter_stories(rng.randrange(10 ** 6)))
    first_two = ". ".join(story.split("\n\n")[0].split(". ")[:2])
    return first_two if first_two.endswith((".", "!", '"')) else first_two + "."


def preference_pairs(n: int, seed: int = 0, split: str | None = None) -> list[tuple[str, str, str]]:
    """``n`` generated ``(prompt, chosen, rejected)`` triples: the chosen response is right and in
    the course's format; the rejected one is, in equal shares, a wrong value in the same format,
    the right text without the ``Answer:`` line, or an off-topic story."""
    return [pair for _, pair in _preference_items(n, seed, split)]


def _preference_items(n: int, seed: int, split: str | None) -> list[tuple[str, tuple[str, str, str]]]:
    """``(flaw, (prompt, chosen, rejected))``: ``flaw`` names what is wrong with the rejected one."""
    rng = random.Random(f"lmfs-alignment-preference-flaws:{seed}")
    out = []
    for _, _, instruction, right, wrong in _items(n, seed, split, "preferences"):
        flaw = rng.choice(("wrong", "no_answer", "off_topic"))
        rejected = {"wrong": wrong, "no_answer": right.rsplit("\n", 1)[0],
                    "off_topic": _rambling(rng) if flaw == "off_topic" else ""}[flaw]
        out.append((flaw, (instruction, right, rejected)))
    return out


# ----------------------------------------------------------------------------------------------
# The stored splits


def _arithmetic_split(split: str) -> list[Problem]:
    """Per digits 1-3 and op ``+``/``-``: 60 (train) or 12 (test) of the 100 1-digit problems, 300 (train) or 150
    (test) of each larger size."""
    out = []
    for digits in (1, 2, 3):
        for op in "+-":
            n = {"train": 300, "test": 150}[split] if digits > 1 else {"train": 60, "test": 12}[split]
            out += arithmetic_problems(n, digits, op, seed=0, split=split)
    return out


def _countdown_split(split: str) -> list[Problem]:
    n = {"train": 300, "test": 100}[split]
    return countdown_problems(n, 3, seed=0, split=split) + countdown_problems(n, 4, seed=0, split=split)


SPLIT_BUILDERS = {
    "arithmetic": _arithmetic_split,
    "countdown": _countdown_split,
    "instructions": lambda split: [dict(kind=kind, instruction=i, response=r)
                                   for kind, _, i, r, _ in _items({"train": 2000, "test": 300}[split], 0,
                                                                  split, "instructions")],
    "preferences": lambda split: [dict(flaw=flaw, prompt=p, chosen=c, rejected=r)
                                  for flaw, (p, c, r) in _preference_items({"train": 1200, "test": 300}[split],
                                                                           0, split)],
}


def split_path(name: str, split: str, folder: str | os.PathLike = DATA_DIR) -> Path:
    if name not in SPLIT_BUILDERS or split not in SPLITS:
        raise ValueError(f"unknown data {name!r}/{split!r}: name is one of {sorted(SPLIT_BUILDERS)}, "
                         f"split one of {SPLITS}")
    return Path(folder) / f"{name}-{split}.jsonl"


def write_data(folder: str | os.PathLike = DATA_DIR) -> list[Path]:
    """Build every split and write it as JSON lines ``folder/NAME-SPLIT.jsonl``; return the paths."""
    paths = []
    for name, build in SPLIT_BUILDERS.items():
        for split in SPLITS:
            path = split_path(name, split, folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = [asdict(r) if isinstance(r, Problem) else r for r in build(split)]
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            paths.append(path)
    return paths


def load_records(name: str, split: str, folder: str | os.PathLike = DATA_DIR) -> list[dict]:
    """The rows of ``data/alignment/NAME-SPLIT.jsonl`` as dicts (with their ``kind`` or ``flaw``)."""
    path = split_path(name, split, folder)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m lmfs.alignment data` to write it")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_split(name: str, split: str, folder: str | os.PathLike = DATA_DIR) -> list:
    """A stored split: ``"arithmetic"``/``"countdown"`` -> :class:`Problem` list,
    ``"instructions"`` -> ``(instruction, response)`` list, ``"preferences"`` ->
    ``(prompt, chosen, rejected)`` list. ``split`` is ``"train"`` or ``"test"`` (held out)."""
    rows = load_records(name, split, folder)
    if name in ("arithmetic", "countdown"):
        return [Problem(**r) for r in rows]
    if name == "instructions":
        return [(r["instruction"], r["response"]) for r in rows]
    return [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
