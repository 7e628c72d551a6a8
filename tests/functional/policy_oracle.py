"""Plain single-process transformers references for the policy tests (no Ray, no FSDP), and
the pair of 1- and 2-worker policies those tests compare with them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import ray
import torch
from transformers import AutoModelForCausalLM

from posttrain.data.batch import BatchedDataDict
from posttrain.losses import valid_counts

SEQ = 16
LENGTHS = [16, 9, 12, 5]


def make_batch(lengths=LENGTHS, seq=SEQ, seed=0) -> BatchedDataDict:
    """Right-padded rows of random tokens; loss on positions >= 3 (the "response")."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    ids = torch.randint(8, 60, (n, seq), generator=g)
    lengths_t = torch.tensor(lengths)
    pos = torch.arange(seq).unsqueeze(0)
    ids[pos >= lengths_t.unsqueeze(1)] = 0  # pad id of the embedded tokenizer
    token_mask = ((pos >= 3) & (pos < lengths_t.unsqueeze(1))).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lengths_t, token_mask=token_mask,
                           sample_mask=torch.ones(n))


def prompt_batch(prompts: list[int], lengths: list[int], shared: bool, seed: int = 0) -> BatchedDataDict:
    """Rows of random tokens, row r trained from position prompts[r] on; `shared`: every row
    starts with row 0's first prompts[0] tokens (one GRPO group's prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 60, (len(lengths), max(lengths)), generator=g)
    if shared:
        ids[1:, : prompts[0]] = ids[0, : prompts[0]]
    pos = torch.arange(ids.shape[1])[None]
    lens, first = torch.tensor(lengths)[:, None], torch.tensor(prompts)[:, None]
    ids[pos >= lens] = 0
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths),
                           token_mask=((pos >= first) & (pos < lens)).float(), sample_mask=torch.ones(len(lengths)))


def reference_logprobs(model, batch: BatchedDataDict) -> torch.Tensor:
    """log_softmax of a plain forward (each row alone, unpadded) gathered at the next tokens; `[B, S]`.
    As the policy returns them, tokens before a row's first trained one (`token_mask`) are 0."""
    out = torch.zeros(batch["input_ids"].shape)
    for r in range(batch.size):
        n = int(batch["input_lengths"][r])
        ids = batch["input_ids"][r : r + 1, :n]
        logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        out[r, 1:n] = lp
        if "token_mask" in batch:
            trained = (batch["token_mask"][r] > 0).nonzero()
            out[r, : int(trained[0]) if len(trained) else n] = 0.0
    return out


def sgd_step_reference(model_path: str, batch: BatchedDataDict, lr: float, max_grad_norm: float | None = None,
                       loss_fn: Callable | None = None):
    """`loss_fn` over the whole batch (default: NLL over all masked tokens / their count), one
    plain SGD step with optional grad-norm clipping (coefficient min(1, max / (norm + 1e-6)), as
    torch): (loss, grad_norm, new state dict)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    curr = reference_logprobs(model, batch)
    if loss_fn is None:
        mask = batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)
        loss = -(curr * mask).sum() / mask.sum()
    else:
        loss, _ = loss_fn(curr, batch, *valid_counts(batch))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (float(grad_norm) + 1e-6))
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * coef * p.grad
    return loss.item(), grad_norm.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


@contextmanager
def one_and_two_workers(make_cfg: Callable, name: str, **policy_kw) -> Iterator[tuple]:
    """(1-worker Policy, 2-worker Policy) from `make_cfg(workers)`, started concurrently; shut
    down on exit. Callable values of `policy_kw` are called with the worker count."""
    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.policy.lm_policy import Policy
    from posttrain.schemas import ClusterConfig

    def build(workers: int):
        cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, cpus_per_worker=1), name=f"{name}{workers}")
        kw = {k: v(workers) if callable(v) else v for k, v in policy_kw.items()}
        return cluster, Policy(cluster, make_cfg(workers), name_prefix=f"{name}{workers}", **kw)

    with ThreadPoolExecutor(2) as pool:  # the two start up concurrently
        made = list(pool.map(build, (1, 2)))
    try:
        yield made[0][1], made[1][1]
    finally:
        for cluster, policy in made:
            policy.shutdown()
            cluster.shutdown()


def full_state(policy) -> dict[str, torch.Tensor]:
    """The policy's full float32 state dict, fetched from Ray's object store."""
    return ray.get(policy.full_state_dict_ref())
