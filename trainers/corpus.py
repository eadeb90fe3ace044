"""The default training text, generated (never downloaded): deterministic English-like sentences.

A small grammar over a fixed vocabulary gives text with real structure (words, agreement,
punctuation), so a character-level model's loss falls well below the uniform baseline.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "the engineer",
    "a small team",
    "the master node",
    "every worker",
    "the old server",
    "our cluster",
    "the new model",
    "a patient student",
    "the scheduler",
    "each process",
]
VERBS = [
    "trains",
    "watches",
    "copies",
    "checks",
    "starts",
    "stops",
    "measures",
    "repairs",
    "launches",
    "reads",
]
OBJECTS = [
    "the gradients",
    "a long log",
    "the network card",
    "every container",
    "the checkpoint",
    "a quiet port",
    "the shared memory",
    "the clock",
    "a broken link",
    "the loss curve",
]
ADVERBS = [
    "slowly",
    "again",
    "at night",
    "before dawn",
    "with care",
    "in parallel",
    "by hand",
    "every hour",
    "without fear",
    "on time",
]
JOINERS = ["and then", "while", "because", "so", "but"]


def sentence(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        parts.append(rng.choice(ADVERBS))
    if rng.random() < 0.3:
        parts += [rng.choice(JOINERS), rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    text = " ".join(parts)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def generate(chars: int = 200_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        para = " ".join(sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"
        out.append(para)
        size += len(para)
    return "".join(out)[:chars]
