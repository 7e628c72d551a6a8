"""What the benchmarks against TRL share: the chat template of the stories260K examples and a
per-step timer for a TRL trainer."""

from __future__ import annotations

import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def alpaca_template() -> str:
    """The Alpaca-style plain-text template the stories260K examples use (it has no chat template)."""
    from posttrain.config import load_config

    return load_config("sft", EXAMPLES / "sft_alpaca.yaml").policy.tokenizer.chat_template


def stories260k(work: Path) -> str:
    """stories260K from ../shared/data, converted by posttrain's own converter into `work`."""
    from posttrain.convert.llama2c import convert
    from posttrain.data.datasets import shared_data_dir

    m = shared_data_dir() / "models" / "stories260K"
    if not (m / "stories260K.bin").is_file():
        raise SystemExit(f"no stories260K at {m}: set POSTTRAIN_SHARED_DATA to the shared data folder "
                         "(../shared/data beside the project by default), or give --model an HF model folder")
    return str(convert(m / "stories260K.bin", m / "tok512.model", work / "stories260K"))


def report(table: str, out: str | None) -> None:
    """Print the results table, and append it to `out` when given."""
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(table)


def step_timer():
    """A TrainerCallback recording each optimizer step's wall time; `.seconds()` leaves out the
    first (warm-up) step, as the posttrain side does."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.t.append(time.perf_counter())

        def seconds(self) -> list[float]:
            return [self.t[i + 1] - self.t[i] for i in range(0, len(self.t) - 1, 2)][1:]

    return StepTimer()
