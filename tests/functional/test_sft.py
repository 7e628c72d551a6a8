"""SFT end to end through `posttrain.algorithms.sft.run` on real Ray/FSDP2 workers.

- stories260K (a real pretrained model, converted from ../shared/data by posttrain's
  llama2.c converter) fine-tuned on the Alpaca demo data lowers the validation loss of
  held-out rows it never trained on;
- the step-0 loss (before the update) equals an independent computation of the same
  formula: transformers' own cross-entropy (what TRL's SFTTrainer optimises) on the same
  model and batch, with sequence packing on;
- a run resumes from its checkpoint at the next step.
"""

import copy
import json
import shutil
import re

import pytest
import torch
from docs_helpers import undocumented_metrics
from offline_helpers import offline_cfg
from transformers import AutoModelForCausalLM

from posttrain.algorithms import offline, sft
from posttrain.config import ConfigError, InputError
from posttrain.data.processors import collate, process_sft_rows


def _cfg(tmp_path, model, *overrides):
    return offline_cfg(
        "sft", tmp_path, model, "data.dataset_name=alpaca", "policy.max_total_sequence_length=256",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
        "policy.optimizer.kwargs={lr: 2.0e-3, weight_decay: 0.0}", "sft.val_global_batch_size=32",
        "sft.val_batches=2", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *overrides,
    )


@pytest.mark.slow
def test_sft_stories260k_lowers_heldout_loss(ray_session, stories260k, tmp_path):
    cfg = _cfg(tmp_path, stories260k, "sft.max_num_steps=12", "sft.val_period=12")
    result = sft.run(cfg)
    records = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    val = [r for r in records if r["prefix"] == "val"]
    assert [r["step"] for r in val] == [0, 12]
    # The held-out alpaca rows (5% of the file, never trained on) get clearly more likely.
    assert val[1]["loss"] < val[0]["loss"] - 0.3, (val[0]["loss"], val[1]["loss"])
    assert result["val/loss"] == pytest.approx(val[1]["loss"])
    data = {r["prefix"]: r for r in records if r["prefix"].startswith("data/")}
    # 999 rows, less 50 held out and 2 copies of held-out rows.
    assert data["data/train"]["kept"] + data["data/train"]["dropped"] == data["data/train"]["rows"] == 947
    assert result["train/tokens_per_s"] > 0 and result["step"] == 12
    assert not undocumented_metrics(tmp_path / "logs")


# A sampling temperature (in a policy section shared with a GRPO config) does not change what SFT
# trains: nothing is sampled, and the exported model is evaluated as it is.
@pytest.mark.parametrize("temperature", [[], ["policy.generation.temperature=0.5"]], ids=["default", "temperature"])
def test_step0_loss_matches_transformers_cross_entropy_with_packing(ray_session, stories260k, tmp_path, temperature):
    cfg = _cfg(tmp_path, stories260k, "sft.max_num_steps=1", "sft.val_at_start=false", "sft.val_period=0",
               "sft.val_at_end=false", "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=512",
               "policy.sequence_packing.logprob_mb_tokens=512", *temperature)
    s = sft.setup(cfg)
    try:
        batch = collate(next(copy.deepcopy(s.loader)), s.tokenizer.pad_token_id)
        result = sft.sft_train(s)
    finally:
        s.run.shutdown()
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    labels = batch["input_ids"].masked_fill(batch["token_mask"] == 0, -100)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], labels=labels).loss.item()
    assert result["train/loss"] == pytest.approx(expected, abs=1e-4)
    # Packed: a 512-token budget holds two or more of these sequences per micro-batch.
    assert result["train/num_microbatches"] <= cfg.policy.train_global_batch_size / 2


def test_checkpoint_and_resume(ray_session, shared_data, tmp_path, monkeypatch, kill_after_save):
    # On the shared alpaca demo rows. The first run is killed right after its checkpoint of step 2.
    overrides = ["checkpointing.enabled=true", "checkpointing.save_period=2", "sft.val_period=0",
                 "sft.val_at_start=false", "sft.val_at_end=false", "policy.max_total_sequence_length=256"]
    kill_after_save(2)
    with pytest.raises(kill_after_save.error):
        sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=4", *overrides))
    assert (tmp_path / "ckpt" / "step_2" / "COMPLETE").is_file()
    monkeypatch.undo()
    second = sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=3", *overrides))
    assert second["step"] == 3
    records = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    # The second run started at step 3, not 1; step 2, which it does not log again, was logged
    # before its save (after it, the kill lost it). The save's time is a record of its own after
    # the save: the kill lost step 2's, the resumed run's save of step 3 has one.
    assert [r["step"] for r in records if r["prefix"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in records if r["prefix"] == "train/timing" and r["checkpoint"] > 0] == [3]
    info = json.loads((tmp_path / "ckpt" / "step_3" / "training_info.json").read_text())
    assert info["dataloader"]["index"] == 3 * 8
    # Other training rows (fewer of them) cannot continue at the saved position: the resume fails
    # before any worker starts, naming the config change. (A larger validation split changes
    # nothing here: a run that never validates holds no rows out.)
    monkeypatch.setattr(offline, "RayVirtualCluster", lambda *a, **k: pytest.fail("the cluster was started"))
    with pytest.raises(InputError, match=r"step_3: the checkpoint's data loader saw 269 rows but the dataset now "
                                         r"has 80.*data.max_train_samples: null -> 300.*start_fresh"):
        sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=4", "data.max_train_samples=300", *overrides))
    # A step count lowered below the checkpoint's would train nothing: it fails the same way.
    with pytest.raises(ConfigError, match=r"step_3 is at step 3, past sft.max_num_steps=2"):
        sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=2", *overrides))
    # A shard whose bytes were damaged after the save (cut and refilled to its size, which the
    # completeness check compares) fails naming the checkpoint: it was an 86-line traceback.
    monkeypatch.undo()
    shard = next((tmp_path / "ckpt" / "step_3" / "policy").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
        f.truncate(size)
    with pytest.raises(InputError, match=r"checkpoint .*step_3 cannot be loaded \(.*\): one of its files is damaged; "
                                         r"move that folder aside"):
        sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=4", *overrides))


@pytest.mark.extended  # the same ranking for every loop: test_grpo.py's test of this name
def test_only_a_steps_own_validation_ranks_its_checkpoint(ray_session, shared_data, tmp_path):
    # Validation at step 2 only: step 3's checkpoint was not measured. Ranked by step 2's loss (a
    # tie that the newer one wins), it displaced step 2, the one checkpoint the loss was measured on.
    run = sft.run(_cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=3", "sft.val_period=2", "sft.val_at_start=false",
                       "sft.val_at_end=false", "sft.val_batches=1", "checkpointing.enabled=true",
                       "checkpointing.save_period=1", "checkpointing.keep_top_k=1", "checkpointing.metric_name=val:loss",
                       "checkpointing.higher_is_better=false"))
    assert run["step"] == 3
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_3"]
    info = [json.loads((ckpt / name / "training_info.json").read_text()) for name in ("step_2", "step_3")]
    assert info[0]["metric_value"] == pytest.approx(run["val/loss"]) and info[1]["metric_value"] is None
    assert (info[1]["best_step"], info[1]["best_metric_value"]) == (2, info[0]["metric_value"])


def test_a_complete_run_started_again_returns_its_result_without_starting_workers(ray_session, shared_data,
                                                                                  tmp_path, monkeypatch):
    # It started Ray and the policy workers (~40 s), exported the same weights again and returned
    # the result of no step.
    cfg = _cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=2", "sft.val_period=0", "sft.val_at_start=false",
               "sft.val_batches=1", "checkpointing.enabled=true", "checkpointing.export_hf_at_end=true")
    first = sft.run(cfg)
    assert (tmp_path / "logs" / "hf" / "config.json").is_file()
    monkeypatch.setattr(offline, "RayVirtualCluster", None)  # any start of workers fails
    again = sft.run(cfg)
    assert again.pop("already_complete") is True and again == first
    # (A step left, or no export recorded: it sets up and trains; tests/unit/test_checkpoint.py.)
    # Its export deleted: started again, it exports once more and returns the same result (it
    # returned that of no step, {}).
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "logs" / "hf")
    exported = sft.run(cfg)
    assert (tmp_path / "logs" / "hf" / "config.json").is_file()
    assert exported.pop("already_complete") is True and exported == first


def test_a_misspelt_metric_name_found_at_the_first_validation_keeps_the_steps_before_it(ray_session, shared_data,
                                                                                       tmp_path):
    # Without validation at step 0 the typo shows at step 2's: it stopped the run with steps 1-2 unsaved.
    from posttrain.checkpoint import MetricNameError

    cfg = _cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=3", "sft.val_period=2", "sft.val_at_start=false",
               "sft.val_batches=1", "checkpointing.enabled=true", "checkpointing.save_period=10",
               "checkpointing.metric_name=val:los", "checkpointing.higher_is_better=false")
    with pytest.raises(MetricNameError, match=r"checkpointing.metric_name='val:los' is not a metric this run logs; "
                                              r"did you mean 'val:loss'\?"):
        sft.run(cfg)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_2"]
    assert json.loads((tmp_path / "ckpt" / "step_2" / "training_info.json").read_text())["step"] == 2


# Both in CI: the other SFT runs that validate do so at their last step by val_period, so with
# True extended no CI test noticed a val_at_end the loop ignored.
@pytest.mark.parametrize("val_at_end", [True, False])
def test_val_at_end_validates_after_the_last_step(ray_session, shared_data, tmp_path, val_at_end):
    # val_period=0: no periodic validation; sft.val_at_end alone decides whether the run ends
    # with one (as grpo.val_at_end does for GRPO).
    cfg = _cfg(tmp_path, "embedded:tiny", "sft.max_num_steps=1", "sft.val_period=0", "sft.val_at_start=false",
               f"sft.val_at_end={str(val_at_end).lower()}", "sft.val_batches=1", "sft.val_global_batch_size=8")
    result = sft.run(cfg)
    records = list(map(json.loads, open(tmp_path / "logs" / "metrics.jsonl")))
    val_steps = [r["step"] for r in records if r["prefix"] == "val"]
    assert result["step"] == 1
    assert val_steps == ([1] if val_at_end else [])
    assert ("val/loss" in result) is val_at_end
    assert result.get("val/step") == (1 if val_at_end else None)  # the step its val/ metrics are of
    # step_time_s is the whole step's, as GRPO's (it was the workers' optimizer step alone, which
    # leaves out the data, the validation and the checkpoint).
    train = next(r for r in records if r["prefix"] == "train")
    phases = sum(v for k, v in train.items() if k.startswith("timing/") and k.count("/") == 1)
    assert train["step_time_s"] >= phases >= train["timing/training"] > train["optimizer_step_time_s"] > 0


def test_too_few_rows_for_a_batch_says_how_many_the_context_length_left_out(shared_data, tmp_path):
    # 947 Alpaca training rows, most longer than 128 characters (the embedded tokenizer's tokens): the
    # error said only "the dataset has 90 rows ... add data", as the counts that explain it are logged
    # once the run starts. No ray_session: it fails before Ray starts.
    cfg = _cfg(tmp_path, "embedded:tiny", "policy.max_total_sequence_length=128", "policy.train_global_batch_size=128",
               "policy.train_micro_batch_size=8")
    with pytest.raises(InputError) as err:
        sft.setup(cfg)
    m = re.fullmatch(r"train split: the dataset has (\d+) rows, fewer than one batch of 128: add data or lower "
                     r"policy.train_global_batch_size; (\d+) of the split's 947 rows were left out \((\d+) longer than "
                     r"128 tokens, dropped; 0 without a loss token in their first 128\): a longer "
                     r"policy.max_total_sequence_length / data.max_input_seq_length keeps those the limit cut",
                     str(err.value))
    assert m, err.value
    kept, left_out, dropped = map(int, m.groups())
    assert kept + left_out == 947 and left_out == dropped and kept < 128


def test_packing_checks_only_the_validation_rows_validation_runs_on(tmp_path):
    # sft.val_batches x sft.val_global_batch_size rows are validated; a longer row after them
    # failed the setup's packing check ("raise policy.sequence_packing.logprob_mb_tokens").
    def write(name, answers):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Q"},
                                                         {"role": "assistant", "content": a}]}) + "\n"
                                for a in answers))
        return path

    train, val = write("train.jsonl", ["short"] * 8), write("val.jsonl", ["short", "short", "long " * 40])
    overrides = ["data.dataset_name=local", f"data.train_data_path={train}", f"data.val_data_path={val}",
                 "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64",
                 "policy.sequence_packing.logprob_mb_tokens=64", "sft.val_global_batch_size=2"]
    cfg = _cfg(tmp_path, "embedded:tiny", *overrides, "sft.val_batches=1")
    data = offline.offline_data(cfg, "sft", process_sft_rows, collate)
    assert [b.size for b in data.val_batches] == [2]
    offline.check_packing_budgets(cfg.policy, data, logprobs_of_train=False, max_len=512)
    # Validated, the long row still fails before any worker starts.
    cfg = _cfg(tmp_path, "embedded:tiny", *overrides, "sft.val_batches=2")
    data = offline.offline_data(cfg, "sft", process_sft_rows, collate)
    with pytest.raises(InputError, match=r"logprob_mb_tokens=64 is less than the longest val row, \d+ tokens"):
        offline.check_packing_budgets(cfg.policy, data, logprobs_of_train=False, max_len=512)
