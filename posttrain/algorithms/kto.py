"""Kahneman-Tversky optimisation (`posttrain kto`): preference training on unpaired responses
labelled desirable or not (`posttrain.losses.KTOLoss`), TRL's KTOTrainer's loss.

`run(cfg)` = `setup(cfg)` + `kto_train(setup)`. Batch sizes count examples. Data: conversations
whose last message is the response, with a boolean `label` (LLaMA-Factory's KTO data, TRL's
`prompt`/`completion`/`label`), or preference pairs, each unpaired into its chosen side
(desirable) and its rejected side (not). Before each update (`prepare`): the reference logprobs
of the batch, and KTO's reference point z, the KL estimate from the batch's mismatched pairs
(each prompt with the next example's response) under the policy and the reference (one
reference pass over the rows and the pairs). Validation batches keep their reference logprobs
(until `policy.reference_sync` moves the reference) and recompute z.
"""

from __future__ import annotations

import math

import torch

from posttrain.algorithms.offline import (
    OfflineSetup,
    evaluate,
    max_sequence_length,
    offline_setup,
    offline_train,
    run_and_export,
)
from posttrain.data.batch import BatchedDataDict
from posttrain.data.formats import labelled_rows
from posttrain.data.processors import collate_kto, process_kto_rows
from posttrain.losses import KTOLoss
from posttrain.losses.preference import sequence_logprobs
from posttrain.policy.lm_policy import Policy
from posttrain.schemas import KTOMasterConfig

_KL_KEYS = ("input_ids", "input_lengths", "token_mask")


def setup(cfg: KTOMasterConfig) -> OfflineSetup:
    max_len = max_sequence_length(cfg)
    with labelled_rows():  # rows keep their desirable / undesirable label
        s = offline_setup(cfg, "kto", process_kto_rows, lambda ex, pad: collate_kto(ex, pad, max_len),
                          KTOLoss.from_config(cfg.kto), cfg.policy, init_reference=True)
    _say_weight_balance(s)
    return s


def _say_weight_balance(s: OfflineSetup) -> None:
    """The paper's advice on lambda_D / lambda_U, said at the start when the training examples are outside it."""
    n_d = sum(ex["label"][0] for ex in s.loader.rows)
    if (advice := weight_advice(n_d, len(s.loader.rows) - n_d, s.cfg.kto.desirable_weight,
                                s.cfg.kto.undesirable_weight)) is not None:
        s.run.logger.console(advice)


def weight_advice(n_d: int, n_u: int, w_d: float, w_u: float) -> str | None:
    """What the KTO paper (Ethayarajh et al., section 4.2) advises of `n_d` desirable and `n_u`
    undesirable examples weighed `w_d` and `w_u`, when they are outside its range; else None."""
    if n_d == 0 or n_u == 0:
        return (f"kto: the training split has {n_d} desirable and {n_u} undesirable examples; with one kind only, the "
                "loss moves every response one way against the reference point")
    ratio = w_d * n_d / (w_u * n_u)
    if 1.0 <= ratio <= 4 / 3:
        return None
    # Rounded down to 3 significant digits: rounded to nearest, 3.5156 became 3.52, whose ratio
    # 0.9987 is below 1 again (and read "1.00 : 1" at two decimals).
    even = w_d * n_d / n_u
    scale = 10.0 ** (2 - math.floor(math.log10(even)))
    return (f"kto: {n_d} desirable and {n_u} undesirable training examples at kto.desirable_weight={w_d} and "
            f"kto.undesirable_weight={w_u} weigh {ratio:.3g} : 1; the KTO paper advises desirable_weight * "
            "n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3], e.g. "
            f"kto.undesirable_weight={math.floor(even * scale) / scale:g}")


def _mismatched(batch: BatchedDataDict, keep: bool) -> BatchedDataDict:
    """The mismatched pairs of `batch` (`collate_kto`'s kl_* keys) as a batch of their own; taken out
    of `batch` unless `keep` (a validation batch, prepared again at every validation), so that a
    training step does not ship them to the workers."""
    take = batch.get if keep else batch.pop
    return BatchedDataDict(**{key: take(f"kl_{key}") for key in _KL_KEYS}, sample_mask=batch["sample_mask"].clone())


def reference_point(policy: Policy, mismatched: BatchedDataDict, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """KTO's z: max(0, mean over the mismatched pairs of log pi(y'|x) - log pi_ref(y'|x)), token sums."""
    ratio = policy.get_logprobs(mismatched)["logprobs"] - reference_logprobs
    return sequence_logprobs(ratio, mismatched["token_mask"], average=False).mean().clamp(min=0)


def _prepare(policy: Policy, batch: BatchedDataDict, desirable: float, keep: bool = False) -> None:
    """The loss's inputs beside the rows: reference logprobs (once per batch), z and the global
    count of desirable examples, in every row."""
    mismatched = _mismatched(batch, keep)
    if "reference_logprobs" in batch:  # a validation batch's, kept from an earlier validation
        mismatched_ref = policy.get_reference_logprobs(mismatched)["reference_logprobs"]
    else:
        # One reference pass (one call to the workers) over the rows and their mismatched pairs.
        rows = BatchedDataDict(**{key: batch[key] for key in (*_KL_KEYS, "sample_mask")})
        ref = policy.get_reference_logprobs(BatchedDataDict.from_batches([rows, mismatched]))["reference_logprobs"]
        batch["reference_logprobs"] = ref[: batch.size, : batch["input_ids"].shape[1]]
        mismatched_ref = ref[batch.size :, : mismatched["input_ids"].shape[1]]
    batch["kto_kl"] = reference_point(policy, mismatched, mismatched_ref).expand(batch.size).clone()
    batch["kto_desirable"] = torch.full((batch.size,), float(desirable))


def validate(s: OfflineSetup) -> dict[str, float]:
    """Loss, accuracy, rewards and z over the validation examples (no update)."""
    policy = s.run.policy
    desirable = sum(float(b["kto_label"].sum()) for b in s.val_batches)  # the per-label means are over all of them
    for batch in s.val_batches:
        _prepare(policy, batch, desirable, keep=True)
    return evaluate(s.loss_fn, s.val_batches, lambda b: policy.get_logprobs(b)["logprobs"])


def kto_train(s: OfflineSetup) -> dict[str, float]:
    policy, max_len = s.run.policy, max_sequence_length(s.cfg)
    return offline_train(s, s.cfg.kto, lambda rows: collate_kto(rows, s.tokenizer.pad_token_id, max_len),
                         lambda: validate(s), show="accuracy",
                         prepare=lambda batch: _prepare(policy, batch, float(batch["kto_label"].sum())))


def run(cfg: KTOMasterConfig) -> dict[str, float]:
    return run_and_export(lambda: setup(cfg), kto_train)
