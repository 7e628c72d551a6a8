"""The real GRPO entrypoint's variants for a few tiny steps: dynamic sampling, LoRA, warm-up SFT,
separate and HF-backend generation, async GRPO, the prev-logprob pass and its reuse, on-policy
distillation, and the checks that stop a bad setup. (Split from test_grpo.py so that the two
halves run in parallel under pytest-xdist's loadfile.)"""

import json
import logging
import math
import shutil

import pytest
import torch
from test_grpo_helpers import QUICKSTART, records, tiny_overrides

from posttrain.algorithms.grpo import run
from posttrain.config import load_config


def test_dynamic_sampling_rounds_and_weighted_reward_functions(ray_session, tmp_path):
    # Groups with an even answer all score 1 (no variance: dropped, so more rounds run); the
    # others score by response length. Each function's mean is logged, and the step's metrics
    # are means over every round's samples (they were summed over the rounds).
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def even(response, metadata):\n    return float(int(metadata['answer']) % 2 == 0)\n\n"
        "def odd_length(response, metadata):\n"
        "    return 0.0 if int(metadata['answer']) % 2 == 0 else (len(response) % 3) / 2\n"
    )
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=4", "data.task_name=mixed",
        f"env.mixed.target=[{rewards}:even,{rewards}:odd_length]", "env.mixed.reward_weights=[1.0,0.5]",
        "logger.num_samples_to_dump=1000",
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    # samples.jsonl holds every round's samples, which the step's reward is the mean of (it held the last round's).
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    for r in train:
        mine = [x for x in samples if x["step"] == r["step"]]
        assert len(mine) == 16 * r["dynamic_sampling/rounds"]
        assert r["reward"] == pytest.approx(sum(x["reward"] for x in mine) / len(mine))
    (val,) = records(tmp_path / "logs", "val")  # at the end
    assert val["reward"] == pytest.approx(val["reward/even"] + 0.5 * val["reward/odd_length"])
    assert max(r["dynamic_sampling/rounds"] for r in train) >= 2
    for r in train:
        assert r["turns_mean"] == 1.0 and 0.0 <= r["truncation_rate"] <= 1.0
        assert 0.0 <= r["reward/even"] <= 1.0 and 0.0 <= r["reward/odd_length"] <= 1.0
        assert r["reward"] == pytest.approx(r["reward/even"] + 0.5 * r["reward/odd_length"])


def test_a_kl_penalty_in_the_reward_comes_from_logprobs_taken_before_the_advantages(ray_session, tmp_path):
    # grpo.reward_kl_penalty subtracts beta * KL(pi_old || pi_ref) from each sample's reward, so the
    # reference and pre-update logprobs come before the advantages, for all of dynamic sampling's
    # rounds: their advantages are computed together, then cut to whole optimizer steps.
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def by_length(response, metadata):\n    return (len(response) % 4) / 3\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=3", "grpo.warmup_sft_steps=0", "grpo.val_period=0",
        "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
        "policy.precision=float32", "policy.optimizer.kwargs.lr=0.02", "grpo.reward_kl_penalty=0.5",
        "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=4", "data.task_name=by_length",
        f"env.by_length.target={rewards}:by_length"))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    # The reference is the starting policy: no KL before the first update, some after.
    assert train[0]["reward_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(train[2]["reward_kl"]) > 1e-3, train
    for r in train:
        assert r["loss"] == r["pg_loss"]  # the loss's KL term is off (kl_penalty reports it unweighted)
        assert "timing/logprobs/reference" in r and "timing/logprobs/prev" in r
        assert r["num_optimizer_steps"] == 2 and math.isfinite(r["loss"])


def test_dynamic_sampling_that_keeps_no_group_says_so_and_stops(ray_session, tmp_path, capsys):
    # Every sample scores 1: no group has reward variance. The run stopped with "no data left, or no
    # group with reward variance", which left the cause to guess.
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def one(response, metadata):\n    return 1.0\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2",
        "data.task_name=one", f"env.one.target={rewards}:one", "checkpointing.enabled=false",
    ))
    from posttrain.algorithms.grpo import DynamicSamplingExhausted

    # It fails (as NeMo RL's does), so that whatever launched it does not take it for a finished run.
    with pytest.raises(DynamicSamplingExhausted, match=r"step 1: dynamic sampling kept 0 samples in 2 generation "
                                                       r"rounds.*Raise grpo.dynamic_sampling_max_gen_batches"):
        run(cfg)
    assert ("step 1: dynamic sampling kept 0 samples in 2 generation rounds (grpo.dynamic_sampling_max_gen_batches), "
            "fewer than one optimizer step (policy.train_global_batch_size=8): the other groups' rewards were all "
            "equal; stopping") in " ".join(capsys.readouterr().out.split())  # the console wraps lines
    assert records(tmp_path / "logs", "train") == []


def test_a_run_stopped_by_dynamic_sampling_resumes_at_the_prompts_it_gave_up_on(ray_session, tmp_path):
    # Step 1's samples score apart, step 2's all alike: dynamic sampling gives up on step 2's
    # prompts, and the checkpoint of step 1 held the data position after them, so a resume with
    # more rounds (the error's advice) never generated them.
    from posttrain.algorithms.grpo import DynamicSamplingExhausted

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def first_step_only(response, metadata):\n"
                       "    return float(len(response) % 2) if metadata['_rollout']['global_step'] == 0 else 1.0\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=3", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=1",
        "grpo.num_generations_per_prompt=8", "data.task_name=one", f"env.one.target={rewards}:first_step_only",
        "checkpointing.save_period=10",
    ))
    with pytest.raises(DynamicSamplingExhausted, match="step 2: dynamic sampling kept 0 samples"):
        run(cfg)
    assert [r["step"] for r in records(tmp_path / "logs", "train")] == [1]
    info = json.loads((tmp_path / "ckpt" / "step_1" / "training_info.json").read_text())
    assert info["step"] == 1 and info["dataloader"]["served"] == 4  # step 1's 4 prompts, not step 2's too


def test_lora_grpo_generates_with_the_trained_adapters(ray_session, tmp_path):
    # Warm-up SFT moves the adapters; colocated generation must then sample from base + adapter
    # (merged at refit), so its logprobs agree with the policy's.
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.lora.enabled=true", "grpo.warmup_sft_steps=10", "grpo.warmup_sft_lr=5e-2",
        "grpo.max_num_steps=2",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
        "policy.optimizer.kwargs.lr=1e-2",
    ))
    run(cfg)
    warm = records(tmp_path / "logs", "warmup_sft")
    assert warm[-1]["loss"] < 4.5  # ln(104) = 4.64 for the untrained model: the adapters did learn
    for r in records(tmp_path / "logs", "train"):
        assert r["token_mult_prob_error"] < 1.01
        assert math.isfinite(r["loss"])


def test_warmup_sft_drops_and_counts_demonstrations_longer_than_the_context(ray_session, tmp_path, capsys):
    # The warm-up tokenizes its rows once, before its steps: a demonstration that does not fit the
    # context is dropped there (data.truncation=drop) and counted, and the warm-up trains on the rest.
    rows = [{"messages": [{"role": "user", "content": f"{i % 10}+{i % 7}="}], "task_name": "arithmetic",
             "answer": str(i % 10 + i % 7)} for i in range(40)]
    for r in rows[:6]:
        r["answer"] = "9" * 40  # prompt + this demonstration > the 32-token context
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    # A validation prompt longer than the context is dropped and counted too (it went uncounted).
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in [*rows[6:10], {**rows[6], "messages": [
        {"role": "user", "content": "1" * 40 + "+1="}]}]))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, f"data.train_data_path={train}", f"data.val_data_path={val}", "data.dataset_name=local",
        "grpo.warmup_sft_steps=3", "grpo.max_num_steps=1", "grpo.val_period=0", "grpo.val_at_start=true",
        "grpo.val_at_end=false", "checkpointing.enabled=false",
    ))
    run(cfg)
    # Step 0's validation line counts GRPO's steps, not the warm-up's (it said "0/3").
    assert any(line.startswith("val step 0/1 |") for line in capsys.readouterr().out.splitlines())
    (dropped,) = records(tmp_path / "logs", "data")
    assert (dropped["prompts_dropped_overlong"], dropped["val_prompts_dropped_overlong"]) == (0, 1)
    (counts,) = records(tmp_path / "logs", "data/warmup_sft")
    assert (counts["rows"], counts["kept"], counts["dropped"], counts["truncated"]) == (40, 34, 6, 0)
    warm = records(tmp_path / "logs", "warmup_sft")
    assert len(warm) == 1 and math.isfinite(warm[0]["loss"])  # logged at the last of its 3 steps


def test_a_warm_up_without_demonstrations_that_fit_fails_in_the_setup_naming_it(tmp_path):
    # It failed after Ray and the policy workers had started (~1 min), as "no rows left after
    # applying data.truncation", which named neither the warm-up nor grpo.warmup_sft_steps.
    from posttrain.algorithms.grpo import setup
    from posttrain.config import InputError

    cfg = load_config("grpo", QUICKSTART, tiny_overrides(tmp_path, "grpo.warmup_sft_steps=3", "data.num_train=50",
                                                         "policy.max_total_sequence_length=12"))
    with pytest.raises(InputError, match=r"^grpo.warmup_sft_steps=3: the warm-up SFT's demonstrations \(each training "
                                         r"prompt with its answer\): no rows left after .*; or set "
                                         r"grpo.warmup_sft_steps=0$"):
        setup(cfg)
    assert not (tmp_path / "logs").exists()  # before the logger (and Ray, the workers) started


# Extended (~30 s): GRPO's side of test_sft.py's test of the same name (its loop's own save).
@pytest.mark.extended
def test_a_misspelt_metric_name_found_at_the_first_validation_keeps_the_steps_before_it(ray_session, tmp_path):
    from posttrain.checkpoint import MetricNameError

    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=3", "grpo.val_at_start=false", "grpo.val_period=2", "grpo.warmup_sft_steps=0",
        "checkpointing.save_period=10", "checkpointing.metric_name=val:acuracy"))
    with pytest.raises(MetricNameError, match=r"checkpointing.metric_name='val:acuracy' is not a metric this run logs"):
        run(cfg)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_2"]


def test_separate_generation_workers_start_from_the_warmed_up_weights(ray_session, tmp_path):
    # Separate generation workers load the weights from disk; after the warm-up SFT they must be
    # refit before the first rollout, or step 1 samples from the untrained model. At a sampling
    # temperature, which the training logprobs take too (at 1 they were another distribution's).
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.generation.colocated.enabled=false", "grpo.warmup_sft_steps=10",
        "policy.generation.temperature=0.7",
        "grpo.warmup_sft_lr=5e-2", "grpo.max_num_steps=1", "grpo.val_period=0", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "checkpointing.enabled=false",
    ))
    run(cfg)
    (first,) = records(tmp_path / "logs", "train")
    assert first["token_mult_prob_error"] < 1.01
    assert first["gen_kl_error"] < 1e-4
    # The refit after the step is logged as docs/metrics.md says (it went to timing/refit only).
    assert 0 < first["refit_load_s"] <= first["refit_s"] <= first["timing/refit"]


def test_a_generation_worker_that_dies_in_the_refit_leaves_the_step_just_trained_saved(ray_session, tmp_path):
    # The refit ran before the step counted as complete, and only an environment's failure saved
    # it: step 3 (no save due, save_period=2) was lost with the generation worker.
    import ray

    from posttrain.algorithms import grpo
    from posttrain.distributed.worker_group import WorkerError

    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.generation.colocated.enabled=false", "grpo.warmup_sft_steps=0", "grpo.max_num_steps=5",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false"))
    s = grpo.setup(cfg)
    try:
        train, calls = s.policy.train, []

        def train_then_kill(*args, **kwargs):
            out = train(*args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                ray.kill(s.generation.workers.actors[0], no_restart=True)
            return out

        s.policy.train = train_then_kill
        with pytest.raises(WorkerError, match="generation worker rank 0 .* died"):
            grpo.grpo_train(s)
    finally:
        s.shutdown()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_2", "step_3"]


def test_colocated_generation_with_the_hf_backend_runs_a_model_the_torch_engine_cannot(ray_session, tmp_path):
    # The torch engine's error for such a model says "use policy.generation.backend=hf"; the
    # policy workers built the torch engine whatever the backend, so that failed the same way.
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    # GPT-2's dropout (0.1) stays in the model: GRPO turns it off (policy.disable_dropout) so
    # training logprobs are generation's.
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    overrides = [f"policy.model_name={tmp_path / 'gpt2'}", "grpo.warmup_sft_steps=0", "grpo.max_num_steps=1",
                 "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false"]
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(tmp_path, *overrides, "policy.generation.backend=hf"))
    # With the torch backend the driver refuses it from its config, before Ray and the workers
    # start (their error came 8-10 s in): the exact class, not Ray's wrapper of a worker's error.
    from posttrain.algorithms.grpo import setup
    from posttrain.generation.torch_engine import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not one of .*; use "
                                                    "policy.generation.backend=hf") as err:
        setup(load_config("grpo", QUICKSTART, tiny_overrides(tmp_path, *overrides, "policy.generation.backend=torch")))
    assert type(err.value) is UnsupportedModelError
    run(cfg)
    (first,) = records(tmp_path / "logs", "train")
    assert first["token_mult_prob_error"] < 1.01  # generated by the policy's own weights
    assert first["probs_ratio_max"] == pytest.approx(1.0, abs=1e-3)  # on-policy, no dropout noise


def _async(tmp_path, *extra):
    return load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.generation.colocated.enabled=false", "grpo.async_grpo.enabled=true",
        "grpo.prev_logprobs_from_generation=false", "loss_fn.use_importance_sampling_correction=true",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", *extra,
    ))


def _step_prompts(log_dir, step):
    samples = [json.loads(line) for line in (log_dir / "samples.jsonl").read_text().splitlines()]
    return sorted(s["prompt"] for s in samples if s["step"] == step)


# Per step: the trajectory age, and whether it logged a refit: before generating its rollouts, or
# for its validation (steps 2 and 4; that refit to step 2's weights serves step 4's rollouts at
# age 1, which need none of their own; it went unlogged, and with grpo.val_period=1 no step logged one).
@pytest.mark.parametrize("age, ages, refits", [(1, [0.0, 1.0, 1.0, 1.0], [False, True, True, True]),
                                               pytest.param(2, [0.0, 1.0, 2.0, 2.0], [False, True, False, True],
                                                            marks=pytest.mark.extended)])
def test_async_grpo_trains_on_rollouts_up_to_max_age_and_resumes_without_skipping_prompts(ray_session, tmp_path,
                                                                                          age, ages, refits):
    # Step 1 generates first; from then on up to `age` next steps' rollouts are queued (each with
    # the weights of the step that queued it) and generate while a step trains: trajectories up
    # to `age` updates old, corrected by importance sampling.
    run(_async(tmp_path / "a", "grpo.max_num_steps=4", "checkpointing.save_period=2", "grpo.val_period=2",
               f"grpo.async_grpo.max_trajectory_age_steps={age}"))
    train = records(tmp_path / "a" / "logs", "train")
    # Validation at step 2 waited for the queued rollouts and refit the workers first.
    assert [r["step"] for r in records(tmp_path / "a" / "logs", "val")] == [2, 4]
    assert [r["trajectory_age_steps"] for r in train] == ages
    assert ["refit_s" in r for r in train] == refits
    for r in train:
        assert math.isfinite(r["loss"]) and r["rollout_s"] > 0 and r["sampling_importance_ratio"] > 0
    if age == 1:
        return  # the resume below, with two steps' prompts queued at the save, covers one too (~15 s saved)
    # The step-2 checkpoint was saved while step 3's prompts were queued: resuming from it
    # generates those prompts again (the loader position before them was saved, not after).
    resumed = tmp_path / "b"
    (resumed / "ckpt").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "a" / "ckpt" / "step_2", resumed / "ckpt" / "step_2")
    run(_async(resumed, "grpo.max_num_steps=3", "checkpointing.save_period=2",
               f"grpo.async_grpo.max_trajectory_age_steps={age}"))
    (third,) = records(resumed / "logs", "train")
    assert third["trajectory_age_steps"] == 0.0  # generated afresh after the resume
    assert _step_prompts(resumed / "logs", 3) == _step_prompts(tmp_path / "a" / "logs", 3)
    assert _step_prompts(resumed / "logs", 3) != _step_prompts(tmp_path / "a" / "logs", 2)


def test_the_async_rollout_pipeline_closes_without_waiting_for_the_batch_in_generation():
    # After a stop or an error the batch in generation is thrown away: waiting for it took its whole
    # time past the checkpoint (24 s against 4 s synchronous in an audit), a second signal's too.
    import threading
    import time

    from posttrain.algorithms.grpo import _RolloutPipeline

    release = threading.Event()
    pipeline = _RolloutPipeline(depth=2, version=0)
    pipeline.submit(lambda: release.wait(30), [], 1, {})
    pipeline.submit(lambda: pytest.fail("a batch not started runs"), [], 2, {})
    start = time.monotonic()
    pipeline.close(wait=False)
    assert time.monotonic() - start < 1
    release.set()  # the thread ends; the one queued behind it never started
    pipeline._pool.shutdown(wait=True)


def test_async_grpo_config_needs(tmp_path):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"separate generation workers.*use_importance_sampling_correction=true"
                                          r".*prev_logprobs_from_generation=false"):
        load_config("grpo", QUICKSTART, ["grpo.async_grpo.enabled=true"])
    with pytest.raises(ConfigError, match=r"grpo.async_grpo.max_trajectory_age_steps"):
        load_config("grpo", QUICKSTART, ["grpo.async_grpo.max_trajectory_age_steps=0"])


def test_one_optimizer_step_per_batch_skips_the_prev_logprob_pass(ray_session, tmp_path):
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.train_global_batch_size=16", "grpo.warmup_sft_steps=0", "grpo.max_num_steps=2",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
    ))
    run(cfg)
    for r in records(tmp_path / "logs", "train"):
        assert r["num_optimizer_steps"] == 1
        assert "timing/logprobs/prev" not in r
        # prev = the training forward's own logprobs: the ratio is exactly 1 and nothing clips.
        assert r["probs_ratio_min"] == r["probs_ratio_max"] == 1.0 and r["clip_fraction"] == 0.0
        assert r["token_mult_prob_error"] < 1.01 and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])


def test_top_entropy_quantile_trains_the_high_entropy_share_of_each_micro_batch(ray_session, tmp_path):
    # The policy workers add each token's entropy to the micro-batch; the loss keeps its top 25%.
    # Every row trained (the untrained model's groups all score 0, which would leave one row a step).
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "loss_fn.top_entropy_quantile=0.25", "policy.skip_zero_gradient_samples=false",
        "grpo.warmup_sft_steps=0", "grpo.max_num_steps=2",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
    ))
    run(cfg)
    for r in records(tmp_path / "logs", "train"):
        # A quarter of each micro-batch's valid tokens (rounded up, and ties at the floor stay in).
        assert 0.25 <= r["entropy_kept_fraction"] <= 0.3, r
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])


def test_num_iterations_passes_over_the_same_rollouts_against_the_policy_that_sampled_them(ray_session, tmp_path):
    # GRPO's mu: one batch of 16 rollouts, three passes of one optimizer step each. The first pass
    # trains the sampling policy (ratio 1); the later ones a moved policy, against the logprobs
    # of the pre-update pass (computed once), so the ratio leaves 1 and the clip can bite. Rewards
    # by the response's length, which varies within a group (the untrained model's answers score alike).
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def parity(response, metadata):\n    return float(len(response) % 2)\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "policy.train_global_batch_size=16", "grpo.num_iterations=3", "grpo.warmup_sft_steps=0",
        "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "checkpointing.enabled=false", "policy.precision=float32",
        'policy.optimizer.kwargs={"lr": 0.05}', "grpo.use_leave_one_out_baseline=false",
        "data.task_name=one", f"env.one.target={rewards}:parity",
        "data.num_train=20000",  # prompts whose answers' parity varies within a group at both steps
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    for r in train:
        assert r["num_optimizer_steps"] == 3 and "timing/logprobs/prev" in r
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    moved = [r for r in train if r["zero_gradient_fraction"] < 1.0]  # a step with some reward variance
    assert len(moved) == 2 and all(r["probs_ratio_max"] > 1.0 + 1e-4 or r["probs_ratio_min"] < 1.0 - 1e-4 for r in moved)


@pytest.mark.parametrize("sampling, reused", [("policy.generation.top_k=null", True),
                                               ("policy.generation.top_k=5", False)])
def test_prev_logprobs_from_generation_after_checking_they_match(ray_session, tmp_path, sampling, reused):
    # Step 1 computes prev_logprobs of one optimizer step's rows and compares them with the generation
    # logprobs; the steps from then on (step 1's training too) reuse the generation logprobs only if
    # they matched: yes for the fp32 engine sampling from the full distribution, no with top-k (the
    # sampler's logprobs are renormalised over 5 tokens; step 1 then computes all rows').
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.prev_logprobs_from_generation=true", "grpo.warmup_sft_steps=0", "grpo.max_num_steps=3",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
        "policy.precision=float32", sampling,
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    assert [r["num_optimizer_steps"] for r in train] == [2, 2, 2]
    assert "timing/logprobs/prev" in train[0]
    for i, r in enumerate(train):
        assert ("timing/logprobs/prev" not in r) == (reused and i > 0)
        if reused and i > 0:  # prev is the generation logprobs themselves: nothing measured
            assert "token_mult_prob_error" not in r and "gen_kl_error" not in r
        elif reused:  # the check's measurement (it was 1 and 0 by construction, whatever the engine)
            assert 1.0 <= r["token_mult_prob_error"] <= 1.001 and abs(r["gen_kl_error"]) < 1e-3
        else:
            assert r["token_mult_prob_error"] > 1.001
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])


def test_the_generation_logprob_check_compares_the_tokens_of_masked_samples_too():
    # A first step whose samples are all out of the loss (overlong filtering with every sample
    # truncated): the check compared nothing, found a mean error of 0, and reused the generation
    # logprobs for the rest of the run, however far they were from the policy's.
    from posttrain.algorithms.grpo import _generation_logprobs_match, _generation_mismatch
    from posttrain.data.batch import BatchedDataDict

    class Console:
        lines: list[str] = []

        def console(self, line):
            self.lines.append(line)

    token_mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    batch = BatchedDataDict(token_mask=token_mask, sample_mask=torch.zeros(2),
                            prev_logprobs=torch.full((2, 3), -1.0), generation_logprobs=torch.full((2, 3), -1.5))
    logger = Console()
    mismatch = _generation_mismatch(batch, "k1")
    assert mismatch == pytest.approx({"token_mult_prob_error": math.exp(0.5), "gen_kl_error": -0.5})  # k1: gen - prev
    assert _generation_logprobs_match(mismatch, logger, "float32") is False
    assert "mean exp|diff| = 1.6487" in logger.lines[0]  # exp(0.5) over the 3 generated tokens
    batch["generation_logprobs"] = batch["prev_logprobs"] + 1e-4
    batch["generation_logprobs"][1, 2] = -float("inf")  # padding a sampler masked out: no NaN
    assert _generation_logprobs_match(_generation_mismatch(batch, "k3"), logger, "float32") is True


def test_on_policy_distillation_moves_the_student_toward_the_teacher(ray_session, tiny_model_path, tmp_path):
    # The teacher is embedded:tiny as it starts; the warm-up SFT on arithmetic answers moves the
    # student away from it, so the student starts the RL phase at a clear reverse KL from the
    # teacher. The teacher's logprobs are then the only training signal, and the reverse KL on the
    # student's own samples falls.
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={tiny_model_path}",
        "grpo.warmup_sft_steps=10", "grpo.warmup_sft_lr=1e-2", "grpo.max_num_steps=10", "grpo.val_period=0",
        "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
        "policy.optimizer.kwargs.lr=1e-2",
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    kl = [r["teacher_reverse_kl"] for r in train]
    assert len(kl) == 10 and all(math.isfinite(x) for x in kl) and kl[0] > 0.3, kl
    assert sum(kl[-3:]) / 3 < 0.5 * kl[0], kl
    assert all("timing/logprobs/reference" in r and math.isfinite(r["loss"]) for r in train)


def test_on_policy_distillation_advantages_are_against_the_policy_not_the_sampler(ray_session, tiny_model_path,
                                                                                tmp_path):
    # The teacher is the student itself: every advantage and the reverse KL are 0. With one
    # optimizer step per batch and top-k sampling they were taken against the sampler's top-k
    # renormalised logprobs: teacher_reverse_kl 2.50 and every sampled token pushed down.
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={tiny_model_path}",
        "grpo.warmup_sft_steps=0", "grpo.max_num_steps=1", "policy.train_global_batch_size=16",
        "policy.generation.top_k=5", "policy.precision=float32", "grpo.val_period=0", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "checkpointing.enabled=false",
    ))
    run(cfg)
    (r,) = records(tmp_path / "logs", "train")
    assert abs(r["teacher_reverse_kl"]) < 1e-5 and math.isfinite(r["loss"])
    assert r["token_mult_prob_error"] > 2.0  # the sampler's logprobs are far from the policy's
    assert r["num_optimizer_steps"] == 1 and "timing/logprobs/prev" in r


def test_reference_model_with_another_vocabulary_is_refused_before_ray_starts(tmp_path, monkeypatch, caplog):
    from transformers import LlamaConfig

    from posttrain.algorithms import grpo
    from posttrain.config import InputError

    other = tmp_path / "other_vocab"
    # Fewer rows than the policy's 104: the policy could sample ids the reference has no row for.
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=100).save_pretrained(other)  # no tokenizer: the sizes are all the check reads
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={other}",
        "grpo.warmup_sft_steps=0", "grpo.max_num_steps=1",
    ))
    monkeypatch.setattr(grpo, "reserve", lambda *a, **k: pytest.fail("Ray was started and the workers placed"))
    with pytest.raises(InputError, match=r"policy.reference_model_name=.*vocabulary of 100 tokens"):
        run(cfg)
    # The same number of tokens, another tokenizer (as Llama 2 and Mistral 7B): two ids swapped.
    from posttrain.embedded import build_model, resolve_model_path
    from posttrain.policy.hf_io import load_model_configs

    swapped = tmp_path / "swapped"
    shutil.copytree(resolve_model_path("embedded:tiny"), swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={swapped}"))
    with pytest.raises(InputError, match=r"policy.reference_model_name=.*: 2 of the 104 tokens of the policy's "
                                         r"tokenizer have another id \(or none\) in the reference's, e.g. 'a' "):
        run(cfg)
    # A larger embedding over the same tokenizer (Qwen2.5-7B teaching Qwen2.5-1.5B) is a teacher.
    padded = tmp_path / "padded"
    build_model("tiny", vocab_size=128).save_pretrained(padded)
    shutil.copytree(resolve_model_path("embedded:tiny"), padded, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={padded}"))
    assert load_model_configs(cfg.policy, with_reference=True)[1][1].vocab_size == 128
    # Without its tokenizer only the sizes say anything: accepted, with a warning that says so.
    for f in padded.glob("tokenizer*"):
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="posttrain.policy.hf_io"):
        load_model_configs(cfg.policy, with_reference=True)
    assert "has no tokenizer, and a vocabulary of 128 tokens where the policy has 104" in caplog.text
    missing = tmp_path / "no_teacher"
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={missing}"))
    with pytest.raises(FileNotFoundError, match=r"policy.reference_model_name=.*no such folder"):
        run(cfg)


def test_failed_setup_stops_what_it_started(ray_session, tiny_model_path, tmp_path, save_68b_config):
    from transformers import LlamaConfig

    # A teacher of ~68B parameters: its config loads (same vocabulary), the workers' memory check
    # then fails inside the setup, after the cluster and the policy workers started.
    save_68b_config(tmp_path / "huge", LlamaConfig.from_pretrained(tiny_model_path).vocab_size)
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.adv_estimator=on_policy_distillation", f"policy.reference_model_name={tmp_path / 'huge'}",
        "grpo.warmup_sft_steps=0", "grpo.max_num_steps=1",
    ))
    with pytest.raises(MemoryError, match="reference"):
        run(cfg)
    alive = [pg for pg in ray_session.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    assert alive == [], alive


@pytest.mark.extended  # the sync itself: tests/functional/test_reference_sync.py
def test_reference_sync_moves_the_kl_reference_to_the_policy_every_step(ray_session, tmp_path):
    # ProRL's reference reset (policy.reference_sync with mixup_alpha 1, every step): each step's KL
    # is measured before its one optimizer step, against a reference that the previous step's end
    # set to the very weights being trained, so it is 0; without it the KL grows once the policy moves.
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def by_length(response, metadata):\n    return (len(response) % 4) / 3\n")

    def kl_per_step(name, *extra):
        cfg = load_config("grpo", QUICKSTART, tiny_overrides(
            tmp_path / name, "grpo.max_num_steps=3", "grpo.warmup_sft_steps=0", "grpo.val_period=0",
            "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
            "policy.precision=float32", "policy.train_global_batch_size=16", 'policy.optimizer.kwargs={"lr": 0.02}',
            "loss_fn.reference_policy_kl_penalty=0.1", "data.task_name=by_length",
            f"env.by_length.target={rewards}:by_length", *extra))
        run(cfg)
        return [r["kl_penalty"] for r in records(tmp_path / name / "logs", "train")]

    free = kl_per_step("free")
    synced = kl_per_step("synced", "policy.reference_sync.enabled=true", "policy.reference_sync.mixup_alpha=1.0",
                         "policy.reference_sync.sync_steps=1")
    assert free[0] == pytest.approx(0.0, abs=1e-7) and free[2] > 1e-4, free
    assert all(kl == pytest.approx(0.0, abs=1e-7) for kl in synced), synced
