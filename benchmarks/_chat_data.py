"""Synthetic chat conversations for the EAGLE-3 benchmarks (no dataset can be downloaded here).

ShareGPT records (``conversations`` of ``human`` / ``gpt`` turns) built from a word list with a
fixed seed: mostly one exchange, every fourth conversation two, every eighth with a system
turn. The ``gpt`` turns are placeholders that ``--regenerate`` replaces.
"""

from __future__ import annotations

import random

TOPICS = ("rivers", "bread", "the moon", "chess", "bicycles", "volcanoes", "tea", "libraries", "bees", "trains",
          "glass", "winter", "maps", "violins", "salt", "clouds")
ASKS = ("Explain how {t} work in simple terms.", "Write a short poem about {t}.", "Give three facts about {t}.",
        "Why do people like {t}?", "Describe {t} to a child.", "What is the history of {t}?")


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` ShareGPT conversations."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        if i % 8 == 5:
            turns.append({"from": "system", "value": "You are a concise assistant."})
        for _ in range(2 if i % 4 == 3 else 1):
            topic = rng.choice(TOPICS)
            turns.append({"from": "human", "value": rng.choice(ASKS).format(t=topic)})
            turns.append({"from": "gpt", "value": f"Here is something about {topic}."})
        out.append({"id": f"conv-{i}", "conversations": turns})
    return out
