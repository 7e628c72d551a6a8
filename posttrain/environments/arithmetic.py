"""`arithmetic`: the embedded synthetic task (`posttrain.data.arithmetic`): reward 1 when the
model's last message is exactly the row's answer ("12+34=" -> "46"), else 0; the verdict
(`CORRECT_KEY`) says the same.

With `env.arithmetic.cfg.strip_response` (default) whitespace around the response is
ignored; the answer must otherwise match character for character ("46." or "046" score 0),
which is what a one-character-per-token model has to learn.
"""

from __future__ import annotations

from typing import Any

from posttrain.environments.interfaces import CORRECT_KEY, PerSampleEnvironment, StepResult, last_assistant_text
from posttrain.schemas import ArithmeticEnvConfig, EnvWorkerConfig


class ArithmeticEnvironment(PerSampleEnvironment):
    config_class = ArithmeticEnvConfig
    needs_answer = True

    def __init__(self, cfg: EnvWorkerConfig):
        self.cfg = ArithmeticEnvConfig.model_validate(cfg.cfg)

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        if metadata.get("answer") is None:
            raise KeyError("arithmetic: the sample's metadata has no 'answer' (the row's gold answer)")
        response = last_assistant_text(messages)
        gold = str(metadata["answer"])
        if self.cfg.strip_response:
            response, gold = response.strip(), gold.strip()
        correct = response == gold
        return StepResult(
            observation="Environment: correct" if correct else "Environment: incorrect",
            reward=1.0 if correct else 0.0,
            terminated=True,
            metadata={**metadata, CORRECT_KEY: correct},
            answer=response,
        )
