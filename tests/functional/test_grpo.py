"""The real GRPO entrypoint for a few tiny steps: metric bounds, environment failures,
multi-turn rollouts, reward functions and tools, tensor parallelism, and resume from a checkpoint
(the variants: test_grpo_variants.py)."""

import json
import math
import random
import shutil

import pytest
import torch
from docs_helpers import undocumented_metrics
from test_grpo_helpers import QUICKSTART, records, tiny_overrides

from posttrain.algorithms.grpo import run
from posttrain.config import load_config


@pytest.fixture(scope="module")
def arithmetic_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    # Every 4th training row has no gold answer: the environment raises for it.
    rows = []
    for i in range(64):
        a, b = i % 10, (3 * i) % 10
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="}], "task_name": "arithmetic",
                     "answer": None if i % 4 == 0 else str(a + b)})
    train = tmp / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    val = tmp / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in rows[0:16:2]))  # 4 of 8 without an answer too
    cfg = load_config("grpo", QUICKSTART, _arithmetic(tmp, tmp, "grpo.max_num_steps=3", "logger.plots_enabled=true",
                                                  "logger.num_samples_to_dump=64"))  # every sample
    result = run(cfg)
    return tmp, result


def _arithmetic(data_dir, run_dir, *extra):
    return tiny_overrides(run_dir, f"data.train_data_path={data_dir / 'train.jsonl'}",
                 f"data.val_data_path={data_dir / 'val.jsonl'}", "data.dataset_name=local", "grpo.warmup_sft_steps=0",
                 "grpo.shuffle_minibatches=true",  # two optimizer steps per step: the shuffled path
                 "checkpointing.metric_name=train:reward",  # a rollout metric ranks the checkpoints
                 # Sampled validation draws from the engine's stream: the step after a validated
                 # checkpoint resumed differently (test_resume_continues_...).
                 "grpo.val_greedy=false",
                 *extra)


def test_prompts_that_leave_too_little_room_to_answer_are_noted():
    from posttrain.algorithms.grpo import cramped_prompts_note
    from posttrain.rollouts import PROMPT_IDS_KEY

    cfg = load_config("grpo", QUICKSTART, ["policy.max_total_sequence_length=32", "policy.generation.max_new_tokens=6"])
    rows = [{PROMPT_IDS_KEY: [1] * n} for n in (20, 26, 27, 30)]
    assert cramped_prompts_note(rows, cfg) == (
        "2 of 4 training prompts leave fewer than policy.generation.max_new_tokens=6 tokens to answer within "
        "policy.max_total_sequence_length=32 (the longest prompt: 30 tokens): their answers are cut at the "
        "context (counted in truncation_rate)")
    assert cramped_prompts_note(rows[:2], cfg) is None


def test_a_warm_up_that_would_end_after_the_time_limit_stops_naming_it():
    # The warm-up saves nothing and checked no limit: the quickstart's 9-minute limit passed
    # inside a slow warm-up, and the first save came long after it.
    from posttrain.algorithms.grpo import warmup_overrun

    cfg = load_config("grpo", QUICKSTART, ["checkpointing.checkpoint_must_save_by=00:00:09:00"])  # 1500 steps
    assert warmup_overrun(cfg, 5, 50.0, None, 400.0) is None  # too early to project
    assert warmup_overrun(cfg, 100, 5.0, 0.05, 400.0) is None  # ~70 s to go
    # Slow first steps (start-up, a busy machine) project nothing: the steady steps after them do.
    assert warmup_overrun(cfg, 20, 40.0, 0.05, 400.0) is None
    assert warmup_overrun(cfg, 1500, 5000.0, 3.0, -1.0) is None  # done: the loop's own check takes over
    assert warmup_overrun(cfg, 100, 40.0, 0.4, 400.0) == (
        "checkpointing.checkpoint_must_save_by=00:00:09:00: the warm-up SFT (grpo.warmup_sft_steps=1500), which "
        "saves no checkpoint, would end after it (step 100 after 40 s, ~560 s to go, 400 s left): raise the limit, "
        "lower grpo.warmup_sft_steps, or warm up in a `posttrain sft` run of its own and start from its export")
    assert warmup_overrun(cfg, 2, 1.0, None, -3.0).endswith("(step 2 after 1 s, ~749 s to go, 0 s left): raise the "
                                                            "limit, "
                                                      "lower grpo.warmup_sft_steps, or warm up in a `posttrain sft` "
                                                      "run of its own and start from its export")
    assert warmup_overrun(load_config("grpo", QUICKSTART, ["checkpointing.checkpoint_must_save_by=null"]),
                          100, 40.0, 0.4, None) is None


def test_reinforce_with_several_updates_per_step_is_noted():
    # It ran silently off-policy after the first update, while force_on_policy_ratio (the same
    # gradient) is refused for it.
    from posttrain.algorithms.grpo import off_policy_reinforce_note

    rl = ["loss_fn.disable_ppo_ratio=true", "grpo.adv_estimator=rloo"]
    cfg = load_config("grpo", QUICKSTART, rl)  # 512 samples, 128 a step: 4 updates
    assert off_policy_reinforce_note(cfg).startswith(
        "loss_fn.disable_ppo_ratio=true (REINFORCE) with 4 optimizer steps per step")
    assert off_policy_reinforce_note(load_config("grpo", QUICKSTART, [*rl, "policy.train_global_batch_size=512"])) is None
    assert off_policy_reinforce_note(load_config("grpo", QUICKSTART)) is None  # the clipped ratio


def test_gspo_with_untruncated_importance_weights_is_noted():
    # GSPO's correction weight is a product over the tokens: unbounded unless truncated.
    from posttrain.algorithms.grpo import untruncated_sequence_weights_note

    gspo = ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false",
            "loss_fn.use_importance_sampling_correction=true", "grpo.prev_logprobs_from_generation=false"]
    assert untruncated_sequence_weights_note(load_config("grpo", QUICKSTART, gspo)).startswith(
        "loss_fn.use_importance_sampling_correction=true with loss_fn.sequence_level_importance_ratios (GSPO)")
    assert untruncated_sequence_weights_note(
        load_config("grpo", QUICKSTART, [*gspo, "loss_fn.truncated_importance_sampling_ratio=2"])) is None
    assert untruncated_sequence_weights_note(load_config("grpo", QUICKSTART, gspo[:2])) is None  # no correction


def test_minibatch_permutation_is_seeded_by_run_and_step():
    from posttrain.algorithms.grpo import minibatch_permutation

    p = minibatch_permutation(512, 42, 3)
    assert sorted(p.tolist()) == list(range(512))
    assert torch.equal(p, minibatch_permutation(512, 42, 3))  # a resumed run repeats its step's order
    assert not torch.equal(p, minibatch_permutation(512, 42, 4))
    assert not torch.equal(p, minibatch_permutation(512, 7, 3))
    # The first optimizer step of 128 rows holds samples of most of the 32 prompts (16 each).
    assert len(set((p[:128] // 16).tolist())) > 24


def test_interleaved_order_deals_each_group_round_robin():
    from posttrain.algorithms.grpo import interleaved_order

    assert interleaved_order(torch.tensor([0, 0, 0, 1, 1, 1])).tolist() == [0, 3, 1, 4, 2, 5]
    # Any ids, any order, uneven groups (dynamic sampling): ranks within each group, then position.
    assert interleaved_order(torch.tensor([7, 2, 7, 7, 2, 9])).tolist() == [0, 1, 5, 2, 4, 3]
    # Cut into two optimizer steps of 4, each holds two samples of each of the two prompts.
    order = interleaved_order(torch.arange(2).repeat_interleave(4))
    assert [sorted(x // 4 for x in order[i:i + 4].tolist()) for i in (0, 4)] == [[0, 0, 1, 1], [0, 0, 1, 1]]


def test_reinforce_pp_whitens_over_the_kept_samples_of_every_round():
    # Dynamic sampling, two rounds of two prompts x 2 samples. Round 1 keeps group 0 (rewards 1, 0)
    # and drops group 1 (1, 1); round 2 keeps group 3 (0, 1) and drops group 2 (0, 0). The
    # advantages were whitened per round, the dropped group's zeros in the std: +-1.22 instead of
    # +-0.87, a scale that grew with the share of groups dropped.
    from posttrain.advantages import dynamic_sampling_keep
    from posttrain.algorithms.grpo import _advantages_then_cut
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    def round_of(rewards, first_group, length):
        n = len(rewards)
        batch = BatchedDataDict(
            input_ids=torch.ones(n, length, dtype=torch.long), input_lengths=torch.full((n,), length),
            token_mask=torch.ones(n, length), generation_logprobs=torch.zeros(n, length),
            rewards=torch.tensor(rewards), truncated=torch.zeros(n, dtype=torch.bool),
            env_errors=torch.zeros(n, dtype=torch.bool), response_lengths=torch.full((n,), float(length)),
            group_ids=torch.arange(first_group, first_group + n // 2).repeat_interleave(2))
        keep, _ = dynamic_sampling_keep(batch["rewards"], batch["group_ids"])
        return batch.select_indices(keep)

    def rounds():  # the loop's concatenation of the step's rounds
        parts = [round_of([1.0, 0.0, 1.0, 1.0], 0, 3), round_of([0.0, 0.0, 0.0, 1.0], 2, 5)]
        return BatchedDataDict.from_batches(parts, pad_value_dict={"input_ids": 0})
    batch = _advantages_then_cut(GRPOConfig(adv_estimator="reinforce_pp"), rounds(), 4, max_new_tokens=8)
    assert batch["group_ids"].tolist() == [0, 0, 3, 3] and batch["input_ids"].shape == (4, 5)
    # Centred 0.5, -0.5, -0.5, 0.5; their std over the 4 trained samples (Bessel) is 1/sqrt(3).
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 * 3 ** 0.5
    torch.testing.assert_close(batch["advantages"][:, 0], expected)
    assert batch["advantages"][:2, 3:].abs().sum() == 0  # round 1's padding is no response token
    # A cut to whole optimizer steps keeps the first rows, with the advantages of whole groups: group
    # 3's first sample is compared with the second, cut off (grpo: (0 - 1) / std 0.707), not alone (0).
    cut = _advantages_then_cut(GRPOConfig(), rounds(), 3, max_new_tokens=8)
    assert cut.size == 3 and cut["advantages"][2, 1].item() == pytest.approx(-(2 ** 0.5))


def test_three_steps_have_sane_metrics(arithmetic_run):
    tmp, result = arithmetic_run
    train = records(tmp / "logs", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    eps_lo, eps_hi = 0.2, 0.28  # the quickstart's loss_fn.ratio_clip_min / _max
    first = train[0]
    assert 1 - eps_lo - 1e-6 <= first["probs_ratio_clamped_min"] <= first["probs_ratio_clamped_max"] <= 1 + eps_hi + 1e-6
    for r in train:
        assert math.isfinite(r["loss"]) and math.isfinite(r["reward"])
        assert 0.0 <= r["reward"] <= 1.0
        # Generation and training compute the same logprobs (colocated torch engine, fp32).
        assert r["token_mult_prob_error"] < 1.05
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] >= 0
        for phase in ("generation", "logprobs", "training"):
            assert r[f"timing/{phase}"] > 0
        # The engine's speed over its generate calls alone: the generation phase holds the refit and
        # the environments' scoring too.
        assert 0 < r["generate_s"] < r["timing/generation"]
        assert r["generation_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["generate_s"])
    val = records(tmp / "logs", "val")
    assert [r["step"] for r in val] == [0, 2, 3]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in val)
    assert result["train/loss"] == train[-1]["loss"]


def test_every_metric_the_run_logs_is_in_docs_metrics(arithmetic_run):
    tmp, _ = arithmetic_run
    assert not undocumented_metrics(tmp / "logs")


def test_environment_errors_score_zero_and_the_run_goes_on(arithmetic_run):
    tmp, _ = arithmetic_run
    train = records(tmp / "logs", "train")
    # A quarter of the rows have no answer; each step samples 4 prompts, so over 3 steps some
    # errors must have been counted, and every step still trained.
    assert sum(r["env_errors"] for r in train) > 0
    # Validation counts them too: its held-out samples scored 0 read like a bad model's otherwise.
    assert [r["env_errors"] for r in records(tmp / "logs", "val")] == [4.0, 4.0, 4.0]
    samples = [json.loads(line) for line in (tmp / "logs" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] in (0.0, 1.0) for s in samples)
    # Each failed sample says why (it was only in the environment actor's log), and scores 0.
    failed = [s for s in samples if s["env_error"] is not None]
    assert all(s["reward"] == 0.0 and "answer" in s["env_error"] for s in failed), failed[:2]
    assert 0 < len(failed) < len(samples), len(failed)


def test_checkpoints_and_plots_are_written(arithmetic_run):
    tmp, _ = arithmetic_run
    steps = sorted(p.name for p in (tmp / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_2", "step_3"]
    info = json.loads((tmp / "ckpt" / "step_3" / "training_info.json").read_text())
    assert info["step"] == 3 and info["consumed_samples"] == 3 * 16
    # The checkpoint is ranked by the step's logged train/reward (it was "not measured": None).
    rewards = {r["step"]: r["reward"] for r in records(tmp / "logs", "train")}
    assert info["metric_name"] == "train:reward" and info["metric_value"] == pytest.approx(rewards[3])
    assert (tmp / "logs" / "plots" / "reward.png").stat().st_size > 1000


def test_resume_continues_from_the_latest_checkpoint_as_the_run_would_have(arithmetic_run, kill_after_save):
    tmp, _ = arithmetic_run
    again = tmp / "again"
    shutil.copytree(tmp / "ckpt" / "step_2", again / "ckpt" / "step_2")  # before step_4 displaces it
    run(load_config("grpo", QUICKSTART, _arithmetic(tmp, tmp, "grpo.max_num_steps=4")))
    steps = [r["step"] for r in records(tmp / "logs", "train")]
    assert steps == [1, 2, 3, 4]  # step 4 only: nothing was redone
    # Counted on from the checkpoint's (with this run's samples per prompt since: all prompts at
    # the current count made a resume with fewer generations count backwards).
    assert json.loads((tmp / "ckpt" / "step_4" / "training_info.json").read_text())["consumed_samples"] == 4 * 16
    # Resumed from step 2 (as if the run had died after it), step 3 is the uninterrupted run's:
    # the same prompts, samples (the generation seed follows the weights version), rewards, loss.
    # Killed right after its checkpoint of step 3 (SIGKILL, the OOM killer), the run has logged
    # that step's metrics and samples: a resume starts after it and would never log them.
    kill_after_save(3)
    with pytest.raises(kill_after_save.error):
        run(load_config("grpo", QUICKSTART, _arithmetic(tmp, again, "grpo.max_num_steps=3")))
    assert (again / "ckpt" / "step_3" / "COMPLETE").is_file()
    assert {json.loads(line)["step"] for line in (again / "logs" / "samples.jsonl").read_text().splitlines()} == {3}
    (resumed,) = records(again / "logs", "train")
    (uninterrupted,) = [r for r in records(tmp / "logs", "train") if r["step"] == 3]
    for key in ("reward", "response_length_mean", "generated_tokens", "env_errors", "loss", "grad_norm"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key


def test_a_resume_onto_other_training_rows_fails_before_any_worker_starts(arithmetic_run, tmp_path, monkeypatch):
    from posttrain.algorithms import grpo
    from posttrain.checkpoint import complete_checkpoints
    from posttrain.config import ConfigError, InputError

    tmp, _ = arithmetic_run
    first = complete_checkpoints(tmp / "ckpt")[0]
    shutil.copytree(first, tmp_path / "ckpt" / first.name)
    (tmp_path / "train.jsonl").write_text("\n".join((tmp / "train.jsonl").read_text().splitlines()[:32]))
    cfg = load_config("grpo", QUICKSTART, _arithmetic(tmp, tmp_path, "grpo.max_num_steps=4",
                                                      f"data.train_data_path={tmp_path / 'train.jsonl'}"))
    monkeypatch.setattr(grpo, "reserve", lambda *a, **k: pytest.fail("Ray was started and the workers placed"))
    with pytest.raises(InputError, match=r"saw 64 rows but the dataset now has 32.*data.train_data_path: "):
        run(cfg)
    # As does a step count lowered below the checkpoint's: the resume would train nothing.
    cfg = load_config("grpo", QUICKSTART, _arithmetic(tmp, tmp_path, "grpo.max_num_steps=1"))
    step = int(first.name.removeprefix("step_"))  # the checkpoint ranking keeps step 2 or 3
    with pytest.raises(ConfigError, match=rf"{first.name} is at step {step}, past grpo.max_num_steps=1: resuming"):
        run(cfg)


def test_only_a_steps_own_validation_ranks_its_checkpoint(ray_session, tmp_path):
    # Validation at step 2 only: step 3's checkpoint was not measured. Ranked by step 2's accuracy
    # (a tie the newer one wins), it displaced step 2, the one checkpoint it was measured on.
    run(load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=3", "grpo.warmup_sft_steps=0", "grpo.val_at_end=false",
        "checkpointing.save_period=1", "checkpointing.keep_top_k=1", "checkpointing.metric_name=val:accuracy")))
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_3"]
    (val,) = [r for r in records(tmp_path / "logs", "val") if r["step"] == 2]
    info = [json.loads((ckpt / name / "training_info.json").read_text()) for name in ("step_2", "step_3")]
    assert info[0]["metric_value"] == pytest.approx(val["accuracy"]) and info[1]["metric_value"] is None


def test_a_validation_whose_environment_failed_on_every_sample_records_no_reward(ray_session, tmp_path, caplog):
    # Every validation prompt lacks the answer the environment scores against: it logged reward 0 (a
    # false collapse in the curves) and ranked the checkpoint by it.
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "task_name": "arithmetic", "answer": str(i + 1)}
            for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps({**r, "answer": None}) for r in rows[:4]))
    with caplog.at_level("WARNING"):
        run(load_config("grpo", QUICKSTART, tiny_overrides(
            tmp_path, "grpo.max_num_steps=1", "grpo.warmup_sft_steps=0", "grpo.val_at_start=false",
            "data.dataset_name=local", f"data.train_data_path={tmp_path / 'train.jsonl'}",
            f"data.val_data_path={tmp_path / 'val.jsonl'}", "checkpointing.metric_name=val:reward")))
    (val,) = records(tmp_path / "logs", "val")
    assert val["env_errors"] == 4 and "reward" not in val and "accuracy" not in val
    assert "validation at step 1: the environment failed on every one of its 4 samples" in caplog.text
    info = json.loads((tmp_path / "ckpt" / "step_1" / "training_info.json").read_text())
    assert info["metric_value"] is None  # unmeasured, not a measured 0


@pytest.mark.parametrize("val_at_end", [False, True])
def test_a_run_that_runs_out_of_prompts_validates_and_saves_its_last_step(ray_session, tmp_path, val_at_end,
                                                                          monkeypatch):
    # 8 prompts, 4 per step, one epoch: the data ends after step 2, before max_num_steps and before
    # the first periodic save (step 10); the run's last step is validated (grpo.val_at_end; it was
    # not: the final model went unmeasured and its checkpoint unranked by val:accuracy) and
    # checkpointed as step max_num_steps is.
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="}],
                                           "task_name": "arithmetic", "answer": str(i + 1)}) for i in range(8)))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=5", f"data.train_data_path={train}", f"data.val_data_path={train}",
        "data.dataset_name=local", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        f"grpo.val_at_end={str(val_at_end).lower()}", "checkpointing.save_period=10",
        "checkpointing.metric_name=val:accuracy",
    ))
    result = run(cfg)
    assert [r["step"] for r in records(tmp_path / "logs", "train")] == [1, 2]
    val = records(tmp_path / "logs", "val")
    assert [r["step"] for r in val] == ([2] if val_at_end else [])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_2"]
    info = json.loads((tmp_path / "ckpt" / "step_2" / "training_info.json").read_text())
    assert info["step"] == 2 and info["consumed_samples"] == 2 * 16
    if val_at_end:
        assert info["metric_value"] == pytest.approx(val[0]["accuracy"]) == pytest.approx(result["val/accuracy"])
        assert result["val/step"] == 2  # the step its val/ metrics are of (a stop skips the one due)
    else:
        assert info["metric_value"] is None and "val/accuracy" not in result
    # Started again, it is complete (its prompts ran out): it started its workers, exported again
    # and returned an empty result.
    from posttrain.algorithms import grpo

    monkeypatch.setattr(grpo, "reserve", None)  # any start of workers fails
    again = run(cfg)
    assert again.pop("already_complete") is True and again == result


def test_multi_turn_sliding_puzzle(ray_session, tmp_path):
    # 2x2 puzzles keep it short; the warm-up imitates the teacher's games (demonstrations).
    cfg = load_config("grpo", "examples/configs/grpo_sliding_puzzle.yaml", tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false",
        "policy.max_total_sequence_length=320", "env.sliding_puzzle.cfg.size=2", "grpo.max_rollout_turns=4",
        "env.sliding_puzzle.cfg.shuffle_moves=3", "env.sliding_puzzle.cfg.max_moves=4", "data.num_train=64",
    ))
    run(cfg)
    (warmup,) = records(tmp_path / "logs", "data/warmup_sft")
    assert warmup["kept"] == cfg.data.num_train and warmup["no_loss"] == 0
    train = records(tmp_path / "logs", "train")
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["loss"])
        assert r["turns_mean"] >= 1.0
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    assert all("Board" in s["prompt"] for s in samples)


def test_multi_turn_code_rows_from_a_jsonl_file(ray_session, tmp_path):
    # Rows name the code environment and carry their tests; a failing program's report comes
    # back as a second turn. The tiny random model writes no working code: every conversation
    # takes both turns, scores 0, and nothing counts as an environment error.
    # Stop strings common in the random model's output end its turns before the token limit (a
    # truncated turn ends the conversation).
    rows = [{"messages": [{"role": "user", "content": f"Write f(x) returning x+{k}."}], "task_name": "code",
             "metadata": {"tests": [f"assert f(1) == {1 + k}"]}, "stop_strings": list("aeiou0123456789")}
            for k in range(8)]
    data = tmp_path / "code.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        "data.dataset_name=local", f"data.train_data_path={data}", f"data.val_data_path={data}",
        "grpo.max_rollout_turns=2", "env.code.cfg.max_attempts=2", "policy.max_total_sequence_length=256",
        "policy.generation.max_new_tokens=12",
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["loss"]) and r["reward"] == 0.0 and r["env_errors"] == 0
        assert r["turns_mean"] > 1.5
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    feedback = [s["conversation"][1]["content"] for s in samples if "conversation" in s]
    assert feedback and all(f.startswith("Environment: 0/1 tests passed; ") for f in feedback), feedback
    assert all(f.endswith("Fix the program and answer with all of it again.") for f in feedback), feedback


def test_reward_function_from_a_file_scores_every_row(ray_session, tmp_path):
    # data.task_name sends the arithmetic rows to the user's function instead of the arithmetic
    # environment; its rewards (a response's length / 100) are ones no built-in environment gives.
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def by_length(response, metadata):\n    return len(response) / 100\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=1", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_start=false",
        "data.task_name=by_length", f"env.by_length.target={rewards}:by_length",
    ))
    run(cfg)
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] == pytest.approx(len(s["response"]) / 100) for s in samples)
    assert any(s["reward"] > 0 for s in samples)
    (train,) = records(tmp_path / "logs", "train")
    assert train["env_errors"] == 0 and 0 < train["reward"] <= train["response_length_max"] / 100


def test_a_mixture_of_datasets_trains_on_both_and_validates_each(ray_session, tmp_path):
    # data.mixture: the arithmetic rows twice over, once scored by the user's function, once (half
    # of them, weight 0.5) by the arithmetic environment; validation reports each environment apart.
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def by_length(response, metadata):\n    return len(response) / 100\n")
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=1", "grpo.warmup_sft_steps=0", "grpo.val_period=0", "grpo.val_at_end=false",
        "~data.dataset_name", f"env.by_length.target={rewards}:by_length", "data.num_train=64",
        "data.mixture=[{dataset_name: arithmetic, task_name: by_length, max_val_samples: 4}, "
        "{dataset_name: arithmetic, task_name: arithmetic, weight: 0.5, max_val_samples: 4}]",
    ))
    run(cfg)
    (val,) = records(tmp_path / "logs", "val")
    assert val["task_reward/by_length"] >= 0 and 0 <= val["task_accuracy/arithmetic"] <= 1
    assert val["reward"] == pytest.approx((val["task_reward/by_length"] + val["task_reward/arithmetic"]) / 2)
    (train,) = records(tmp_path / "logs", "train")  # the step's rollouts drew prompts of both
    assert {"task_reward/by_length", "task_reward/arithmetic"} <= set(train)


# The second failure in a row: the third step's validation (the run stops before the loop logs the
# step: its record was missing beside its checkpoint), or the fourth step's rollouts after a
# periodic save of the third (which kept the data position after it: a resume skipped its prompts).
@pytest.mark.parametrize("schedule", [["grpo.val_period=3", "checkpointing.save_period=10"],
                                      ["grpo.val_period=0", "checkpointing.save_period=3"]],
                         ids=["validation_fails", "saved_then_rollouts_fail"])
def test_an_environment_that_keeps_failing_stops_the_run_after_saving_its_last_complete_step(ray_session, tmp_path,
                                                                                              schedule):
    from posttrain.environments import EnvironmentFailure

    # A reward service that goes down from the third step's rollouts on, while `broken` exists.
    rewards, broken = tmp_path / "rewards.py", tmp_path / "broken"
    rewards.write_text(
        "import os\n\ndef flaky(response, metadata):\n"
        f"    if metadata['_rollout']['global_step'] >= 2 and os.path.exists({str(broken)!r}):\n"
        "        raise ConnectionError('reward service down')\n"
        "    return float(len(response) > 2)\n")
    broken.touch()
    args = tiny_overrides(tmp_path, "grpo.max_num_steps=5", "grpo.warmup_sft_steps=0", *schedule,
                 "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "logger.num_samples_to_dump=16", "data.task_name=flaky", f"env.flaky.target={rewards}:flaky",
                 "env.flaky.max_failed_steps=2")
    with pytest.raises(EnvironmentFailure, match=r"^environment 'flaky': every sample failed in 2 steps in a row "
                                                 r"\(env.flaky.max_failed_steps=2\); the last error: reward function 'flaky' of "
                                                 r"environment 'flaky' raised ConnectionError at rewards.py:5 in flaky: "
                                                 r"reward service down"):
        run(load_config("grpo", QUICKSTART, args))
    # The three complete steps were saved, the third, whose every sample failed, with the data
    # position before it (its prompts, not lost).
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_3"]
    info = json.loads((tmp_path / "ckpt" / "step_3" / "training_info.json").read_text())
    assert info["dataloader"]["served"] == 2 * 4 and info["consumed_samples"] == 2 * 4 * 4
    assert [(r["step"], r["env_errors"]) for r in records(tmp_path / "logs", "train")] == [(1, 0), (2, 0), (3, 16)]
    assert not records(tmp_path / "logs", "val")
    # Mended, the run resumes at step 4 with the prompts of the failed step 3.
    broken.unlink()
    run(load_config("grpo", QUICKSTART, args))
    assert [(r["step"], r["env_errors"]) for r in records(tmp_path / "logs", "train")] == [
        (1, 0), (2, 0), (3, 16), (4, 0), (5, 0)]
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    prompts = {step: sorted(r["prompt"] for r in samples if r["step"] == step) for step in (3, 4)}
    assert prompts[3] == prompts[4] and len(prompts[3]) == 16


def test_a_stop_signal_while_an_environment_hangs_saves_at_once_and_drops_the_cut_step(ray_session, tmp_path):
    # The wait for a hung environment lasted its whole limit after a SIGTERM (2,590 s at the
    # quickstart's size, well past a scheduler's grace period). Now its samples fail at once, the
    # step they belong to is not trained, and the last complete one is saved, the data position
    # before the cut step's prompts.
    import os
    import signal
    import threading
    import time

    from posttrain.runtime import STOP_REQUESTED

    rewards, hang = tmp_path / "rewards.py", tmp_path / "hang"
    rewards.write_text(
        "import os, time\n\ndef slow(response, metadata):\n"
        f"    if metadata['_rollout']['global_step'] >= 1 and os.path.exists({str(hang)!r}):\n"
        "        time.sleep(120)\n"
        "    return float(len(response) > 2)\n")
    hang.touch()
    args = tiny_overrides(tmp_path, "grpo.max_num_steps=3", "grpo.warmup_sft_steps=0", "grpo.val_period=0",
                          "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.save_period=10",
                          "data.task_name=slow", f"env.slow.target={rewards}:slow")

    def signal_after_step_1():
        deadline = time.monotonic() + 120
        while not records(tmp_path / "logs", "train") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # into step 2's scoring
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_after_step_1, daemon=True)
    sender.start()
    start = time.monotonic()
    result = run(load_config("grpo", QUICKSTART, args))
    assert time.monotonic() - start < 90 and result["stopped_by_signal"] == "SIGTERM"
    assert not STOP_REQUESTED.is_set()  # a next run in this process waits for its environments again
    assert [r["step"] for r in records(tmp_path / "logs", "train")] == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]
    info = json.loads((tmp_path / "ckpt" / "step_1" / "training_info.json").read_text())
    assert info["dataloader"]["served"] == 4  # step 1's prompts: step 2's come again
    hang.unlink()
    run(load_config("grpo", QUICKSTART, args))
    assert [(r["step"], r["env_errors"]) for r in records(tmp_path / "logs", "train")] == [(1, 0), (2, 0), (3, 0)]


def test_reward_function_with_a_tool_the_model_calls(ray_session, tmp_path):
    # The tiny model, warmed up on demonstrations that call the add tool, calls it in its first
    # turn; the tool's result (or what was malformed in the call) comes back as a tool turn, and
    # the answer after it is what the reward function scores.
    (tmp_path / "calc.py").write_text(
        "def exact(response, metadata):\n    return float(response.strip() == metadata['answer'])\n\n"
        "def add(a: int, b: int) -> int:\n    \"\"\"Add two integers.\n\n    Args:\n        a: The first.\n"
        "        b: The second.\n    \"\"\"\n    return a + b\n")
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        call = "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</tool_call>"
        # Half demonstrate the call alone, half the whole exchange (a list of messages).
        demo = call if len(rows) % 2 else [{"role": "assistant", "content": call},
                                           {"role": "tool", "content": str(a + b)},
                                           {"role": "assistant", "content": str(a + b)}]
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="}], "task_name": "calc",
                     "answer": str(a + b), "demonstration": demo})
    data = tmp_path / "calc.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.warmup_sft_steps=300", "grpo.warmup_sft_lr=3e-3", "grpo.val_period=0",
        # The quickstart's 9-minute limit: a slow, loaded CI machine projected the warm-up past it.
        "checkpointing.checkpoint_must_save_by=null",
        "grpo.val_at_start=false", "grpo.max_rollout_turns=2", "policy.max_total_sequence_length=160",
        "policy.generation.max_new_tokens=72", "data.dataset_name=local", f"data.train_data_path={data}",
        f"data.val_data_path={data}", f"env.calc.target={tmp_path}/calc.py:exact",
        f"env.calc.tools=[{tmp_path}/calc.py:add]", "env.calc.max_tool_calls=1", "logger.num_samples_to_dump=16",
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["loss"]) and r["env_errors"] == 0 and 0.5 < r["tool_calls_mean"] <= 1.0
    results = []
    for s in (json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()):
        if "conversation" in s:
            turn, result = s["conversation"][0], s["conversation"][1]
            # A tool turn answers the call; the calling turn keeps it structured (its content the text
            # around a well-formed call, which the template writes: a malformed one stays as written),
            # and the result names it by id.
            assert result["role"] == "tool" and result["tool_call_id"] == turn["tool_calls"][0]["id"]
            assert "<tool_call>" not in turn["content"] or result["content"].startswith("error"), turn
            results.append((turn["tool_calls"][0]["function"], result["content"]))
    # Some calls were well formed, and their results are the sums of their arguments.
    good = [(call, r) for call, r in results if not r.startswith("error")]
    assert good and all(int(r) == call["arguments"]["a"] + call["arguments"]["b"] for call, r in good)
    # `posttrain eval` of the exported model with the same environment calls the tool too, and
    # keeps each exchange in its samples.
    from posttrain.algorithms.eval import run as evaluate

    save = tmp_path / "eval"
    results = evaluate(load_config("eval", None, [
        f"policy.model_name={tmp_path / 'logs' / 'hf'}", "policy.max_total_sequence_length=160",
        "policy.generation.max_new_tokens=72", f"data.dataset_name={data}", "data.task_name=calc",
        f"env.calc.target={tmp_path}/calc.py:exact", f"env.calc.tools=[{tmp_path}/calc.py:add]",
        "env.calc.max_tool_calls=1", "eval.max_rollout_turns=2", "eval.num_tests_per_prompt=1", "eval.k_value=1",
        f"eval.save_path={save}", f"logger.log_dir={save}",
    ]))
    samples = [json.loads(line) for line in (save / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64 and 0.5 < results["mean_tool_calls"] <= 1.0
    assert results["mean_tool_calls"] == sum(s["tool_calls"] for s in samples) / 64
    for s in (s for s in samples if s["tool_calls"]):
        # The calling turn, then its result: unless the result left no room in the context, or
        # the call was in the last turn allowed (eval.max_rollout_turns=2).
        conv = s["conversation"]
        call = next(i for i, m in enumerate(conv) if m.get("tool_calls"))
        if call + 1 < len(conv):
            assert conv[call + 1]["role"] == "tool"
        else:
            assert s["truncated"] or sum(m["role"] == "assistant" for m in conv) == 2


def test_tensor_parallel_grpo(ray_session, tmp_path):
    # Two workers splitting each layer's heads and MLP width, and with sequence parallelism each
    # row's positions between the projections (warm-up, rollouts on the gathered weights, training,
    # checkpoint and export); rows counted once, not once per rank.
    cfg = load_config("grpo", QUICKSTART, tiny_overrides(
        tmp_path, "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false",
        "cluster.workers_per_node=2", "cluster.cpus_per_worker=1", "policy.dtensor_cfg.tensor_parallel_size=2",
        "policy.dtensor_cfg.sequence_parallel=true", "policy.make_sequence_length_divisible_by=2",
    ))
    run(cfg)
    train = records(tmp_path / "logs", "train")
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["loss"]) and r["token_mult_prob_error"] < 1.05
        assert r["global_valid_seqs"] == 8 and r["num_optimizer_steps"] == 2
    assert (tmp_path / "ckpt" / "step_2").is_dir() and (tmp_path / "logs" / "hf" / "model.safetensors").is_file()
