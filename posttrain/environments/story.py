"""`story`: a verifiable reward a tiny pretrained story model can learn, for the stories260K
GRPO demo (docs/stories260k.md).

Task. Each prompt opens a story about an animal ("Once upon a time, there was a little
frog."); the reward is how often the continuation keeps that animal in the story:

    reward = min(mentions, min_mentions) / min_mentions

where `mentions` counts whole-word, case-insensitive occurrences of the animal (or its
plural) in the model's continuation. Base stories260K mentions it about once in two stories
of 40 tokens (0.45 mentions, mean reward ~0.15 with min_mentions=3; two thirds mention it not
at all), so most groups of 8 have reward variance (23 of the 24 validation prompts' groups) and
GRPO gets a signal; a model that stays on topic scores 1. That is also
the verdict (`CORRECT_KEY`): a story is correct when it reaches `min_mentions`; fewer
mentions earn partial reward but count as wrong in accuracy and pass@k.

Rows come from `make_story_rows(data_cfg, split)`: every (opening, animal) pair of the
fixed lists below, a seeded `data.num_val`-sized subset for validation (capped at a quarter)
and the rest for training, so validation prompts are never trained on.
"""

from __future__ import annotations

import random
import re
from typing import Any

from posttrain.environments.interfaces import CORRECT_KEY, PerSampleEnvironment, StepResult, last_assistant_text
from posttrain.schemas import DataConfig, EnvWorkerConfig, StoryEnvConfig

TASK_NAME = "story"
ANIMALS = ("dog", "cat", "bird", "fish", "frog", "pig", "bear", "duck", "horse", "cow", "lion", "owl")
OPENINGS = (
    "Once upon a time, there was a little {}.",
    "One day, a small {} went to the park.",
    "There was a happy {} who lived in a big house.",
    "Lily had a pet {}.",
    "Tom saw a {} in the garden.",
    "Once upon a time, a {} wanted to play.",
    "In a small town, there lived a kind {}.",
    "Sue and Ben found a {} near the tree.",
)
VAL_FRACTION_CAP = 0.25


def count_mentions(text: str, word: str) -> int:
    """Whole-word, case-insensitive occurrences of `word` or its plural "-s" in `text`."""
    return len(re.findall(rf"\b{re.escape(word)}s?\b", text, flags=re.IGNORECASE))


class StoryEnvironment(PerSampleEnvironment):
    config_class = StoryEnvConfig
    needs_answer = True  # the animal

    def __init__(self, cfg: EnvWorkerConfig):
        self.cfg = StoryEnvConfig.model_validate(cfg.cfg)

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        if not metadata.get("answer"):
            raise KeyError("story: the sample's metadata has no 'answer' (the animal the story must mention)")
        word = str(metadata["answer"])
        mentions = count_mentions(last_assistant_text(messages), word)
        reward = min(mentions, self.cfg.min_mentions) / self.cfg.min_mentions
        return StepResult(
            observation=f"Environment: {mentions} mention(s) of {word}",
            reward=reward,
            terminated=True,
            metadata={**metadata, CORRECT_KEY: mentions >= self.cfg.min_mentions},
            answer=str(mentions),
        )


def make_story_rows(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """Rows `{"messages": [user: opening], "answer": animal, "task_name": "story", "metadata"}`.

    Validation: a seeded (`data.seed`) subset of `data.num_val` pairs (at most a quarter of
    the 96); training: the other pairs, shuffled, capped at `data.num_train`.
    """
    pairs = [(o, a) for o in OPENINGS for a in ANIMALS]
    random.Random(cfg.seed).shuffle(pairs)
    n_val = min(cfg.num_val, int(len(pairs) * VAL_FRACTION_CAP))
    chosen = pairs[:n_val] if split == "val" else pairs[n_val:][: cfg.num_train]
    return [
        {
            "messages": [{"role": "user", "content": opening.format(animal)}],
            "answer": animal,
            "task_name": TASK_NAME,
            "metadata": {"opening": opening},
        }
        for opening, animal in chosen
    ]
