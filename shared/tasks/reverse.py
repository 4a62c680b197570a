"""ReverseTask: reverse a short random lowercase word; the embedded default model's task."""

from __future__ import annotations

import random

from shared.tasks.base import Prompt, Task

REVERSE_DEFAULT_SEED = 1234
REVERSE_DEFAULT_SIZE = 4096
REVERSE_MIN_LETTERS = 3
REVERSE_MAX_LETTERS = 7
REVERSE_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
REVERSE_PROMPT_SUFFIX = ">"


class ReverseTask(Task):
    """Prompt "qwert>" asks for "trewq" (then EOS); reward 1.0 for an exact match, else 0.0."""

    name = "reverse"
    light_reward = True  # a string compared: ~0.01 ms a completion (bench/ingest.py --task reverse)

    def __init__(self, seed: int = REVERSE_DEFAULT_SEED, size: int = REVERSE_DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        rng = random.Random(seed)
        words: list[str] = []
        seen: set[str] = set()
        # Distinct words so that a prompt text identifies its prompt.
        while len(words) < size:
            length = rng.randint(REVERSE_MIN_LETTERS, REVERSE_MAX_LETTERS)
            word = "".join(rng.choice(REVERSE_ALPHABET) for _ in range(length))
            if word not in seen:
                seen.add(word)
                words.append(word)
        self._prompts = [
            Prompt(id=f"rev-{i}", text=word + REVERSE_PROMPT_SUFFIX, answer=word[::-1]) for i, word in enumerate(words)
        ]

    def prompts(self) -> list[Prompt]:
        return list(self._prompts)

    def rewards(self, prompt: Prompt, completions: list[str]) -> list[float]:
        target = self.target(prompt)
        return [1.0 if c.strip() == target else 0.0 for c in completions]

    @staticmethod
    def target(prompt: Prompt) -> str:
        """The correct completion text (the model must follow it with EOS); for supervised warm-up."""
        if not prompt.text.endswith(REVERSE_PROMPT_SUFFIX):
            raise ValueError(f"not a reverse prompt: {prompt.text!r}")
        return prompt.text[: -len(REVERSE_PROMPT_SUFFIX)][::-1]
