"""policy.skip_zero_gradient_samples: rows whose gradient is exactly zero (a GRPO group with one
reward for all its samples, a masked-out sample) are left out of the training passes, and the
update is still the whole batch's. Checked against a plain transformers SGD step over every row,
with the skip off (1 worker) and on (2 workers, one of which has only zero-gradient rows).

Tolerances as in test_policy.py (fp32): loss and grad norm 1e-5 relative, parameters 2e-6 absolute.
"""

import pytest
import torch

from policy_oracle import full_state, make_batch, one_and_two_workers, sgd_step_reference
from posttrain.losses import ClippedPGLoss
from posttrain.schemas import PolicyConfig

LR = 0.5


def _cfg(workers: int) -> PolicyConfig:
    return PolicyConfig(model_name="embedded:tiny", precision="float32", train_global_batch_size=8,
                        train_micro_batch_size=2, logprob_batch_size=8, max_total_sequence_length=32,
                        max_grad_norm=None, optimizer={"name": "sgd", "kwargs": {"lr": LR}},
                        skip_zero_gradient_samples=workers == 2)


def _grpo_batch():
    """8 rows in two contiguous worker shards: rows 0-3 all have a zero advantage; of rows 4-7,
    row 5 has sample_mask 0 (overlong filtering) and rows 4, 6, 7 are trained. No prev_logprobs:
    one optimizer step on-policy, prev = the current logprobs detached on both sides."""
    batch = make_batch(lengths=[16, 9, 12, 5, 7, 14, 10, 16], seed=3)
    zeros = torch.zeros_like(batch["token_mask"])
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.3, -0.7, -0.4, 0.9])[:, None] * batch["token_mask"]
    batch.update(generation_logprobs=zeros, advantages=adv)
    batch["sample_mask"][5] = 0.0
    return batch


@pytest.fixture(scope="module")
def policies(ray_session):
    with one_and_two_workers(_cfg, "zerograd") as pair:
        yield pair


def test_skipped_rows_leave_the_update_unchanged(policies, tiny_model_path):
    batch = _grpo_batch()
    loss_fn = ClippedPGLoss({})
    assert loss_fn.zero_gradient_rows(batch).tolist() == [True] * 4 + [False, True, False, False]
    loss, grad_norm, expected = sgd_step_reference(tiny_model_path, batch, LR, loss_fn=loss_fn)
    assert grad_norm > 0
    valid_toks = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum(1)
    pg_loss = {}
    for policy, skipped in zip(policies, (0.0, 5 / 8)):  # rows 0-3 and 5
        m = policy.train(batch, loss_fn)
        pg_loss[skipped] = m["pg_loss"]
        assert m["loss"] == pytest.approx(loss, rel=1e-5)
        assert m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        # Skip on: the first worker runs one of its zero-gradient rows (every rank runs a pass) as
        # a placeholder, left out all the same, and the second leaves out row 5; the loss's means
        # are over the rows trained, its count of samples the batch's (it said 4, the rows run).
        assert m["zero_gradient_fraction"] == skipped
        assert m["num_valid_samples"] == 7
        assert m["global_valid_seqs"] == 7 and m["global_valid_toks"] == float(
            (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum())
        state = full_state(policy)
        for k, v in expected.items():
            torch.testing.assert_close(state[k], v, atol=2e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")
    # The per-token means are over the rows trained (4, 6, 7), where the one worker without the skip
    # means over every valid row: the same sum. The first worker's placeholder row was counted
    # among them (and so pg_loss depended on the number of workers).
    assert pg_loss[5 / 8] * float(valid_toks[[4, 6, 7]].sum()) == pytest.approx(pg_loss[0.0] * float(valid_toks.sum()),
                                                                             rel=1e-5)


def test_skipped_rows_leave_a_sequence_level_update_unchanged(policies, tiny_model_path, tmp_path):
    # A sequence-level loss is rescaled by the sequences trained (3 of 7), not by their tokens:
    # the update was off by the rows' length differences. From the weights the policies hold now.
    from transformers import AutoModelForCausalLM

    now = full_state(policies[0])
    for k, v in full_state(policies[1]).items():  # the same steps so far
        torch.testing.assert_close(v, now[k], atol=2e-6, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.load_state_dict(now)
    model.save_pretrained(tmp_path / "now")
    batch, loss_fn = _grpo_batch(), ClippedPGLoss({"token_level_loss": False})
    loss, grad_norm, expected = sgd_step_reference(str(tmp_path / "now"), batch, LR, loss_fn=loss_fn)
    for policy in policies:
        m = policy.train(batch, loss_fn)
        assert m["loss"] == pytest.approx(loss, rel=1e-5) and m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        state = full_state(policy)
        for k, v in expected.items():
            torch.testing.assert_close(state[k], v, atol=2e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


def test_a_step_whose_rows_all_have_zero_gradient_counts_them_all_left_out(policies):
    # Every group solved (or failed) alike: the row each rank runs for the passes was counted as
    # trained (num_valid_samples 2, a zero_gradient_fraction of 6/8). It still measures the step
    # (the generation's logprob error, the ratio), the only row that can.
    import math

    batch = _grpo_batch()
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    for policy, skip in zip(policies, (False, True)):
        m = policy.train(batch, ClippedPGLoss({}))
        assert m["num_valid_samples"] == 7.0 and m["grad_norm"] == 0.0 and math.isfinite(m["loss"])
        assert m["zero_gradient_fraction"] == (1.0 if skip else 0.0)
        assert m["probs_ratio"] == pytest.approx(1.0) and math.isfinite(m["token_mult_prob_error"])


def test_a_step_without_one_valid_token_has_no_ratio_measurements(policies):
    # Every sample masked (an environment that failed them all): masked_min/max's +-inf of that
    # optimizer step is no measurement, and no longer turns the step's mean into a non-finite value.
    import math

    from posttrain.data.batch import BatchedDataDict

    masked, normal = _grpo_batch(), _grpo_batch()
    masked["sample_mask"][:] = 0.0
    for policy in policies:
        m = policy.train(masked, ClippedPGLoss({}))
        assert [k for k in m if k.endswith(("_min", "_max"))] == [] and math.isfinite(m["loss"])
        assert "probs_ratio" not in m and m["num_valid_samples"] == 0.0
        m = policy.train(BatchedDataDict.from_batches([masked, normal]), ClippedPGLoss({}))
        assert m["num_optimizer_steps"] == 2
        for k in ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
            assert math.isfinite(m[k]), k
        # Nor its means of 0: the ratio is the measuring step's (1: on-policy), not half of it.
        assert m["probs_ratio"] == pytest.approx(1.0) and m["probs_ratio_clamped"] == pytest.approx(1.0)
