"""DPO step time: posttrain (`posttrain.algorithms.dpo`, Ray driver + FSDP2 worker) against TRL's
DPOTrainer on the same model, the same token ids (posttrain's tokenization of the pairs, handed to
TRL as `prompt_ids` / `chosen_ids` / `rejected_ids`) and the same batch of pairs.

    python benchmarks/dpo_vs_trl.py --steps 12 --batch 8 [--precision float32] [--model DIR] [--out FILE]

A step is one optimizer step over `--batch` pairs, with the frozen reference's logprobs computed
for them on both sides (posttrain's `reference_logprobs` phase, TRL's reference forward inside
its loss). Seconds per step: posttrain's `step_time_s` minus its validation (none here), TRL's
time between `on_step_begin` and `on_step_end`; the first step (warm-up) excluded on both sides.
Default model: stories260K converted from ../shared/data; data: the LLaMA-Factory DPO demo pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from trl_timing import alpaca_template, report, step_timer, stories260k

BETA, LR = 0.1, 1e-4


def data_overrides(shared: Path, max_len: int) -> list[str]:
    return [f"data.dataset_name={shared / 'llamafactory_demo' / 'dpo_en_demo.json'}", "data.truncation=truncate",
            f"policy.max_total_sequence_length={max_len}"]


def posttrain_seconds(model: str, steps: int, batch: int, max_len: int, shared: Path, work: Path,
                      precision: str) -> list[float]:
    import torch

    from posttrain.algorithms import dpo
    from posttrain.config import load_config

    cfg = load_config("dpo", None, [
        f"policy.model_name={model}", *data_overrides(shared, max_len), f"policy.precision={precision}",
        f"policy.train_global_batch_size={batch}", f"policy.train_micro_batch_size={batch}",
        f"policy.logprob_batch_size={batch}",
        # TRL runs in this process with torch's default threads (one per core): the worker gets as many.
        f"cluster.cpus_per_worker={torch.get_num_threads()}",
        f"dpo.max_num_steps={steps}", "dpo.max_num_epochs=100", "dpo.val_period=0", "dpo.val_at_start=false",
        "dpo.val_at_end=false", f"dpo.reference_policy_kl_penalty={BETA}", "checkpointing.enabled=false",
        f"logger.log_dir={work}/posttrain", "logger.console_enabled=false", "logger.plots_enabled=false",
        f"policy.optimizer.kwargs={{lr: {LR}, weight_decay: 0.0}}",
    ])
    cfg.policy.tokenizer.chat_template = alpaca_template()
    dpo.run(cfg)
    recs = [json.loads(x) for x in open(work / "posttrain" / "metrics.jsonl")]
    return [r["step_time_s"] for r in recs if r["prefix"] == "train"][1:]  # the first step warms up


def trl_seconds(model: str, steps: int, batch: int, max_len: int, shared: Path, work: Path,
                precision: str) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from posttrain.config import load_config
    from posttrain.data.datasets import load_rows
    from posttrain.data.processors import load_tokenizer, process_preference_rows

    cfg = load_config("dpo", None, [f"policy.model_name={model}", *data_overrides(shared, max_len)])
    tok = load_tokenizer(cfg.policy.tokenizer.model_copy(update={"name": model,
                                                                "chat_template": alpaca_template()}))
    pairs, _ = process_preference_rows(load_rows(cfg.data, "train"), tok, cfg.data, max_len)
    rows = []
    for chosen, rejected in pairs:  # the shared prompt, then each side's response tokens
        start = chosen["loss_mask"].index(1)
        rows.append({"prompt_ids": chosen["input_ids"][:start], "chosen_ids": chosen["input_ids"][start:],
                     "rejected_ids": rejected["input_ids"][start:]})

    timer = step_timer()
    args = DPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=batch, max_steps=steps, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, beta=BETA, max_length=max_len * 2,
        bf16=precision == "bfloat16", gradient_checkpointing=False,  # TRL's default is on; posttrain's off
        report_to=[], save_strategy="no", logging_steps=1000, use_cpu=True, dataloader_num_workers=0, seed=0,
    )
    # The rows are tokenized already (posttrain's ids): TRL's own tokenization of text is skipped.
    DPOTrainer._prepare_dataset = lambda self, dataset, *a, **k: dataset
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
    trainer.train()
    return timer.seconds()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model folder (default: stories260K converted from shared data)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--precision", choices=["bfloat16", "float32"], default="bfloat16",
                   help="both sides: posttrain's policy.precision, TRL's bf16 autocast or not")
    p.add_argument("--out", default=None, help="append a markdown table of the results to this file")
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from posttrain.data.datasets import shared_data_dir

    shared = shared_data_dir()
    work = Path(tempfile.mkdtemp(prefix="dpo_vs_trl-"))
    model = a.model or stories260k(work)
    ours = posttrain_seconds(model, a.steps, a.batch, a.max_len, shared, work, a.precision)
    theirs = trl_seconds(model, a.steps, a.batch, a.max_len, shared, work, a.precision)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    table = (f"{a.precision}, {a.batch} pairs per step, {a.steps} steps, the first excluded:\n\n"
             "| | median s/step | steps (s) |\n|---|---|---|\n"
             f"| posttrain | **{mo:.3f}** | {', '.join(f'{x:.3f}' for x in ours)} |\n"
             f"| TRL DPOTrainer | **{mt:.3f}** | {', '.join(f'{x:.3f}' for x in theirs)} |\n\n"
             f"**Ratio TRL / posttrain: {mt / mo:.2f}x**\n")
    report(table, a.out)
    shutil.rmtree(work, ignore_errors=True)  # the converted model and both sides' run folders


if __name__ == "__main__":
    main()
