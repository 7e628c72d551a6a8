"""Training throughput of the FSDP2 policy: tokens/s and model-FLOPs utilization (MFU).

    python benchmarks/train_throughput.py [--models 1m,30m] [--workers 1,2] [--packing off,on]
                                          [--precisions float32,bfloat16] [--compile off] [--steps 3] [--out FILE]

Each configuration builds a real `Policy` (Ray workers, FSDP2, gloo) on an embedded model and
times `--steps` optimizer steps (after one warm-up step, timed apart: with `--compile on`
(`policy.compile`) it holds the compiling) on the same random batch of variable-length
sequences. MFU = model FLOPs / (time x matmul peak), where

    model FLOPs = 6 * params * tokens + 12 * layers * hidden * sum_i len_i^2

(forward + backward of every weight matmul, plus attention scores and values per sequence,
PaLM appendix B; padding tokens are not counted, so padding waste shows up as lower MFU)
and the peak is torch.matmul of 2048x2048 in the same dtype, measured in this run with as
many threads as the workers use together.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Per model: global batch rows, micro-batch rows, (min, max) sequence length, packing token budget.
WORKLOADS = {"1m": (16, 4, (32, 256), 1024), "30m": (8, 2, (16, 128), 512)}


def matmul_peak(dtype: torch.dtype, threads: int, n: int = 2048, seconds: float = 1.5) -> float:
    """Best FLOP/s of an n x n matmul with `threads` threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    torch.set_num_threads(prev)
    return best


def make_batch(rows: int, lengths: tuple[int, int], seq: int, seed: int = 0):
    from posttrain.data.batch import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=g)
    ids = torch.randint(8, 90, (rows, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    ids[pos >= lens.unsqueeze(1)] = 0
    mask = ((pos >= 1) & (pos < lens.unsqueeze(1))).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(rows))


def model_flops(n_params: int, layers: int, hidden: int, lengths: torch.Tensor) -> float:
    tokens = float(lengths.sum())
    return 6.0 * n_params * tokens + 12.0 * layers * hidden * float((lengths.double() ** 2).sum())


def run(args) -> list[dict]:
    import ray
    from transformers import AutoConfig

    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.embedded import resolve_model_path
    from posttrain.losses.nll import NLLLoss
    from posttrain.policy.lm_policy import Policy
    from posttrain.schemas import ClusterConfig, PolicyConfig

    workers_list = [int(w) for w in args.workers.split(",")]
    ray.init(num_cpus=max(workers_list), include_dashboard=False, log_to_driver=False)
    peaks = {(p, w): matmul_peak(DTYPES[p], w) for p in args.precisions.split(",") for w in workers_list}
    rows = []
    for model in args.models.split(","):
        path = resolve_model_path(f"embedded:{model}")
        hf = AutoConfig.from_pretrained(path)
        gbs, mbs, lengths, budget = WORKLOADS[model]
        batch = make_batch(gbs, lengths, lengths[1])
        for workers in workers_list:
            cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, cpus_per_worker=1), name="bench")
            for precision in args.precisions.split(","):
                for packing, compiled in itertools.product(args.packing.split(","), args.compile.split(",")):
                    cfg = PolicyConfig(
                        model_name=f"embedded:{model}", train_global_batch_size=gbs, train_micro_batch_size=mbs,
                        max_total_sequence_length=lengths[1], precision=precision,
                        sequence_packing={"enabled": packing == "on", "train_mb_tokens": budget,
                                          "logprob_mb_tokens": budget, "sequence_length_round": 16},
                        optimizer={"name": "adamw", "kwargs": {"lr": 1e-4}},
                        compile={"enabled": compiled == "on"},
                    )
                    policy = Policy(cluster, cfg, init_reference=False, name_prefix="bench")
                    t0 = time.perf_counter()
                    policy.train(batch, NLLLoss())  # warm-up
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        policy.train(batch, NLLLoss())
                    dt = (time.perf_counter() - t0) / args.steps
                    policy.shutdown()
                    flops = model_flops(policy.num_parameters, hf.num_hidden_layers, hf.hidden_size,
                                        batch["input_lengths"])
                    row = dict(model=model, params_m=policy.num_parameters / 1e6, workers=workers,
                               precision=precision, packing=packing, compiled=compiled, first_s=first, step_s=dt,
                               tokens_per_s=float(batch["input_lengths"].sum()) / dt,
                               tflops=flops / dt / 1e12, mfu=flops / dt / peaks[(precision, workers)])
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
            cluster.shutdown()
    ray.shutdown()
    return rows, peaks


def _fmt_row(r: dict) -> str:
    return (f"| {r['model']} ({r['params_m']:.1f}M) | {r['workers']} | {r['precision']} | {r['packing']} | "
            f"{r['compiled']} | {r['first_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops'] * 1e3:,.1f} | {100 * r['mfu']:.1f}% |")


def _list_of(*allowed: str):
    """An argparse type: a comma-separated list of `allowed` values (anything else was taken as
    "off", or failed with a KeyError after Ray had started)."""
    def parse(text: str) -> str:
        bad = [v for v in text.split(",") if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: not one of {', '.join(allowed)}")
        return text
    return parse


def _worker_counts(text: str) -> str:
    if not all(v.isdigit() and int(v) > 0 for v in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text}: not a comma-separated list of worker counts (e.g. 1,2)")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1m,30m", type=_list_of(*WORKLOADS))
    p.add_argument("--workers", default="1,2", type=_worker_counts)
    p.add_argument("--packing", default="off,on", type=_list_of("off", "on"))
    p.add_argument("--precisions", default="float32,bfloat16", type=_list_of("float32", "bfloat16"))
    p.add_argument("--compile", default="off", type=_list_of("off", "on"), help="policy.compile: off, on or off,on")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args()
    t0 = time.time()
    rows, peaks = run(args)
    lines = [
        f"command: `python {' '.join(sys.argv)}`",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"load average at end {os.getloadavg()[0]:.1f}; wall time {time.time() - t0:.0f} s",
        "",
        "matmul peak (2048x2048, GFLOP/s): " + ", ".join(f"{p} x{w} threads: {v / 1e9:,.1f}" for (p, w), v in peaks.items()),
        "",
        "| model | workers | precision | packing | compile | first step s | step s | tokens/s | GFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[_fmt_row(r) for r in rows],
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
