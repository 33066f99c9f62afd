"""Multi-step arithmetic word problems in GSM8K form, generated deterministically from a seed.

A problem is a short story ("Tom has 3 apples. He gets 4 more. Then he gives 2 away. How many
apples does Tom have?"), one worked step per operation and a final answer. Steps use a compact
form of GSM8K's calculator annotations with no prose around them:

    3+4=<<3+4=7>>7
    7-2=<<7-2=5>>5
    #### 5

Every step's left operand is the previous step's result, so the chain of annotations alone
determines the answer. Multiplication is written `*`, as in GSM8K annotations.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lazyzero.app.data.tokenizer import ChatTemplate

Split = Literal["train", "eval"]

NAMES = (("Tom", "he"), ("Ana", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Eva", "she"),
         ("Leo", "he"), ("Zoe", "she"), ("Max", "he"), ("Ivy", "she"), ("Dan", "he"), ("Amy", "she"))  # fmt: skip
OBJECTS = ("apples", "pens", "coins", "cards", "books", "shells",
           "stamps", "marbles", "eggs", "cookies", "toys", "rocks")  # fmt: skip
# One phrase list per operation; {p} is the pronoun, {b} the operand.
PHRASES = {
    "+": ("{p} gets {b} more", "{p} buys {b} more", "{p} finds {b} more"),
    "-": ("{p} gives {b} away", "{p} loses {b}", "{p} sells {b}"),
    "*": ("{p} multiplies them by {b}",),
}
# Share of the question-hash space reserved for the eval split (see `split_of`).
EVAL_HASH_BUCKETS = 10


@dataclass(frozen=True)
class Difficulty:
    """How hard generated problems are: number of steps, operand ranges (inclusive) and a cap on
    every intermediate result (operations that would exceed it are not drawn)."""

    steps: int = 2
    max_start: int = 12
    max_operand: int = 12
    max_multiplier: int = 5
    max_result: int = 99

    def __post_init__(self):
        if self.steps < 1 or self.max_start < 2 or self.max_operand < 1 or self.max_multiplier < 2:
            raise ValueError(f"{self} needs steps >= 1, max_start >= 2, max_operand >= 1 and max_multiplier >= 2")
        if self.max_result < self.max_start:
            raise ValueError(f"{self} needs max_result >= max_start")


DIFFICULTIES = {
    # The quick start's default: few enough distinct facts (single-digit operands, results up to
    # 20) that the ~20M demo model answers some problems exactly after a few CPU minutes.
    "starter": Difficulty(steps=2, max_start=9, max_operand=9, max_multiplier=2, max_result=20),
    "easy": Difficulty(),
    "medium": Difficulty(steps=3, max_start=20, max_operand=20, max_multiplier=5, max_result=999),
    "hard": Difficulty(steps=4, max_start=50, max_operand=50, max_multiplier=9, max_result=9999),
}


@dataclass(frozen=True)
class Problem:
    """One word problem: question text, worked steps (one annotated line each) and the answer."""

    question: str
    steps: tuple[str, ...]
    answer: int


def generate_problems(
    n: int, seed: int, split: Split = "train", difficulty: str | Difficulty = "easy"
) -> list[Problem]:
    """`n` distinct problems of `split`, the same for the same arguments.

    Splits are disjoint by construction: a question belongs to the split chosen by a hash of its
    text (`split_of`), and each split keeps only its own questions, so the train and eval sets never
    share a question whatever seeds they were drawn with.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    level = _difficulty(difficulty)
    rng = random.Random(f"lazyzero-arithmetic:{split}:{seed}")
    problems: dict[str, Problem] = {}
    attempts_left = 100 * n + 1000
    while len(problems) < n:
        if attempts_left == 0:
            raise ValueError(f"could not draw {n} distinct {split} problems at this difficulty; ask for fewer")
        attempts_left -= 1
        problem = _draw_problem(rng, level)
        if split_of(problem.question) == split:
            problems.setdefault(problem.question, problem)
    return list(problems.values())


def split_of(question: str) -> Split:
    """The split a question belongs to, from a stable hash of its text (one bucket in ten is eval)."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_HASH_BUCKETS == 0 else "train"


def format_prompt(problem: Problem, chat: ChatTemplate | None = None) -> str:
    """The text a model sees before it must answer: it ends right where the first step starts.

    With an instruct model's `chat` template, the question is the user's turn and the text ends where
    the assistant's answer starts (the framing the model was tuned on).
    """
    if chat is not None:
        return chat.prompt(problem.question)
    return f"Question: {problem.question}\nAnswer: "


def format_solution(problem: Problem) -> str:
    """The answer part: one line per step, then the `#### answer` line (with no newline after it)."""
    return "".join(f"{step}\n" for step in problem.steps) + f"#### {problem.answer}"


def format_example(problem: Problem, chat: ChatTemplate | None = None) -> str:
    """The full training text: prompt, one line per step, then the `#### answer` line; with a `chat`
    template, a user turn (the question) and the assistant's turn (the solution)."""
    if chat is not None:
        return chat.conversation(problem.question, format_solution(problem))
    return format_prompt(problem) + format_solution(problem) + "\n"


# The number after the first '####': optional sign, digits with optional thousands commas, and an
# optional all-zero fraction ("7.0"); a number with a real fraction ("7.5") is not an integer answer.
_ANSWER = re.compile(r"####\s*(-?\d[\d,]*)(?:\.0+)?(?!\.?\d)")


def extract_answer(text: str) -> int | None:
    """The integer after the first '####' in `text`, or None if there is none.

    The first occurrence counts because a model may keep generating a new question and answer
    after its own.
    """
    marker = text.find("####")
    if marker < 0:
        return None
    match = _ANSWER.match(text, marker)
    return int(match.group(1).replace(",", "")) if match else None


def _difficulty(difficulty: str | Difficulty) -> Difficulty:
    if isinstance(difficulty, Difficulty):
        return difficulty
    if difficulty not in DIFFICULTIES:
        choices = ", ".join(DIFFICULTIES)
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {choices} or pass a Difficulty")
    return DIFFICULTIES[difficulty]


def _draw_problem(rng: random.Random, level: Difficulty) -> Problem:
    name, pronoun = rng.choice(NAMES)
    objects = rng.choice(OBJECTS)
    # At least 2, so that the story's plural nouns are always right.
    amount = rng.randint(2, level.max_start)
    sentences = [f"{name} has {amount} {objects}."]
    steps = []
    for index in range(level.steps):
        op, operand = _draw_operation(rng, amount, level)
        result = {"+": amount + operand, "-": amount - operand, "*": amount * operand}[op]
        subject = pronoun.capitalize() if index == 0 else f"Then {pronoun}"
        sentences.append(rng.choice(PHRASES[op]).format(p=subject, b=operand) + ".")
        expression = f"{amount}{op}{operand}"
        steps.append(f"{expression}=<<{expression}={result}>>{result}")
        amount = result
    sentences.append(f"How many {objects} does {name} have?")
    return Problem(question=" ".join(sentences), steps=tuple(steps), answer=amount)


def _draw_operation(rng: random.Random, amount: int, level: Difficulty) -> tuple[str, int]:
    """An operation and operand keeping the running amount an integer in [1, level.max_result].

    Never reaching zero keeps the story sensible (no "multiplies them by 3" of nothing).
    """
    largest = {
        "+": min(level.max_operand, level.max_result - amount),
        "-": min(level.max_operand, amount - 1),
        "*": min(level.max_multiplier, level.max_result // amount),
    }
    smallest = {"+": 1, "-": 1, "*": 2}
    ops = [op for op in ("+", "-", "*") if largest[op] >= smallest[op]]
    op = rng.choice(ops)
    return op, rng.randint(smallest[op], largest[op])
