"""The synthetic grade-school arithmetic task of kimi_mini (GSM8K in spirit, made learnable).

A problem is a short story about one person and one kind of object: a starting count, then 1-3
events (buying more, giving some away, buying packs of several, the count becoming m times as
large), then the question "How many X does N have now?". The answer writes every step as
"a+b=c", "a-b=c" or "a*b=c" and ends with "#### N":

    Q: Emma has 23 marbles. She buys 4 boxes with 6 marbles in each box. She gives 7 marbles
    to Liam. How many marbles does Emma have now?
    A: 4*6=24. 23+24=47. 47-7=40. #### 40

Every problem has 2-4 steps and every number in it lies in [0, kMaxValue], so the arithmetic a
small character-level model must do is bounded (sums of 2-3 digit numbers, 1-digit x 1-digit
pack products, 2..4 times a count of at most 30).

The held-out set (heldout.jsonl, 200 problems) is drawn from its own seed; the training stream
rejects every problem whose question text is in it, so the two are disjoint by construction.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

kMaxValue = 999          # no number in a problem or its answer exceeds this
kMaxOperand = 50         # starting counts and amounts added or removed
kMaxTimesBase = 30       # "m times as large" only applies to counts up to this (m in 2..4)
kMinSteps, kMaxSteps = 2, 4
kHeldoutSeed = 20240607  # the held-out set's own stream (never used for training batches)
kHeldoutSize = 200

NAMES = [
    ("Emma", "She"), ("Liam", "He"), ("Olivia", "She"), ("Noah", "He"), ("Ava", "She"),
    ("Lucas", "He"), ("Mia", "She"), ("Ethan", "He"), ("Sofia", "She"), ("Mason", "He"),
    ("Zoe", "She"), ("Leo", "He"), ("Chloe", "She"), ("Owen", "He"), ("Lily", "She"),
    ("Jack", "He"), ("Ruby", "She"), ("Sam", "He"), ("Nora", "She"), ("Ben", "He"),
    ("Ella", "She"), ("Max", "He"), ("Ivy", "She"), ("Tom", "He"),
]
OBJECTS = [
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "coins",
    "cards", "stamps", "eggs", "flowers", "candies", "toys", "beads", "balloons",
]
CONTAINERS = ["boxes", "bags", "packs", "jars", "baskets"]

ADD_TEMPLATES = [
    "{P} buys {n} more {obj}.",
    "{P} finds {n} more {obj}.",
    "{F} gives {p_obj} {n} {obj}.",
    "{P} gets {n} more {obj} from {F}.",
]
SUB_TEMPLATES = [
    "{P} gives {n} {obj} to {F}.",
    "{P} loses {n} {obj}.",
    "{P} sells {n} {obj}.",
    "{P} uses {n} {obj}.",
]
PACK_TEMPLATES = [
    "{P} buys {m} {box} with {n} {obj} in each.",
    "{P} gets {m} {box} of {obj} with {n} in each.",
]
TIMES_TEMPLATES = [
    "Then the number of {obj} {p} has becomes {m} times as large.",
    "Then {p} makes the number of {obj} {m} times as large.",
]


@dataclass
class Problem:
    question: str
    answer: str   # " 4*6=24. 23+24=47. #### 47" (what the model writes after "A:")
    final: int

    def prompt(self) -> str:
        return f"Q: {self.question}\nA:"

    def text(self) -> str:
        return self.prompt() + self.answer + "\n"

    def to_json(self) -> str:
        return json.dumps({"question": self.question, "answer": self.answer,
                           "final": self.final})


def _event(rng: random.Random, cur: int, steps_left: int, ctx: dict):
    """One event: (sentence, [step strings], new value) or None when it does not fit."""
    kinds = ["add", "sub"]
    if steps_left >= 2:
        kinds.append("pack")
    if 2 <= cur <= kMaxTimesBase:
        kinds.append("times")
    kind = rng.choice(kinds)
    if kind == "add":
        n = rng.randint(2, kMaxOperand)
        new = cur + n
        tpl, steps = rng.choice(ADD_TEMPLATES), [f"{cur}+{n}={new}"]
        fmt = dict(n=n)
    elif kind == "sub":
        if cur < 3:
            return None
        n = rng.randint(1, min(cur - 1, kMaxOperand))
        new = cur - n
        tpl, steps = rng.choice(SUB_TEMPLATES), [f"{cur}-{n}={new}"]
        fmt = dict(n=n)
    elif kind == "pack":
        m, n = rng.randint(2, 9), rng.randint(2, 9)
        x = m * n
        new = cur + x
        tpl, steps = rng.choice(PACK_TEMPLATES), [f"{m}*{n}={x}", f"{cur}+{x}={new}"]
        fmt = dict(m=m, n=n, box=rng.choice(CONTAINERS))
    else:
        m = rng.randint(2, 4)
        new = cur * m
        tpl, steps = rng.choice(TIMES_TEMPLATES), [f"{cur}*{m}={new}"]
        fmt = dict(m=m)
    if new > kMaxValue:
        return None
    return tpl.format(**ctx, **fmt), steps, new


def generate(rng: random.Random) -> Problem:
    """One problem with kMinSteps..kMaxSteps steps."""
    while True:
        (name, pron), (friend, _) = rng.sample(NAMES, 2)
        obj = rng.choice(OBJECTS)
        ctx = dict(P=pron, p=pron.lower(), p_obj="him" if pron == "He" else "her", F=friend,
                   obj=obj)
        cur = rng.randint(2, kMaxOperand)
        target_steps = rng.randint(kMinSteps, kMaxSteps)
        sentences, steps = [f"{name} has {cur} {obj}."], []
        ok = True
        while len(steps) < target_steps:
            ev = _event(rng, cur, target_steps - len(steps), ctx)
            if ev is None:
                ok = False
                break
            sentence, ev_steps, cur = ev
            sentences.append(sentence)
            steps += ev_steps
        if not ok or len(steps) > kMaxSteps:
            continue
        sentences.append(f"How many {obj} does {name} have now?")
        answer = " " + " ".join(s + "." for s in steps) + f" #### {cur}"
        return Problem(" ".join(sentences), answer, cur)


def heldout_problems() -> list[Problem]:
    rng = random.Random(kHeldoutSeed)
    out, seen = [], set()
    while len(out) < kHeldoutSize:
        p = generate(rng)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def load_jsonl(path: str) -> list[Problem]:
    with open(path) as f:
        return [Problem(**json.loads(line)) for line in f if line.strip()]


def save_jsonl(path: str, problems: list[Problem]) -> None:
    with open(path, "w") as f:
        for p in problems:
            f.write(p.to_json() + "\n")


def final_answer(generated: str) -> int | None:
    """The integer after the last '####' in a generated answer, or None."""
    if "####" not in generated:
        return None
    tail = generated.rsplit("####", 1)[1].strip()
    digits = ""
    for ch in tail:
        if ch.isdigit() or (ch == "-" and not digits):
            digits += ch
        else:
            break
    try:
        return int(digits)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Character tokenizer: id 0 is padding, ids 1.. are the characters of kChars (fixed, so the
# vocabulary does not depend on which problems happened to be generated).
# ---------------------------------------------------------------------------------------------
kChars = ("\n !#*+-.:=?" + "0123456789" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
          + "abcdefghijklmnopqrstuvwxyz")
kPadId = 0
VOCAB = ["<pad>"] + list(kChars)
_CHAR_TO_ID = {c: i + 1 for i, c in enumerate(kChars)}


def encode(text: str) -> list[int]:
    try:
        return [_CHAR_TO_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"encode: character {e} is not in the kimi_mini vocabulary") from None


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i != kPadId)


if __name__ == "__main__":
    rng = random.Random(0)
    for _ in range(5):
        print(generate(rng).text())
