"""What skipping the prompt's logits saves: GRPO train steps and log-prob passes with the
policy's LM head run only from the first trained token (`logits_to_keep`, the default) and
over every position, on a model with Qwen2.5's 151,936-token vocabulary.

    python benchmarks/prompt_logits.py [--prompt 300] [--completion 100] [--rows 8] [--reps 3]

One policy worker in this process (world size 1, gloo), the embedded `medium` body (256 hidden,
4 layers) with the large vocabulary, bf16, random tokens; the two settings alternate twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--completion", type=int, default=100)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29571"))
    torch.set_num_threads(os.cpu_count() or 1)

    from posttrain.data.batch import BatchedDataDict
    from posttrain.embedded import build_model, build_tokenizer
    from posttrain.losses import ClippedPGLoss
    from posttrain.policy.fsdp_worker import FSDPPolicyWorker
    from posttrain.schemas import PolicyConfig

    n, length = args.rows, args.prompt + args.completion
    with tempfile.TemporaryDirectory() as path:
        build_model("medium", vocab_size=args.vocab).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        worker = FSDPPolicyWorker(PolicyConfig(
            model_name=path, precision="bfloat16", max_total_sequence_length=length, train_global_batch_size=n,
            train_micro_batch_size=max(1, n // 2), logprob_batch_size=max(1, n // 2),
            prefix_sharing={"enabled": False}), init_reference=False)
        worker.setup()
        mask = (torch.arange(length) >= args.prompt).float().expand(n, -1).contiguous()
        g = torch.Generator().manual_seed(0)
        batch = BatchedDataDict(input_ids=torch.randint(8, 90, (n, length), generator=g),
                                input_lengths=torch.full((n,), length), token_mask=mask, sample_mask=torch.ones(n),
                                advantages=torch.randn(n, 1, generator=g) * mask,
                                generation_logprobs=torch.zeros(n, length), prev_logprobs=torch.zeros(n, length))
        loss = ClippedPGLoss({})
        results: dict[str, dict[str, list[float]]] = {}
        for keep in (True, False, True, False):
            name = "from the first trained token" if keep else "every position"
            worker._keeps_logits = keep  # the switch the worker sets from the model's forward signature
            worker.train(batch, loss, n)  # warm-up
            r = results.setdefault(name, {"train": [], "logprobs": []})
            for _ in range(args.reps):
                t0 = time.perf_counter()
                worker.train(batch, loss, n)
                r["train"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                worker.get_logprobs(batch)
                r["logprobs"].append(time.perf_counter() - t0)
    print(f"{n} rows x ({args.prompt} prompt + {args.completion} trained tokens), vocabulary {args.vocab:,}, "
          f"bf16, {torch.get_num_threads()} threads, {args.reps} x 2 timed calls each")
    print("| LM head over | train step (s), median | get_logprobs (s), median |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {statistics.median(r['train']):.2f} | {statistics.median(r['logprobs']):.2f} |")


if __name__ == "__main__":
    main()
