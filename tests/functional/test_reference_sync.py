"""policy.reference_sync (TR-DPO) in the policy worker: the reference moves to
alpha * policy + (1 - alpha) * reference, a checkpoint keeps the moved reference and a resume
restores it, and a reference of another architecture is refused at setup."""

import pytest
import torch

from posttrain.config import InputError
from posttrain.policy.fsdp_worker import FSDPPolicyWorker
from posttrain.schemas import PolicyConfig


@pytest.fixture
def make_worker(tiny_model_path, single_rank_worker_env):
    def make(precision="float32", **policy) -> FSDPPolicyWorker:
        cfg = PolicyConfig(model_name=tiny_model_path, precision=precision, max_total_sequence_length=32,
                           reference_sync={"enabled": True, "mixup_alpha": 0.25, "sync_steps": 1}, **policy)
        worker = FSDPPolicyWorker(cfg, init_reference=True)
        worker.setup()
        return worker

    return make


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_reference_moves_toward_the_policy_and_a_checkpoint_keeps_it(make_worker, tmp_path, precision):
    worker = make_worker(precision)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the policy "trained": every weight moved
        for p in worker.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    before, policy = _params(worker.reference), _params(worker.model)
    assert all(not torch.equal(before[n], policy[n]) for n in policy)
    worker.sync_reference(0.25)
    after = _params(worker.reference)
    # bf16: the reference is held in the compute dtype, so the mix rounds to it.
    tol = {"atol": 1e-6, "rtol": 1e-6} if precision == "float32" else {"atol": 2e-3, "rtol": 1e-2}
    for n in policy:
        torch.testing.assert_close(after[n], 0.75 * before[n] + 0.25 * policy[n], **tol)

    worker.save_checkpoint(str(tmp_path / "step_1"))
    with torch.no_grad():
        for p in worker.reference.parameters():
            p.zero_()
    worker.load_checkpoint(str(tmp_path / "step_1"))
    restored = _params(worker.reference)
    assert all(torch.equal(restored[n], after[n]) for n in after)


def test_a_checkpoint_without_a_moved_reference_keeps_the_loaded_one(make_worker, tmp_path):
    worker = make_worker()
    worker.cfg = worker.cfg.model_copy(update={"reference_sync": worker.cfg.reference_sync.model_copy(
        update={"enabled": False})})
    worker.save_checkpoint(str(tmp_path / "step_1"))  # sync off: no reference in it
    saved = _params(worker.model)
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.1)
    worker.sync_reference(1.0)
    moved = _params(worker.reference)
    worker.load_checkpoint(str(tmp_path / "step_1"))
    # The policy comes back; the reference has nothing to restore and stays where it is (a run that
    # never synced has the one it loaded).
    assert all(torch.equal(_params(worker.model)[n], saved[n]) for n in saved)
    assert all(torch.equal(_params(worker.reference)[n], moved[n]) and not torch.equal(moved[n], saved[n])
               for n in saved)


def test_a_reference_of_another_architecture_is_refused_at_setup(make_worker):
    with pytest.raises(InputError, match=r"policy.reference_sync: the reference model has no parameter .* of shape "
                                          r".*policy.reference_model_name='embedded:1m' is another architecture"):
        make_worker(reference_model_name="embedded:1m")
