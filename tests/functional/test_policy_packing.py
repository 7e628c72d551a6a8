"""Sequence packing, dynamic batching and prefix sharing (dense and blockwise attention) give
the same logprobs and the same train step (with grad-norm clipping, CPU offload and activation
checkpointing on the way) as a plain transformers model (fp32; logprobs 2e-5 absolute,
loss/grad norm 1e-5 relative, parameters after one SGD step 2e-6 absolute)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from policy_oracle import make_batch, reference_logprobs, sgd_step_reference
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.losses.nll import NLLLoss
from posttrain.policy.lm_policy import Policy
from posttrain.schemas import ClusterConfig, PolicyConfig

LR = 0.5
MODES = {
    # Budgets below the batch's 42 tokens force several micro-batches (packing: rows of 16 tokens, two
    # per training micro-batch, one per logprob micro-batch);
    # packed rows are padded to multiples of 8 to exercise the padding segment too.
    "packing": {"sequence_packing": {"enabled": True, "train_mb_tokens": 32, "logprob_mb_tokens": 20,
                                     "sequence_length_round": 8},
                # Neither changes the numbers; checked here on the way.
                "dtensor_cfg": {"cpu_offload": True}},
    "dynamic": {"dynamic_batching": {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 30,
                                     "sequence_length_round": 4},
                "dtensor_cfg": {"activation_checkpointing": True},
                "max_grad_norm": 0.5},  # below the first step's grad norm (~2.8): clipping applies
    # Two workers, one with fewer micro-batches (rows 16 + 16 | 5 + 4): it runs a padding pass for
    # the other's collectives, whose gradient must count for nothing.
    "dynamic_two_workers": {"dynamic_batching": {"enabled": True, "train_mb_tokens": 16, "logprob_mb_tokens": 16,
                                                 "sequence_length_round": 1}},
    # policy.prefix_sharing is on by default; these rows share an 8-token prompt (shared_prefix_batch).
    "shared_prefix": {"train_micro_batch_size": 4, "logprob_batch_size": 4},
    # 16 rows sharing an 8-token prompt: one packed row of 520 tokens, long enough for blockwise attention.
    "shared_prefix_blockwise": {"train_global_batch_size": 16, "train_micro_batch_size": 16,
                                "logprob_batch_size": 16, "max_total_sequence_length": 48},
}


@pytest.fixture(scope="module")
def policies(ray_session):
    def build(name: str):
        # Half a CPU each (one thread all the same): the six workers fit the session's 4 CPUs.
        workers = 2 if name == "dynamic_two_workers" else 1
        cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, cpus_per_worker=0.5), name=name)
        cfg = PolicyConfig(**{"model_name": "embedded:tiny", "precision": "float32", "train_global_batch_size": 4,
                              "train_micro_batch_size": 1, "max_total_sequence_length": 32, "max_grad_norm": None,
                              "optimizer": {"name": "sgd", "kwargs": {"lr": LR}}, **MODES[name]})
        return cluster, Policy(cluster, cfg, init_reference=False, name_prefix=name)

    with ThreadPoolExecutor(len(MODES)) as pool:  # start up concurrently
        made = dict(zip(MODES, pool.map(build, MODES)))
    yield {k: v[1] for k, v in made.items()}
    for cluster, policy in made.values():
        policy.shutdown()
        cluster.shutdown()


def shared_prefix_batch(lengths=(16, 12, 14, 10)):
    """Rows (lengths 16, 12, 14, 10 by default) with the same first 8 tokens and the loss after them."""
    batch = make_batch(lengths=list(lengths), seq=max(lengths))
    batch["input_ids"][1:, :8] = batch["input_ids"][0, :8]
    batch["token_mask"][:, :8] = 0
    return batch


@pytest.mark.parametrize("mode", list(MODES))
def test_logprobs_and_train_step_match_unpacked(policies, mode, tiny_model_path):
    policy = policies[mode]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    batch = {"shared_prefix": shared_prefix_batch, "shared_prefix_blockwise": lambda: shared_prefix_batch([40] * 16),
             "dynamic_two_workers": lambda: make_batch(lengths=[16, 16, 5, 4])}.get(mode, make_batch)()
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], reference_logprobs(hf, batch),
                               atol=2e-5, rtol=0)
    loss, grad_norm, expected = sgd_step_reference(tiny_model_path, batch, LR, policy.cfg.max_grad_norm)
    assert policy.cfg.max_grad_norm is None or policy.cfg.max_grad_norm < grad_norm
    m = policy.train(batch, NLLLoss())
    if mode == "shared_prefix":  # one packed row: the prompt once, then the four continuations
        assert m["model_tokens"] == 8 + 8 + 4 + 6 + 2 < m["num_tokens"] == 52
    elif mode == "shared_prefix_blockwise":  # shared only because blockwise (dense: 520^2 scores cost too much)
        assert m["model_tokens"] == 8 + 16 * 32 < m["num_tokens"] == 16 * 40
    else:
        assert m["num_microbatches"] > 1
    assert m["loss"] == pytest.approx(loss, rel=1e-5) and m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    state = ray.get(policy.full_state_dict_ref())
    for k, v in expected.items():
        torch.testing.assert_close(state[k], v, atol=2e-6, rtol=0)



def test_packing_that_packs_nothing_pads_the_rows_to_the_longest_only(policies):
    # Four rows of 9 tokens, one per packed row (two do not fit a row of 16): they were padded to
    # sequence_length_round (8), 64 positions run for 36 tokens; packing off ran 36.
    m = policies["packing"].train(make_batch(lengths=[9, 9, 9, 9]), NLLLoss())
    assert m["model_tokens"] == 36 and m["num_microbatches"] == 2
