"""Optimizer and scheduler chains built from config by name."""

import pytest
import torch

from posttrain.policy.optim import build_optimizer, build_scheduler
from posttrain.schemas import OptimizerConfig, SchedulerEntry


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("Adam", torch.optim.Adam),
                                      ("sgd", torch.optim.SGD), ("torch.optim.AdamW", torch.optim.AdamW)])
def test_optimizer_by_name(name, cls):
    opt = build_optimizer(_params(), OptimizerConfig(name=name, kwargs={"lr": 0.1}))
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.1


def test_unknown_optimizer_lists_valid():
    with pytest.raises(ValueError, match="adamw, adam, sgd"):
        build_optimizer(_params(), OptimizerConfig(name="lion", kwargs={"lr": 0.1}))
    with pytest.raises(ValueError, match="cannot import"):
        build_optimizer(_params(), OptimizerConfig(name="torch.optim.Nope", kwargs={"lr": 0.1}))
    with pytest.raises(ValueError, match="kwargs"):
        build_optimizer(_params(), OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "betas": (0.9, 0.9)}))


def _lrs(entries, steps):
    opt = build_optimizer(_params(), OptimizerConfig(name="sgd", kwargs={"lr": 1.0}))
    sched = build_scheduler(opt, [SchedulerEntry(**e) for e in entries])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_no_scheduler_is_constant():
    assert _lrs([], 3) == [1.0, 1.0, 1.0]


def test_warmup_then_constant_sequential():
    # NeMo RL's usual chain: linear warmup over 2 steps, then constant, switching at step 2.
    lrs = _lrs([
        {"name": "torch.optim.lr_scheduler.LinearLR",
         "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 2}},
        {"name": "ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10}},
        {"milestones": [2]},
    ], 5)
    assert lrs == pytest.approx([0.5, 0.75, 1.0, 1.0, 1.0])


def test_single_cosine():
    lrs = _lrs([{"name": "CosineAnnealingLR", "kwargs": {"T_max": 2, "eta_min": 0.0}}], 3)
    assert lrs == pytest.approx([1.0, 0.5, 0.0], abs=1e-7)


def test_bad_scheduler_config():
    with pytest.raises(ValueError, match="unknown policy.scheduler name 'Warmup'.*LinearLR"):
        _lrs([{"name": "Warmup"}], 1)
    with pytest.raises(ValueError, match="milestones"):
        _lrs([{"name": "ConstantLR"}, {"name": "LinearLR"}], 1)
