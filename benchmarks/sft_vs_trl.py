"""SFT training throughput: posttrain (`posttrain.algorithms.sft`, Ray + FSDP2 worker) against
TRL's SFTTrainer on the same model, the same tokenized rows (posttrain's tokenization, loss on
assistant tokens only) and the same batch, with sequence packing on and off.

    python benchmarks/sft_vs_trl.py --steps 20 --batch 16 [--model DIR] [--out benchmarks/results/sft_vs_trl.md]

Tokens/s = tokens in the trained rows (padding excluded) / seconds spent in the optimizer
steps (posttrain: the `training` phase of each step; TRL: `train_runtime` minus the first
step, which both sides spend warming up). Default model: stories260K converted from
../shared/data; data: the Alpaca demo rows that fit in `--max-len`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from trl_timing import alpaca_template, report, step_timer, stories260k



def posttrain_tokens_per_s(model: str, steps: int, batch: int, max_len: int, packing: bool, work: Path) -> float:
    import torch

    from posttrain.algorithms import sft
    from posttrain.config import load_config

    pack = [f"policy.sequence_packing.enabled={str(packing).lower()}",
            f"policy.sequence_packing.train_mb_tokens={max_len * 4}",
            f"policy.sequence_packing.logprob_mb_tokens={max_len * 4}"]
    cfg = load_config("sft", None, [
        f"policy.model_name={model}", "data.dataset_name=alpaca", f"policy.max_total_sequence_length={max_len}",
        f"policy.train_global_batch_size={batch}", f"policy.train_micro_batch_size={batch}",
        # TRL runs in this process with torch's default threads (one per core): the worker gets as many.
        f"cluster.cpus_per_worker={torch.get_num_threads()}",
        f"sft.max_num_steps={steps}", "sft.max_num_epochs=100", "sft.val_period=0", "sft.val_at_start=false",
        "checkpointing.enabled=false", f"logger.log_dir={work}/posttrain-{packing}", "logger.console_enabled=false",
        "logger.plots_enabled=false", "policy.optimizer.kwargs={lr: 1.0e-4, weight_decay: 0.0}", *pack,
    ])
    cfg.policy.tokenizer.chat_template = alpaca_template()
    sft.run(cfg)
    recs = [json.loads(x) for x in open(work / f"posttrain-{packing}" / "metrics.jsonl")]
    train = [r for r in recs if r["prefix"] == "train"][1:]  # the first step warms up
    return sum(r["num_tokens"] for r in train) / sum(r["timing/training"] for r in train)


def trl_tokens_per_s(model: str, steps: int, batch: int, max_len: int, packing: bool, work: Path) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from posttrain.data.datasets import load_rows
    from posttrain.data.processors import load_tokenizer, process_sft_rows
    from posttrain.schemas import DataConfig, TokenizerConfig

    tok = load_tokenizer(TokenizerConfig(name=model, chat_template=alpaca_template()))
    examples, _ = process_sft_rows(load_rows(DataConfig(dataset_name="alpaca"), "train"), tok, DataConfig(), max_len)
    ds = Dataset.from_list([{"input_ids": e["input_ids"], "completion_mask": e["loss_mask"]} for e in examples])

    timer = step_timer()
    args = SFTConfig(
        output_dir=str(work / f"trl-{packing}"), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.0, packing=packing,
        max_length=max_len if not packing else max_len * 4,
        gradient_checkpointing=False,  # TRL's default is on (a forward recomputed in every backward); posttrain's off
        completion_only_loss=True, report_to=[], save_strategy="no", logging_steps=1000, use_cpu=True,
        dataloader_num_workers=0, seed=0,
    )
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=args,
                         train_dataset=ds, processing_class=tok, callbacks=[timer])
    tokens = []
    orig = trainer.training_step

    def counting_step(model, inputs, *a, **k):
        tokens.append(int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else int(inputs["input_ids"].numel()))
        return orig(model, inputs, *a, **k)

    trainer.training_step = counting_step
    trainer.train()
    step_times = timer.seconds()
    return sum(tokens[1:]) / sum(step_times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model folder (default: stories260K converted from shared data)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--out", default=None, help="append a markdown table of the results to this file")
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = Path(tempfile.mkdtemp(prefix="sft_vs_trl-"))
    model = a.model or stories260k(work)
    rows = []
    for packing in (False, True):
        ours = posttrain_tokens_per_s(model, a.steps, a.batch, a.max_len, packing, work)
        theirs = trl_tokens_per_s(model, a.steps, a.batch, a.max_len, packing, work)
        rows.append(f"| {'on' if packing else 'off'} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}x |")
        print(rows[-1], flush=True)
    table = ("| packing | posttrain tokens/s | TRL SFTTrainer tokens/s | ratio |\n|---|---|---|---|\n"
             + "\n".join(rows) + "\n")
    report(table, a.out)
    shutil.rmtree(work, ignore_errors=True)  # the converted model and both sides' run folders


if __name__ == "__main__":
    main()
