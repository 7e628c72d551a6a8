"""Activation memory of a training step under tensor parallelism, with and without sequence
parallelism (`policy.dtensor_cfg.sequence_parallel`).

    python benchmarks/sequence_parallel_memory.py [--model embedded:medium] [--rows 2] [--seq 256]
                                                  [--precisions float32,bfloat16]

Two policy workers (the worker class itself, one process per rank, gloo, tensor_parallel_size=2)
take one training step on `--rows` rows of `--seq` random tokens after a warm-up step; the bytes of
every distinct storage autograd saves for the backward (`saved_tensors_hooks`, parameters left
out, a DTensor counted by its local shard) are the step's activation memory on that rank. Memory,
not time: the CPU's allocator has no peak counter, and what sequence parallelism changes is what
the backward keeps.
"""

from __future__ import annotations

import argparse

import torch


def _rank(rank: int, args: argparse.Namespace, precision: str, sp: bool) -> tuple[int, float]:
    """One rank's (bytes saved for the backward, the step's loss)."""
    from torch.distributed.tensor import DTensor

    from posttrain.data.batch import BatchedDataDict
    from posttrain.losses.nll import NLLLoss
    from posttrain.policy.fsdp_worker import FSDPPolicyWorker
    from posttrain.schemas import PolicyConfig

    cfg = PolicyConfig(model_name=args.model, precision=precision, train_global_batch_size=args.rows,
                       train_micro_batch_size=args.rows, logprob_batch_size=args.rows,
                       max_total_sequence_length=args.seq, optimizer={"name": "sgd", "kwargs": {"lr": 0.1}},
                       make_sequence_length_divisible_by=2,
                       dtensor_cfg={"tensor_parallel_size": 2, "sequence_parallel": sp})
    worker = FSDPPolicyWorker(cfg, init_reference=False)
    worker.setup()
    ids = torch.randint(8, 60, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.full((args.rows,), args.seq),
                            token_mask=torch.ones(args.rows, args.seq), sample_mask=torch.ones(args.rows))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not isinstance(t, torch.nn.Parameter):
            saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    worker.train(batch, NLLLoss(), args.rows)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = worker.train(batch, NLLLoss(), args.rows)["loss"]
    return sum(saved.values()), loss


def measure(args: argparse.Namespace, precision: str, sp: bool) -> tuple[float, float]:
    """(MiB saved for the backward, the larger of the two ranks; the step's loss)."""
    from posttrain.distributed.local_ranks import run_local_ranks

    got = run_local_ranks(_rank, 2, args, precision, sp)
    return max(b for b, _ in got) / 2**20, got[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:medium")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precisions", default="float32,bfloat16")
    args = parser.parse_args()
    print(f"{args.model}, {args.rows} rows x {args.seq} tokens, tensor_parallel_size=2 (two gloo processes)")
    print("| precision | sequence_parallel | saved for backward per rank (MiB) | loss |")
    print("|---|---|---|---|")
    for precision in args.precisions.split(","):
        for sp in (False, True):
            mib, loss = measure(args, precision, sp)
            print(f"| {precision} | {str(sp).lower()} | {mib:.1f} | {loss:.6f} |", flush=True)


if __name__ == "__main__":
    main()
