"""posttrain GRPO vs TRL's GRPOTrainer on this CPU: seconds per step, and validation accuracy
against wall time, on the same model, data, batch shape and loss settings.

    python benchmarks/grpo_vs_trl.py                  # both parts (~25 min on 2 idle cores)
    python benchmarks/grpo_vs_trl.py --part speed     # embedded:30m, 16 x 8 x 64 tokens
    python benchmarks/grpo_vs_trl.py --part accuracy  # the quickstart's model and settings
    python benchmarks/grpo_vs_trl.py --part accuracy --seeds 42,1,2,3,4 --val-period 2   # 5 seed pairs
    python benchmarks/grpo_vs_trl.py --quick          # smoke run: tiny model, a few steps

Each side runs in its own fresh process, one after the other (never concurrently):
posttrain through its CLI (`posttrain grpo` with explicit overrides), TRL through this
script's `_trl` sub-command. Both get the same torch thread count.

Speed part: the embedded 30m model (~31M parameters, random weights), 16 prompts x 8
generations, every completion forced to the full 64 new tokens (posttrain:
`policy.generation.ignore_eos=true`; TRL: `min_new_tokens` = `max_new_tokens`, so EOS is
never sampled), no validation, no checkpoints, every row trained (posttrain
`policy.skip_zero_gradient_samples=false`: the random weights score 0 on every row, so every
row has a zero advantage and posttrain would otherwise skip the training passes). Reported: the median of the per-step wall
times, the first step (warm-up) excluded on both sides, and the step's matmul floor on this
machine (`matmul_floor`), which bounds the ratio any implementation could reach.

Accuracy part: the quickstart's model and hyper-parameters, read from
examples/configs/grpo_quickstart.yaml at run time and passed explicitly to both sides. Both
start from the SAME weights: the quickstart's SFT warm start is run once by posttrain's own
`grpo.setup` (`grpo.warmup_sft_steps`) and exported as an HF folder, so its time counts for
neither side. Validation = greedy accuracy on the same held-out rows every `val_period`
steps and before the first step (TRL: a callback running `model.generate` greedily).
Validation time is EXCLUDED from the wall time of both sides: the x axis is the cumulative
training-step time (posttrain: `train/step_time_s - timing/validation`; TRL: the time
between step ends minus the callback's evaluation time). Process start-up (Ray, model
load) is excluded too and reported separately.

Matched settings (GRPO, both sides): group-mean baseline (posttrain
`grpo.use_leave_one_out_baseline=false`, as TRL has no leave-one-out) and per-group std
normalisation; token-level loss averaged over all valid tokens of the batch (posttrain
`loss_fn.token_level_loss=true`, TRL `loss_type="dapo"`); ratio clipped to
[1 - eps_low, 1 + eps_high]; no KL (beta 0, no reference model); the same rows per optimizer
step (speed part: one step per batch; accuracy part: the quickstart's
`policy.train_global_batch_size`; TRL `per_device_train_batch_size` = those rows,
`steps_per_generation` = rollouts / rows, no gradient accumulation, `num_iterations=1`; with
several steps per batch both sides compute the pre-update log-probs in an extra pass); AdamW
with the same lr/betas/weight decay, constant LR, grad-norm clip; temperature 1, top-p 1, no
top-k; the same precision (`--precision`, float32 by default; the accuracy part takes the
quickstart's; TRL `bf16=True` for bfloat16); no activation (gradient) checkpointing (TRL's
configs turn it on by default; runs before 2026-12-02 had it on for TRL). Reward: exact match of the stripped completion
against the row's answer (posttrain's arithmetic environment; TRL: a reward function doing
the same). Prompts: posttrain's arithmetic rows rendered by the tokenizer's chat template
(identical token ids on both sides; checked at TRL start-up).

Results: benchmarks/results/grpo_vs_trl.md (each part's block between its `generated`
markers is rewritten by a run of that part) and grpo_vs_trl_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "configs" / "grpo_quickstart.yaml"
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Settings:
    """Everything both sides share; one instance drives one posttrain run and one TRL run."""

    name: str
    model_path: str
    steps: int
    num_prompts: int
    num_generations: int
    max_new_tokens: int
    ignore_eos: bool
    max_total_sequence_length: int
    lr: float
    betas: list[float]
    weight_decay: float
    max_grad_norm: float
    clip_low: float
    clip_high: float
    temperature: float
    val_period: int  # 0: no validation
    num_val: int
    # posttrain's `data` section (DataConfig fields): both sides load rows through posttrain.data
    data: dict[str, Any]
    seed: int
    threads: int
    # Rows per optimizer step (posttrain policy.train_global_batch_size, TRL
    # per_device_train_batch_size with steps_per_generation = rollouts / this); null: all rollouts.
    train_batch: int | None = None
    # float32, or bfloat16 (posttrain policy.precision; TRL bf16=True autocast, both the defaults).
    precision: str = "float32"
    # TRL's model attention kernel (`attn_implementation`); null: transformers' default (sdpa).
    # posttrain's default on CPU is eager (policy.attn_implementation=auto), faster for training here.
    trl_attn: str | None = None
    # posttrain policy.skip_zero_gradient_samples: leave the rows of groups with one reward for all
    # their samples out of the training passes (exact; TRL trains them). Off in the speed part,
    # whose random-weight model scores 0 on every row: there it would leave nothing to train.
    skip_zero_gradient_samples: bool = True
    # posttrain-only extras from the quickstart (its own tuning: placement, batch splits)
    posttrain_config: str | None = None
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- settings


def speed_settings(quick: bool, steps: int, precision: str) -> Settings:
    from posttrain.embedded import resolve_model_path
    from posttrain.schemas import DataConfig

    return Settings(
        name="speed",
        model_path=resolve_model_path("embedded:tiny" if quick else "embedded:30m"),
        steps=3 if quick else steps,
        num_prompts=16, num_generations=8,
        max_new_tokens=16 if quick else 64, ignore_eos=True,
        max_total_sequence_length=128,
        lr=1e-5, betas=[0.9, 0.999], weight_decay=0.0, max_grad_norm=1.0,
        clip_low=0.2, clip_high=0.2, temperature=1.0, val_period=0,
        num_val=200, seed=42, threads=2, precision=precision, skip_zero_gradient_samples=False,
        data=DataConfig(dataset_name="arithmetic", num_digits=2, operations=["+"], num_train=20000, num_val=200,
                        seed=42).model_dump(mode="json"),
    )


def accuracy_settings(quick: bool, steps: int | None) -> tuple[Settings, Any]:
    """The quickstart's values (resolved config), and the config itself for the warm start."""
    from posttrain.config import load_config

    cfg = load_config("grpo", QUICKSTART)
    p, g, d = cfg.policy, cfg.grpo, cfg.data
    kw = p.optimizer.kwargs
    notes = []
    if p.optimizer.name.lower() not in ("adamw", "torch.optim.adamw"):
        notes.append(f"quickstart optimizer {p.optimizer.name!r}; TRL runs AdamW")
    if p.scheduler:
        notes.append("the quickstart sets an LR scheduler; both sides here run a constant LR")
    for flag in ("use_dynamic_sampling", "overlong_filtering"):
        if getattr(g, flag):
            notes.append(f"quickstart grpo.{flag}=true has no TRL equivalent; turned off on both sides")
    if g.reward_shaping.enabled or g.reward_scaling.enabled:
        notes.append("quickstart reward shaping/scaling turned off on both sides (no TRL equivalent)")
    if g.use_leave_one_out_baseline:
        notes.append("quickstart uses the leave-one-out baseline; both sides here use the group mean (TRL has no LOO)")
    if cfg.loss_fn.reference_policy_kl_penalty:
        notes.append("quickstart has a KL penalty; both sides here run beta=0")
    s = Settings(
        name="accuracy",
        model_path="",  # the warm-started folder, filled in by run_accuracy
        steps=4 if quick else (steps or g.max_num_steps),
        num_prompts=g.num_prompts_per_step, num_generations=g.num_generations_per_prompt,
        max_new_tokens=p.generation.max_new_tokens, ignore_eos=False,
        max_total_sequence_length=p.max_total_sequence_length,
        lr=float(kw.get("lr", 1e-3)), betas=list(kw.get("betas", [0.9, 0.999])),
        weight_decay=float(kw.get("weight_decay", 0.0)), max_grad_norm=p.max_grad_norm or 0.0,
        clip_low=cfg.loss_fn.ratio_clip_min, clip_high=cfg.loss_fn.ratio_clip_max,
        temperature=p.generation.temperature, val_period=2 if quick else g.val_period,
        num_val=min(d.num_val, g.max_val_samples), data=d.model_dump(mode="json"), seed=g.seed,
        threads=max(1, int(cfg.cluster.cpus_per_worker)), train_batch=p.train_global_batch_size,
        precision=p.precision, posttrain_config=str(QUICKSTART), notes=notes,
    )
    return s, cfg


# ----------------------------------------------------------------------------- posttrain side


def posttrain_command(s: Settings, log_dir: Path) -> list[str]:
    ov = {
        "policy.model_name": s.model_path,
        "grpo.num_prompts_per_step": s.num_prompts,
        "grpo.num_generations_per_prompt": s.num_generations,
        "grpo.max_num_steps": s.steps,
        "grpo.warmup_sft_steps": 0,
        "grpo.adv_estimator": "grpo",
        "grpo.use_leave_one_out_baseline": "false",
        "grpo.normalize_rewards": "true",
        "grpo.use_dynamic_sampling": "false",
        "grpo.overlong_filtering": "false",
        "grpo.reward_shaping.enabled": "false",
        "grpo.reward_scaling.enabled": "false",
        "grpo.val_period": s.val_period,
        "grpo.val_at_start": "true" if s.val_period else "false",
        "grpo.val_at_end": "false",
        "grpo.val_greedy": "true",
        "grpo.num_val_generations_per_prompt": 1,
        "grpo.max_val_samples": s.num_val,
        "grpo.val_batch_size": s.num_val,
        "grpo.seed": s.seed,
        "loss_fn.reference_policy_kl_penalty": 0.0,
        "loss_fn.ratio_clip_min": s.clip_low,
        "loss_fn.ratio_clip_max": s.clip_high,
        "loss_fn.token_level_loss": "true",
        "policy.train_global_batch_size": s.train_batch or s.num_prompts * s.num_generations,
        "policy.train_micro_batch_size": s.train_batch or s.num_prompts * s.num_generations,
        "policy.logprob_batch_size": s.num_prompts * s.num_generations,
        "policy.max_total_sequence_length": s.max_total_sequence_length,
        "policy.precision": s.precision,
        "policy.skip_zero_gradient_samples": "true" if s.skip_zero_gradient_samples else "false",
        "policy.max_grad_norm": s.max_grad_norm,
        "policy.optimizer.name": "torch.optim.AdamW",
        "policy.optimizer.kwargs": json.dumps({"lr": s.lr, "weight_decay": s.weight_decay, "betas": s.betas}),
        "policy.scheduler": "[]",
        "policy.generation.max_new_tokens": s.max_new_tokens,
        "policy.generation.ignore_eos": "true" if s.ignore_eos else "false",
        "policy.generation.temperature": s.temperature,
        "policy.generation.top_p": 1.0,
        "policy.generation.top_k": "null",
        "cluster.num_nodes": 1,
        "cluster.workers_per_node": 1,
        "cluster.cpus_per_worker": s.threads,
        "checkpointing.enabled": "false",
        "checkpointing.checkpoint_must_save_by": "null",  # the same step count on both sides, whatever the time
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "logger.num_val_samples_to_print": 0,
    }
    ov.update({f"data.{k}": "null" if v is None else json.dumps(v) for k, v in s.data.items()})
    cmd = [str(Path(sys.executable).with_name("posttrain")), "grpo"]
    if s.posttrain_config:
        cmd += ["--config", s.posttrain_config]
    return cmd + [f"{k}={v}" for k, v in ov.items()]


def read_posttrain(log_dir: Path) -> dict[str, Any]:
    """Per-step training time (validation excluded) and the validation curve from metrics.jsonl."""
    steps, val = [], []
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["prefix"] == "train" and "step_time_s" in rec:
            steps.append({
                "step": rec["step"], "step_time_s": rec["step_time_s"],
                "train_time_s": rec["step_time_s"] - rec.get("timing/validation", 0.0),
                "timing": {k[len("timing/"):]: v for k, v in rec.items() if k.startswith("timing/")},
                "reward": rec.get("reward"),
                "model_tokens": rec.get("model_tokens"),
            })
        elif rec["prefix"] == "val" and "accuracy" in rec:
            val.append({"step": rec["step"], "accuracy": rec["accuracy"]})
    return {"steps": steps, "val": val}


# ----------------------------------------------------------------------------- TRL side


def exact_match(completion: str, answer: str) -> float:
    """posttrain's arithmetic reward (env.arithmetic, strip_response=true): 1 if equal after strip."""
    return float(completion.strip() == answer.strip())


def trl_worker(s: Settings, out_dir: Path) -> None:
    """One TRL GRPOTrainer run (in this process); writes <out_dir>/trl_metrics.jsonl."""
    import torch

    torch.set_num_threads(s.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.datasets import load_rows
    from posttrain.rollouts import render_prompt
    from posttrain.schemas import DataConfig

    tok = AutoTokenizer.from_pretrained(s.model_path)
    data_cfg = DataConfig(**s.data)
    train_rows, val_rows = load_rows(data_cfg, "train"), load_rows(data_cfg, "validation")[: s.num_val]

    def prompt_ids(row: dict) -> list[int]:
        return render_prompt(tok, row["messages"], add_bos=data_cfg.add_bos)

    # posttrain's prompt ids (chat template, BOS rule) as text; TRL tokenizes it back with tokenizer(text).
    train_ds = Dataset.from_list([{"prompt": tok.decode(prompt_ids(r)), "answer": r["answer"]} for r in train_rows])
    for r, text in zip(train_rows[:8], train_ds["prompt"][:8]):
        if tok(text)["input_ids"] != prompt_ids(r):
            raise RuntimeError(f"TRL and posttrain tokenize the prompt of {r['messages']} differently")

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    log = open(out_dir / "trl_metrics.jsonl", "w", buffering=1)
    val_prompts = [prompt_ids(r) for r in val_rows]

    @torch.no_grad()
    def evaluate(model) -> float:
        """Greedy accuracy on the held-out rows: one left-padded batch, stop at EOS."""
        was_training = model.training
        model.eval()
        width = max(map(len, val_prompts))
        ids = torch.full((len(val_prompts), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(val_prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=s.max_new_tokens,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        model.train(was_training)
        return sum(exact_match(t, r["answer"]) for t, r in zip(texts, val_rows)) / len(val_rows)

    n = s.num_prompts * s.num_generations
    per_step = s.train_batch or n
    k = n // per_step  # TRL counts optimizer steps; a GRPO step (one batch of rollouts) is k of them

    class Timing(TrainerCallback):
        """Per-GRPO-step wall time between the ends of every k-th optimizer step, with this
        callback's evaluation time taken out."""

        def __init__(self) -> None:
            self.last = 0.0

        def _eval(self, step: int, model) -> float:
            t0 = time.perf_counter()
            acc = evaluate(model)
            dt = time.perf_counter() - t0
            log.write(json.dumps({"kind": "val", "step": step, "accuracy": acc, "eval_time_s": dt}) + "\n")
            return dt

        def on_train_begin(self, args, state, control, model=None, **kw):
            if s.val_period:
                self._eval(0, model)
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % k:
                return
            step = state.global_step // k
            now = time.perf_counter()
            log.write(json.dumps({"kind": "train", "step": step, "train_time_s": now - self.last}) + "\n")
            if s.val_period and step % s.val_period == 0:
                self._eval(step, model)
            self.last = time.perf_counter()

    gen_kwargs = {"min_new_tokens": s.max_new_tokens} if s.ignore_eos else None
    args = GRPOConfig(
        output_dir=str(out_dir / "trl_out"),
        max_steps=s.steps * k,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=k,  # optimizer steps per batch of rollouts
        num_generations=s.num_generations,
        num_iterations=1,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=1.0, top_k=0,
        generation_kwargs=gen_kwargs,
        learning_rate=s.lr, adam_beta1=s.betas[0], adam_beta2=s.betas[1], weight_decay=s.weight_decay,
        optim="adamw_torch", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=s.max_grad_norm,
        beta=0.0, epsilon=s.clip_low, epsilon_high=s.clip_high,
        loss_type="dapo", scale_rewards="group",
        # TRL's configs default to gradient checkpointing (since TRL 1.x), which recomputes the
        # forward in every backward; posttrain's default (policy.activation_checkpointing) is off.
        gradient_checkpointing=False,
        use_cpu=True, bf16=s.precision == "bfloat16", fp16=False, seed=s.seed, data_seed=s.seed,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        remove_unused_columns=False, dataloader_num_workers=0, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        s.model_path, dtype=torch.float32, **({"attn_implementation": s.trl_attn} if s.trl_attn else {}))
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=train_ds, processing_class=tok,
        callbacks=[Timing()],
    )
    trainer.train()
    for rec in trainer.state.log_history:
        log.write(json.dumps({"kind": "trl_log", **{k: v for k, v in rec.items() if isinstance(v, (int, float))}}) + "\n")
    log.close()


def read_trl(out_dir: Path) -> dict[str, Any]:
    steps, val = [], []
    for line in (out_dir / "trl_metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            steps.append({"step": rec["step"], "train_time_s": rec["train_time_s"], "step_time_s": rec["train_time_s"]})
        elif rec["kind"] == "val":
            val.append({"step": rec["step"], "accuracy": rec["accuracy"]})
    return {"steps": steps, "val": val}


# ----------------------------------------------------------------------------- running


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` to completion with output in `log_path`; its wall time and the load around it."""
    print(f"  $ {shlex.join(cmd)[:200]}{' ...' if len(shlex.join(cmd)) > 200 else ''}", flush=True)
    load_before = load_average()
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"command failed (exit {rc}), log {log_path}:\n{tail}")
    return {"process_wall_s": wall, "load_before": load_before, "load_after": load_average()}


def subprocess_env(work: Path) -> dict[str, str]:
    """Environment of the runs. Ray starts its workers at nice 15 (`RAY_worker_niceness`), which
    on a CPU shared with other jobs hands most of the cores to them; the TRL process runs at
    nice 0, so posttrain's workers do too here (both sides compete for the CPU equally)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "RAY_worker_niceness": "0",
           "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", str(work / "ray"))}
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    return env


def run_pair(s: Settings, work: Path) -> dict[str, Any]:
    """posttrain, then TRL, on settings `s` (sequentially, fresh processes)."""
    work.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(work)
    pt_dir, trl_dir = work / "posttrain", work / "trl"
    trl_dir.mkdir(parents=True, exist_ok=True)
    if pt_dir.exists():
        (pt_dir / "metrics.jsonl").unlink(missing_ok=True)  # the logger appends
    pt_cmd = posttrain_command(s, pt_dir)
    settings_file = work / "settings.json"
    settings_file.write_text(json.dumps(asdict(s), indent=1))
    trl_cmd = [sys.executable, str(Path(__file__).resolve()), "_trl", str(settings_file), str(trl_dir)]
    print(f"[{s.name}] posttrain (load {load_average()})", flush=True)
    pt_proc = run_logged(pt_cmd, work / "posttrain.log", env)
    print(f"[{s.name}] TRL (load {load_average()})", flush=True)
    trl_proc = run_logged(trl_cmd, work / "trl.log", env)
    return {
        "settings": asdict(s),
        "posttrain": {**read_posttrain(pt_dir), **pt_proc, "command": shlex.join(pt_cmd)},
        "trl": {**read_trl(trl_dir), **trl_proc, "command": shlex.join(trl_cmd)},
    }


def warm_start_worker(out: Path, overrides: list[str]) -> None:
    """posttrain's quickstart SFT warm start (grpo.setup with grpo.warmup_sft_steps), exported as HF."""
    from posttrain.algorithms.grpo import setup
    from posttrain.config import load_config

    cfg = load_config("grpo", QUICKSTART, overrides)
    s = setup(cfg)
    try:
        s.policy.export_hf(out)
    finally:
        s.shutdown()


def run_accuracy(quick: bool, steps: int | None, work: Path, seeds: list[int] | None = None,
                 val_period: int | None = None, trl_attn: str | None = None) -> dict[str, Any]:
    """One warm start, then a posttrain/TRL pair per seed (`grpo.seed`; TRL `seed` and `data_seed`)."""
    s, cfg = accuracy_settings(quick, steps)
    s.trl_attn = trl_attn
    if val_period:
        s.val_period = val_period
    warm = work / "warm_start_hf"
    warm_steps = 20 if quick else cfg.grpo.warmup_sft_steps
    overrides = [
        f"grpo.warmup_sft_steps={warm_steps}", "checkpointing.enabled=false",
        f"logger.log_dir={work / 'warm_start'}", "logger.tensorboard_enabled=false", "grpo.val_at_start=false",
    ]
    work.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(work)
    print(f"[accuracy] warm start: {warm_steps} SFT steps of {cfg.policy.model_name} (posttrain grpo.setup)", flush=True)
    ws = run_logged([sys.executable, str(Path(__file__).resolve()), "_warm_start", str(warm), *overrides],
                    work / "warm_start.log", env)
    s.model_path = str(warm)
    runs = [run_pair(replace(s, seed=seed), work / f"seed_{seed}") for seed in (seeds or [s.seed])]
    return {"warm_start": {"model": cfg.policy.model_name, "sft_steps": warm_steps, "overrides": overrides, **ws},
            "runs": runs}


# ----------------------------------------------------------------------------- reporting


def matmul_floor(s: Settings, model_tokens: int) -> dict[str, float]:
    """Seconds that the linear layers alone of one GRPO step of `s` take on this machine: each
    weight matrix's matmul at the step's real shapes in `s.precision` on `s.threads` threads, best
    of 5, summed: training forward and backward (input and weight gradients) over
    `model_tokens` positions (posttrain's own count: each prompt once, prefix sharing), and
    generation (the prompts' prefill, then one decode matmul per new token over all rows).
    Attention, norms, activations, the optimizer and sampling come on top, so no implementation
    of the step can be faster than this on this CPU: TRL's step / this floor bounds the ratio."""
    import torch

    cfg = json.loads((Path(s.model_path) / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = hidden * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // cfg["num_attention_heads"]
    # (in, out, matrices of that shape in the model): q, o; k, v; gate, up; down per layer; the LM head.
    layers = cfg["num_hidden_layers"]
    shapes = [(hidden, hidden, 2 * layers), (hidden, kv, 2 * layers), (hidden, inter, 2 * layers),
              (inter, hidden, layers), (hidden, vocab, 1)]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[s.precision]
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def linears(rows: int, backward: bool) -> float:
        total = 0.0
        for n_in, n_out, count in shapes:
            x, w = torch.randn(rows, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
            t = best(partial(torch.nn.functional.linear, x, w))
            if backward:  # input gradient dy @ W, weight gradient dy^T @ x
                gy = torch.randn(rows, n_out, dtype=dtype)
                t += best(partial(torch.matmul, gy, w)) + best(partial(torch.matmul, gy.t(), x))
            total += t * count
        return total

    rows = s.num_prompts * s.num_generations
    prompt_tokens = max(model_tokens - rows * s.max_new_tokens, s.num_prompts)
    try:
        train = linears(model_tokens, backward=True)
        generation = linears(prompt_tokens, backward=False) + s.max_new_tokens * linears(rows, backward=False)
    finally:
        torch.set_num_threads(threads)
    return {"train_s": train, "generation_s": generation, "total_s": train + generation,
            "model_tokens": model_tokens}


def median_step(side: dict[str, Any]) -> float:
    times = [r["train_time_s"] for r in side["steps"][1:]]  # first step = warm-up, excluded
    return statistics.median(times) if times else float("nan")


def curve(side: dict[str, Any]) -> list[tuple[float, int, float]]:
    """(cumulative training seconds, step, accuracy) per validation point."""
    cum, t = {0: 0.0}, 0.0
    for r in side["steps"]:
        t += r["train_time_s"]
        cum[r["step"]] = t
    return [(cum[v["step"]], v["step"], v["accuracy"]) for v in side["val"] if v["step"] in cum]


def time_to(points: list[tuple[float, int, float]], threshold: float) -> tuple[float, int] | None:
    return next(((t, st) for t, st, a in points if a >= threshold), None)


def plot(acc: dict[str, Any], path: Path, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = acc["runs"]
    for side, style, color in (("posttrain", "o-", "tab:blue"), ("trl", "s--", "tab:orange")):
        for i, run in enumerate(runs):
            pts = curve(run[side])
            label = (f"{side} ({statistics.median(median_step(r[side]) for r in runs):.2f} s/step"
                     f"{f', {len(runs)} seeds' if len(runs) > 1 else ''})") if i == 0 else None
            ax.plot([p[0] for p in pts], [p[2] for p in pts], style, color=color, ms=3, lw=1,
                    alpha=1.0 if len(runs) == 1 else 0.6, label=label)
    ax.axhline(threshold, color="grey", lw=0.8, ls=":", label=f"quickstart target {threshold:.2f}")
    s = runs[0]["settings"]
    ax.set_xlabel("training wall time, s (validation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"GRPO from the SFT warm start of {acc['warm_start']['model']}, {s['num_prompts']}x{s['num_generations']}, "
                 f"{s['max_new_tokens']} new tokens")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> str:
    import torch
    import transformers
    import trl

    import posttrain

    return (f"posttrain {getattr(posttrain, '__version__', '?')}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl.__version__}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")


def settings_table(s: dict[str, Any]) -> list[str]:
    keys = ["model_path", "steps", "num_prompts", "num_generations", "max_new_tokens", "ignore_eos",
            "max_total_sequence_length", "lr", "betas", "weight_decay", "max_grad_norm", "clip_low", "clip_high",
            "temperature", "val_period", "num_val", "seed", "threads", "train_batch", "precision", "trl_attn",
            "skip_zero_gradient_samples"]
    data = {k: v for k, v in s["data"].items() if k in ("dataset_name", "num_digits", "operations", "num_train",
                                                         "seed", "add_bos", "zero_pad", "demo_carry_error_rate")}
    return ["| setting | value |", "|---|---|"] + [f"| {k} | `{s[k]}` |" for k in keys] + [f"| data | `{data}` |"]


def report(results: dict[str, Any], quick: bool) -> dict[str, str]:
    """Markdown per part ("speed", "accuracy") of `results`."""
    blocks = {}
    stamp = (f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
             f"{' (--quick smoke run: not a measurement)' if quick else ''}; {versions()}.")
    if "speed" in results:
        sp = results["speed"]
        pt, tr = median_step(sp["posttrain"]), median_step(sp["trl"])
        lines = ["### Speed: seconds per GRPO step", "", stamp, "",
                  f"{sp['settings']['num_prompts']} prompts x {sp['settings']['num_generations']} generations x "
                  f"{sp['settings']['max_new_tokens']} new tokens (all completions full length), "
                  f"`{Path(sp['settings']['model_path']).name}`, {sp['settings']['steps']} steps, first excluded.", "",
                  "| | median s/step | all steps (s) | process wall (s) | load avg before / after |",
                  "|---|---|---|---|---|"]
        for name, side, med in (("posttrain", sp["posttrain"], pt), ("TRL", sp["trl"], tr)):
            lines.append(f"| {name} | **{med:.2f}** | {', '.join(format(r['train_time_s'], '.2f') for r in side['steps'])} | "
                         f"{side['process_wall_s']:.0f} | {side['load_before']} / {side['load_after']} |")
        lines += ["", f"**Ratio TRL / posttrain: {tr / pt:.2f}x** (target >= 3x).", ""]
        if "floor" in sp:
            fl = sp["floor"]
            lines += [(f"**Matmul floor** (`matmul_floor`, measured right after the runs): the linear layers alone of "
                      f"one step take {fl['total_s']:.2f} s here (training forward + backward over "
                      f"{fl['model_tokens']:,} positions {fl['train_s']:.2f} s, generation {fl['generation_s']:.2f} s), "
                      f"so no implementation can beat this TRL run by more than **{tr / fl['total_s']:.2f}x** "
                      f"on this CPU; posttrain's step is {fl['total_s'] / pt:.0%} matmul."), ""]
        ph = [r["timing"] for r in sp["posttrain"]["steps"][1:]]
        if ph:
            top = [k for k in ph[0] if "/" not in k]
            lines += ["posttrain phase medians (s): " + ", ".join(
                f"{k} {statistics.median(t.get(k, 0.0) for t in ph):.2f}" for k in top), ""]
        lines += ["<details><summary>settings and commands</summary>", "", *settings_table(sp["settings"]), "",
                  "```", sp["posttrain"]["command"], sp["trl"]["command"], "```", "</details>"]
        blocks["speed"] = "\n".join(lines)
    if "accuracy" in results:
        ac = results["accuracy"]
        runs = ac["runs"]
        s = runs[0]["settings"]
        thr = ACC_TARGET
        seeds = [r["settings"]["seed"] for r in runs]
        lines = ["### Accuracy against wall time", "", stamp, "",
                  f"Quickstart settings ({Path(s['posttrain_config']).name}, {s['precision']}), from the same warm "
                  f"start ({ac['warm_start']['model']} + {ac['warm_start']['sft_steps']} SFT steps by posttrain, "
                  f"{ac['warm_start']['process_wall_s']:.0f} s, counted for neither side), {len(runs)} seed(s) "
                  f"({', '.join(map(str, seeds))}: posttrain `grpo.seed`, TRL `seed` and `data_seed`). Validation: "
                  f"greedy, {s['num_val']} held-out rows, every {s['val_period']} steps; validation time excluded "
                  "for both.", "", f"![accuracy vs wall time]({PLOT_NAME})", "",
                  f"| seed | side | median s/step | steps | training time (s) | process wall (s) | start acc | "
                  f"final acc | best acc | time to acc >= {thr} | load avg before / after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        ratios, step_ratios = [], []
        for run in runs:
            reach = {}
            for name, key in (("posttrain", "posttrain"), ("TRL", "trl")):
                side = run[key]
                pts = curve(side)
                reach[key] = r = time_to(pts, thr)
                lines.append(
                    f"| {run['settings']['seed']} | {name} | {median_step(side):.3f} | {len(side['steps'])} | "
                    f"{sum(x['train_time_s'] for x in side['steps']):.0f} | {side['process_wall_s']:.0f} | "
                    f"{pts[0][2]:.3f} | {pts[-1][2]:.3f} | {max(p[2] for p in pts):.3f} | "
                    f"{f'{r[0]:.1f} s (step {r[1]})' if r else 'not reached'} | "
                    f"{side['load_before']} / {side['load_after']} |")
            step_ratios.append(median_step(run["posttrain"]) / median_step(run["trl"]))
            if reach["posttrain"] and reach["trl"]:
                ratios.append(reach["posttrain"][0] / reach["trl"][0])
        lines += ["", f"posttrain / TRL median s/step: {', '.join(f'{x:.2f}' for x in step_ratios)} (per seed)."]
        if ratios:
            lines += ["", f"posttrain / TRL time to {thr}: {', '.join(f'{x:.2f}' for x in ratios)} (per seed where "
                          f"both reach it); **median {statistics.median(ratios):.2f}**, {sum(x <= 1 / 3 for x in ratios)} "
                          f"of {len(runs)} seeds <= 1/3 (target <= 0.33)."]
        lines += ["", "Validation points (training seconds, step, accuracy):", ""]
        for run in runs:
            for key in ("posttrain", "trl"):
                lines.append(f"- seed {run['settings']['seed']}, {key}: " + ", ".join(
                    f"({t:.1f}, {st}, {a:.2f})" for t, st, a in curve(run[key])))
        if s["notes"]:
            lines += ["", "Differences from the quickstart file: " + "; ".join(s["notes"]) + "."]
        lines += ["", "<details><summary>settings and commands (first seed)</summary>", "", *settings_table(s), "",
                  "```", runs[0]["posttrain"]["command"], runs[0]["trl"]["command"], "```", "</details>"]
        blocks["accuracy"] = "\n".join(lines)
    return blocks


ACC_TARGET = 0.9  # issue 5: the quickstart takes held-out accuracy to >= 0.9
PLOT_NAME = "grpo_vs_trl_accuracy.png"


def write_report(blocks: dict[str, str], path: Path) -> None:
    """Replace each part's generated block in `path` (created if missing), keeping the text around them."""
    text = path.read_text() if path.exists() else "# GRPO: posttrain vs TRL\n"
    for part, block in blocks.items():
        start, end = f"<!-- generated:{part}:start -->", f"<!-- generated:{part}:end -->"
        if start not in text:
            text += f"\n{start}\n{end}\n"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = f"{head}{start}\n{block}\n{end}{tail}"
    path.write_text(text)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        trl_worker(Settings(**json.loads(Path(sys.argv[2]).read_text())), Path(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_warm_start":
        warm_start_worker(Path(sys.argv[2]), sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["speed", "accuracy", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps (not a measurement)")
    # 10: posttrain's first 3-4 steps run slower than its steady state (30M bf16: 15.2, 8.2, 7.0 s,
    # then 5.8-6.8 s; cause not isolated), which a 5-step median over-weights.
    ap.add_argument("--speed-steps", type=int, default=10,
                    help="GRPO steps per side in the speed part (first excluded)")
    ap.add_argument("--accuracy-steps", type=int, default=None,
                    help="GRPO steps of the accuracy part (default: the quickstart's grpo.max_num_steps)")
    ap.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                    help="speed part: both sides' compute dtype (the accuracy part takes the quickstart's)")
    ap.add_argument("--seeds", default=None,
                    help="accuracy part: comma-separated seeds, one posttrain/TRL pair each from the same warm "
                         "start (default: the quickstart's grpo.seed)")
    ap.add_argument("--val-period", type=int, default=None,
                    help="accuracy part: validate every N steps (default: the quickstart's grpo.val_period); "
                         "validation time is excluded from both sides' wall time")
    ap.add_argument("--trl-attn", choices=["eager", "sdpa"], default=None,
                    help="TRL's attention kernel (default: transformers' default, sdpa; posttrain's CPU "
                         "default is eager)")
    ap.add_argument("--work-dir", default="/tmp/grpo_vs_trl", help="run folders and logs")
    ap.add_argument("--results-dir", default=None,
                    help=f"markdown and PNG (default: {RESULTS.relative_to(REPO)}; with --quick: <work-dir>/results)")
    args = ap.parse_args()
    work = Path(args.work_dir)
    out = Path(args.results_dir or (work / "results" if args.quick else RESULTS))
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {load_average()}", flush=True)
    results: dict[str, Any] = {}
    if args.part in ("speed", "all"):
        results["speed"] = sp = run_pair(replace(speed_settings(args.quick, args.speed_steps, args.precision),
                                                 trl_attn=args.trl_attn), work / "speed")
        tokens = statistics.median(r["model_tokens"] for r in sp["posttrain"]["steps"])
        sp["floor"] = matmul_floor(Settings(**sp["settings"]), int(tokens))
        print(f"speed: posttrain {median_step(results['speed']['posttrain']):.2f} s/step, "
              f"TRL {median_step(results['speed']['trl']):.2f} s/step", flush=True)
    if args.part in ("accuracy", "all"):
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
        results["accuracy"] = run_accuracy(args.quick, args.accuracy_steps, work / "accuracy", seeds, args.val_period,
                                           args.trl_attn)
        plot(results["accuracy"], out / PLOT_NAME, ACC_TARGET)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    blocks = report(results, args.quick)
    print("\n\n".join(blocks.values()))
    write_report(blocks, out / "grpo_vs_trl.md")
    print(f"wrote {out / 'grpo_vs_trl.md'}")


if __name__ == "__main__":
    main()
