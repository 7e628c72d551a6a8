"""policy.compile: the decoder layers' forwards run compiled (torch.compile, inductor) in the
training and logprob passes and compute what the eager layers compute: float32 logprobs, and
one SGD step's loss, gradient norm and weights, within 1e-5 of eager (the fused kernels sum in
another order), on plain rows and on shared-prefix rows under blockwise attention; a batch of
other lengths runs on the same compiled graphs (symbolic shapes). Two FSDP2 workers, whose
hooks gather each layer's shards around its compiled forward, take the plain model's SGD step
(1e-5, dynamo's aot_eager backend). Settings that cannot compile fail at load or worker setup,
naming the key."""

import pytest
import torch
from policy_oracle import full_state, make_batch, prompt_batch, sgd_step_reference
from torch._dynamo.utils import counters

from posttrain.config import ConfigError
from posttrain.losses.nll import NLLLoss
from posttrain.policy.fsdp_worker import FSDPPolicyWorker, check_compile
from posttrain.schemas import ClusterConfig, CompileConfig, PolicyConfig

LR = 0.5


@pytest.fixture
def make_worker(tiny_model_path, single_rank_worker_env):
    def make(compiled: bool, **policy) -> FSDPPolicyWorker:
        cfg = PolicyConfig(model_name=tiny_model_path, precision="float32", max_total_sequence_length=32,
                           logprob_batch_size=8, train_global_batch_size=4, train_micro_batch_size=4,
                           max_grad_norm=None, optimizer={"name": "sgd", "kwargs": {"lr": LR}},
                           compile={"enabled": compiled}, **policy)
        worker = FSDPPolicyWorker(cfg, init_reference=False)
        worker.setup()
        return worker

    return make


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


# Extended: inductor builds its kernels in ~2 min on a 2-core AVX2 CPU; the settings that cannot
# compile fail at load or set-up in the tests below, which CI runs.
@pytest.mark.extended
def test_compiled_layers_compute_what_eager_ones_do(make_worker):
    eager = make_worker(False)
    counters.clear()  # the compiled worker's set-up runs its layers too (the rows-stay-apart check)
    compiled = make_worker(True)
    plain = prompt_batch([9, 6, 11, 7], [20, 14, 17, 12], shared=False)
    shared = prompt_batch([9, 9, 9, 9], [20, 14, 17, 12], shared=True)  # one packed row, blockwise attention
    for b in (plain, shared):
        torch.testing.assert_close(compiled.get_logprobs(b)["logprobs"], eager.get_logprobs(b)["logprobs"],
                                   atol=1e-5, rtol=0)
    assert _graphs() >= 1  # the layers ran compiled
    before = {k: v.clone() for k, v in eager.model.state_dict().items()}
    for b in (shared, plain):
        m_eager, m_compiled = eager.train(b, NLLLoss(), 4), compiled.train(b, NLLLoss(), 4)
        assert m_compiled["loss"] == pytest.approx(m_eager["loss"], rel=1e-5)
        assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-5)
    moved = 0.0
    state = compiled.model.state_dict()
    for k, v in eager.model.state_dict().items():  # the compiled forward's names and weights are the model's
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        moved = max(moved, float((v - before[k]).abs().max()))
    assert moved > 1e-2  # the steps moved the weights by far more than the tolerance
    graphs = _graphs()
    other = prompt_batch([5, 5, 5], [9, 23, 30], shared=True, seed=1)  # new lengths and row count
    compiled.get_logprobs(other)
    compiled.train(prompt_batch([3, 4, 8, 2], [11, 25, 9, 31], shared=False, seed=2), NLLLoss(), 4)
    assert _graphs() == graphs  # no recompile: the graphs take symbolic shapes


@pytest.mark.extended  # compiled layers: test_compiled_layers_compute_what_eager_ones_do; FSDP2: test_policy.py
def test_fsdp2_workers_take_the_plain_models_step_compiled(ray_session, tiny_model_path):
    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.policy.lm_policy import Policy

    cfg = PolicyConfig(model_name=tiny_model_path, precision="float32", train_global_batch_size=4,
                       train_micro_batch_size=2, max_total_sequence_length=32, max_grad_norm=None,
                       optimizer={"name": "sgd", "kwargs": {"lr": LR}},
                       # aot_eager: dynamo and AOTAutograd as inductor has them, without its ~90 s of kernel
                       # building in two processes; the test above runs inductor's kernels.
                       compile={"enabled": True, "backend": "aot_eager"})
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, cpus_per_worker=1), name="compiled2")
    try:
        policy = Policy(cluster, cfg, init_reference=False, name_prefix="compiled2")
        try:
            batch = make_batch()
            loss, grad_norm, state = sgd_step_reference(tiny_model_path, batch, LR)
            m = policy.train(batch, NLLLoss())
            assert m["loss"] == pytest.approx(loss, rel=1e-5) and m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
            for k, v in full_state(policy).items():
                torch.testing.assert_close(v, state[k], atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


def test_compile_settings_that_cannot_run_fail_at_setup(monkeypatch):
    with pytest.raises(ConfigError, match=r"policy\.compile\.backend='no_such_backend'.*available: .*inductor"):
        check_compile(CompileConfig(enabled=True, backend="no_such_backend"), torch.device("cpu"))
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    with pytest.raises(ConfigError, match=r"policy\.compile\.enabled .* C\+\+ compiler.*/nonexistent/c\+\+"):
        check_compile(CompileConfig(enabled=True), torch.device("cpu"))
    check_compile(CompileConfig(enabled=True, backend="aot_eager"), torch.device("cpu"))  # builds no C++
    with pytest.raises(ValueError, match=r"tensor_parallel_size > 1 does not combine with policy\.compile\.enabled"):
        PolicyConfig(compile={"enabled": True}, dtensor_cfg={"tensor_parallel_size": 2})
    # A backend torch lacks fails in the driver's setup, before Ray starts (it failed in the workers).
    from posttrain.algorithms import grpo, offline, sft
    from posttrain.config import load_config

    def no_ray(*_args, **_kwargs):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(grpo, "reserve", no_ray)
    monkeypatch.setattr(offline, "RayVirtualCluster", no_ray)
    for algorithm, setup in (("grpo", grpo.setup), ("sft", sft.setup)):
        cfg = load_config(algorithm, None, ["policy.compile.enabled=true", "policy.compile.backend=nosuch",
                                            "data.dataset_name=arithmetic", "data.num_train=64"])
        with pytest.raises(ConfigError, match=r"policy\.compile\.backend='nosuch' is not a torch.compile backend"):
            setup(cfg)
