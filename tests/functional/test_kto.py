"""KTO end to end (`posttrain.algorithms.kto.run`) on stories260K (converted from ../shared/data)
and the LLaMA-Factory demo KTO data:

- held-out examples move to their label's side of the reference point (accuracy well above its
  0 at the start, desirable rewards above undesirable ones);
- a step's loss and reference point equal an independent torch computation of the same formulas
  on the same models and batch, against a reference that differs from the policy.
"""

import copy
import json
import shutil

import pytest
import torch
from docs_helpers import undocumented_metrics
from offline_helpers import offline_cfg
from transformers import AutoModelForCausalLM

from posttrain.algorithms import kto
from posttrain.data.processors import collate_kto


def _cfg(tmp_path, model, shared_data, *overrides):
    return offline_cfg(
        "kto", tmp_path, model, f"data.dataset_name={shared_data}/llamafactory_demo/kto_en_demo.json",
        "data.val_split_fraction=0.2", "data.truncation=truncate", "policy.max_total_sequence_length=512",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16",
        "policy.optimizer.kwargs={lr: 2.0e-4, weight_decay: 0.0}", "kto.val_global_batch_size=64", *overrides,
    )


# Extended (~3.5 min on a 2-core AVX2 CPU): KTO's loss, reference point and run loop,
# test_a_steps_loss_and_reference_point_match_an_independent_computation; an offline run that
# learns, test_dpo.py::test_dpo_raises_heldout_preference_accuracy.
@pytest.mark.slow
@pytest.mark.extended
def test_kto_moves_held_out_responses_to_their_side(ray_session, stories260k, shared_data, tmp_path):
    result = kto.run(_cfg(tmp_path, stories260k, shared_data, "kto.max_num_epochs=3", "kto.max_num_steps=24",
                          "kto.val_period=24"))
    val = [r for r in map(json.loads, open(tmp_path / "logs" / "metrics.jsonl")) if r["prefix"] == "val"]
    assert [r["step"] for r in val] == [0, 24]
    # Step 0: policy == reference, every reward and the reference point are 0 (a tie is on no side).
    assert val[0]["loss"] == pytest.approx(0.5) and val[0]["accuracy"] == 0 and val[0]["kl"] == 0
    # 34 held-out examples (the rest of the 60 lose every response token to the context): chance is
    # 0.5 +- 0.09.
    assert result["val/accuracy"] >= 0.6, val
    assert result["val/reward_margin"] > 0 and result["val/rewards_desirable_mean"] > result["val/rewards_undesirable_mean"]
    assert not undocumented_metrics(tmp_path / "logs")


def _sums(model, ids, lengths, mask):
    """Independent of posttrain's code: a plain forward, log_softmax, gather, sum over the masked tokens."""
    out = []
    with torch.no_grad():
        for row, n, m in zip(ids, lengths, mask):
            logits = model(input_ids=row[None, :n]).logits[0]
            lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, row[1:n, None])[:, 0]
            out.append((lp * m[1:n]).sum())
    return torch.stack(out)


def test_a_steps_loss_and_reference_point_match_an_independent_computation(ray_session, stories260k, shared_data,
                                                                            tmp_path):
    # A reference other than the policy: rewards and the reference point are not 0 at the first step.
    reference = tmp_path / "reference"
    shutil.copytree(stories260k, reference)
    ref_model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.002 * torch.randn(p.shape, generator=g))
    ref_model.save_pretrained(reference)
    beta, w_d, w_u = 0.3, 1.0, 1.4
    cfg = _cfg(tmp_path, stories260k, shared_data, f"policy.reference_model_name={reference}", "kto.max_num_steps=1",
               "kto.val_at_start=false", "kto.val_period=0", "kto.val_at_end=false",
               f"kto.reference_policy_kl_penalty={beta}", f"kto.desirable_weight={w_d}", f"kto.undesirable_weight={w_u}")
    s = kto.setup(cfg)
    try:
        batch = collate_kto(next(copy.deepcopy(s.loader)), s.tokenizer.pad_token_id, 512)
        result = kto.kto_train(s)
    finally:
        s.run.shutdown()
    policy = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    ref_model.eval()
    rows = (batch["input_ids"], batch["input_lengths"], batch["token_mask"])
    kl_rows = (batch["kl_input_ids"], batch["kl_input_lengths"], batch["kl_token_mask"])
    r = _sums(policy, *rows) - _sums(ref_model, *rows)
    z = (_sums(policy, *kl_rows) - _sums(ref_model, *kl_rows)).mean().clamp(min=0)
    desirable = batch["kto_label"]
    per = (desirable * w_d * (1 - torch.sigmoid(beta * (r - z)))
           + (1 - desirable) * w_u * (1 - torch.sigmoid(beta * (z - r))))
    assert z > 0  # the reference point is in play, not clamped (2.57 here; rewards -7 to 13)
    assert result["train/kl"] == pytest.approx(z.item(), rel=1e-4, abs=1e-4)
    assert result["train/loss"] == pytest.approx(per.mean().item(), abs=1e-5)
    assert result["train/rewards_desirable_mean"] == pytest.approx((beta * r)[desirable == 1].mean().item(), abs=1e-4)
    assert 0 < desirable.sum() < len(desirable)  # both labels in the batch: the check covers both branches


def test_packing_checks_the_mismatched_pairs_kto_can_draw(tmp_path):
    # One row with a long prompt, another with a long response: each fits the logprob budget, the
    # first's prompt with the second's response (the KL estimate's pair) does not. The check passed
    # and the step that drew that pair failed ("a sequence has 85 tokens, more than ... 64").
    from posttrain.algorithms import offline
    from posttrain.config import InputError
    from posttrain.data.formats import labelled_rows
    from posttrain.data.processors import process_kto_rows

    path = tmp_path / "kto.jsonl"
    rows = [r for i in range(4) for r in ((f"Q{i} " * 20, "A", True), (f"Q{i}", f"A{i} " * 20, False))]
    path.write_text("".join(json.dumps({"prompt": p, "completion": c, "label": lab}) + "\n" for p, c, lab in rows))

    def setup(budget):
        cfg = offline_cfg("kto", tmp_path, "embedded:tiny", "data.dataset_name=local", f"data.train_data_path={path}",
                          "data.val_split_fraction=0.25", "policy.sequence_packing.enabled=true",
                          f"policy.sequence_packing.train_mb_tokens={budget}",
                          f"policy.sequence_packing.logprob_mb_tokens={budget}", "policy.train_global_batch_size=4")
        with labelled_rows():
            data = offline.offline_data(cfg, "kto", process_kto_rows, lambda ex, pad: collate_kto(ex, pad, 512))
        longest_row = max(len(ex["input_ids"]) for ex in data.loader.rows)
        offline.check_packing_budgets(cfg.policy, data, logprobs_of_train=True, max_len=512)
        return longest_row

    longest_row = setup(512)
    with pytest.raises(InputError, match=r"logprob_mb_tokens=\d+ is less than the longest train mismatched pair"):
        setup(longest_row)
