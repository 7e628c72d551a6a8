"""Reward-model training (`posttrain rm`): Bradley-Terry on a one-label
`AutoModelForSequenceClassification` (`posttrain.losses.BradleyTerryLoss`).

`run(cfg)` = `setup(cfg)` + `rm_train(setup)`. Batch sizes count pairs, as in DPO. The
score of a sequence is the head's output at its last token; metrics are the pairwise
accuracy and the mean chosen/rejected rewards. `policy.reward_model_cfg.enabled` is true
here (the schema sets it, and rejects false), and `policy.reward_model_cfg.reward_model_type`
picks the model kind and the loss from `REWARD_MODEL_TYPES`. A trained RM (exported with
`checkpointing.export_hf_at_end`) scores GRPO rollouts through the `reward_model`
environment (`posttrain.environments.reward_model`).
"""

from __future__ import annotations

from posttrain.algorithms.offline import (
    OfflineSetup,
    evaluate,
    offline_setup,
    offline_train,
    pair_policy_config,
    run_and_export,
)
from posttrain.config import InputError
from posttrain.data.processors import (
    collate_pairs,
    process_preference_rows,
)
from posttrain.losses import BradleyTerryLoss
from posttrain.schemas import PolicyConfig, RMMasterConfig

# What each `policy.reward_model_cfg.reward_model_type` trains: the policy's model kind
# (`Policy(model_kind=...)`) and the pairwise loss. Keys are the schema's Literal values.
REWARD_MODEL_TYPES: dict[str, tuple[str, type]] = {
    "bradley_terry": ("sequence_classification", BradleyTerryLoss),
}


def reward_model_kind(policy: PolicyConfig) -> tuple[str, type]:
    """(model kind, loss class) of the reward model `policy.reward_model_cfg` describes."""
    rm_cfg = policy.reward_model_cfg
    if not rm_cfg.enabled:
        raise InputError("posttrain rm needs policy.reward_model_cfg.enabled=true (the policy is the reward model)")
    return REWARD_MODEL_TYPES[rm_cfg.reward_model_type]


def setup(cfg: RMMasterConfig) -> OfflineSetup:
    model_kind, loss_class = reward_model_kind(cfg.policy)
    return offline_setup(cfg, "rm", process_preference_rows, collate_pairs, loss_class(),
                         pair_policy_config(cfg.policy), model_kind=model_kind)


def validate(s: OfflineSetup) -> dict[str, float]:
    """Loss, pairwise accuracy and mean rewards over the validation pairs (no update)."""
    return evaluate(s.loss_fn, s.val_batches, lambda b: s.run.policy.get_scores(b)["scores"])


def rm_train(s: OfflineSetup) -> dict[str, float]:
    # Rows 2i / 2i+1 of a batch are the chosen / rejected sides of pair i.
    return offline_train(s, s.cfg.rm, lambda rows: collate_pairs(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="accuracy")


def run(cfg: RMMasterConfig) -> dict[str, float]:
    return run_and_export(lambda: setup(cfg), rm_train)
