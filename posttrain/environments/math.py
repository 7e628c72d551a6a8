"""`math`: reward 1 when the final answer of the model's last message equals the gold answer
under math-verify (https://github.com/huggingface/Math-Verify), else 0; the verdict
(`CORRECT_KEY`) says the same.

- Final answer: the content of the last `\\boxed{...}` (or `\\fbox{...}`; `\\boxed 5`: the word
  after it), else the last number in the message (thousands separators removed; a fraction "3/4"
  is one number, "−3" or "-3" negative, "2.5e-3" read as 2.5\\times10^{-3}). No answer scores 0
  (not an error).
- Gold answer: the sample's metadata "answer"; a GSM8K solution "... #### 72" gives "72".
- Equal strings score 1 at once; anything else is compared by math-verify (so 0.5 = \\frac{1}{2})
  in a child process with a hard time limit of `env.math.timeout_s`
  (`posttrain.environments.timeout`). A check that runs over, or kills its process, is an
  equality not shown: the answer is wrong (math-verify's own rule for its timeouts and errors),
  logged as a warning and marked `VERIFY_FAILED_KEY` in the sample's metadata. Left out of the
  metrics as an environment error, an answer that stalls the verifier raised eval accuracy, and
  went untrained in GRPO (grpo.mask_env_error_samples).
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain.environments.interfaces import CORRECT_KEY, PerSampleEnvironment, StepResult, last_assistant_text
from posttrain.environments.math_answers import (
    extract_final_answer,
    gold_answer,
    import_math_verify,
    math_verify_equal,
)
from posttrain.environments.timeout import SubprocessRunner
from posttrain.schemas import EnvWorkerConfig, MathEnvConfig

log = logging.getLogger("posttrain.environments")

VERIFY_FAILED_KEY = "verify_failed"  # metadata: why math-verify gave no verdict (the answer was scored wrong)


class MathEnvironment(PerSampleEnvironment):
    config_class = MathEnvConfig
    needs_answer = True

    def __init__(self, cfg: EnvWorkerConfig):
        self.cfg = MathEnvConfig.model_validate(cfg.cfg)
        self.timeout_s = cfg.timeout_s
        self._runner = SubprocessRunner(warmup=import_math_verify)

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        if "answer" not in metadata or metadata["answer"] is None:
            raise KeyError("math: the sample's metadata has no 'answer' (the row's gold answer)")
        gold = gold_answer(metadata["answer"])
        pred = extract_final_answer(last_assistant_text(messages))
        if pred is None:
            correct = False
        elif pred == gold:
            correct = True
        else:
            try:
                correct = self._runner.run(math_verify_equal, (gold, pred, self.cfg.float_rounding), self.timeout_s)
            except (TimeoutError, ChildProcessError) as e:
                log.warning("math: answer %.80r scored wrong, math-verify gave no verdict: %s", pred, e)
                correct, metadata = False, {**metadata, VERIFY_FAILED_KEY: f"{type(e).__name__}: {e}"}
        return StepResult(
            observation="Environment: correct" if correct else "Environment: incorrect",
            reward=1.0 if correct else 0.0,
            terminated=True,
            metadata={**metadata, CORRECT_KEY: bool(correct)},
            answer=pred,
        )

    def close(self) -> None:
        self._runner.close()
