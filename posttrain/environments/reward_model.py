"""`reward_model`: score GRPO rollouts with a trained reward model (`posttrain rm`).

The reward of a conversation is the RM's score of the whole conversation (prompt and the
model's last answer), tokenized exactly as `posttrain rm` tokenized a pair with that prompt and
answer (`posttrain.data.processors.process_preference_rows`: same chat template, BOS/EOS and
generation prompt). Scores are
unbounded Bradley-Terry logits; GRPO's group normalisation makes their scale irrelevant.
Conversations are scored in batches of `batch_size`; a conversation that cannot be scored
(no assistant message, longer than `max_length` or the RM's positions) scores 0 and records
the error.

A score has no notion of a right answer, so the environment gives no verdict
(`CORRECT_KEY`): its samples stay out of accuracy, pass@k and cons@k, whose share of
positive scores meant nothing (a shift of the RM's logits changes it).

Config (`env.reward_model.cfg`): `model_name` (an exported RM folder, e.g.
`<log_dir>/hf` from `checkpointing.export_hf_at_end`), `chat_template` (the one the RM was
trained with, when it is not saved with its tokenizer), `batch_size`, `max_length`,
`add_bos`, `add_eos` (null, the default: as the export records its training run's, else true),
`add_generation_prompt`.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.environments.interfaces import ENV_ERROR_KEY, EnvironmentInterface, EnvironmentReturn, last_assistant_text
from posttrain.schemas import EnvWorkerConfig, RewardModelEnvConfig, TokenizerConfig


class RewardModelEnvironment(EnvironmentInterface):
    config_class = RewardModelEnvConfig

    def __init__(self, cfg: EnvWorkerConfig):
        from posttrain.data.processors import load_tokenizer, require_chat_template
        from posttrain.embedded import resolve_model_path
        from posttrain.policy.hf_io import load_pretrained

        self.cfg = RewardModelEnvConfig.model_validate(cfg.cfg)
        path = resolve_model_path(self.cfg.model_name)
        self.tokenizer = load_tokenizer(TokenizerConfig(name=path, chat_template=self.cfg.chat_template),
                                        key="env.reward_model.cfg.model_name")
        require_chat_template(self.tokenizer)  # it renders every conversation: fail as the actor starts
        # A causal LM's folder (no trained score head) fails here: a random head would score noise.
        self.model = load_pretrained("sequence_classification", path, "env.reward_model.cfg.model_name",
                                     self.cfg.model_name, num_labels=1, dtype=torch.float32)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()
        from posttrain.policy.hf_io import recorded_row_tokens

        recorded = recorded_row_tokens(path, self.model.config)
        self.add_bos, self.add_eos = (given if given is not None else bool(recorded.get(key, True))
                                      for key, given in (("add_bos", self.cfg.add_bos), ("add_eos", self.cfg.add_eos)))
        # A conversation longer than the RM's positions would index past a learned position
        # table (the batch's step fails: every sample in it an error) or score out of the RoPE
        # range it was trained on: it is one sample's error, as one longer than max_length is.
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(self.cfg.max_length, positions or self.cfg.max_length)
        self.length_key = ("max_length" if self.max_length == self.cfg.max_length
                           else "the reward model's max_position_embeddings")

    def _tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        from posttrain.data.processors import tokenize_messages

        last_assistant_text(messages)  # raises when there is nothing to score
        answer = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        # As `posttrain rm` tokenized its pairs: the answer after its prompt, which reads as the template
        # renders it before that turn. Tokenized with every assistant turn as a response, a conversation
        # whose earlier turns the template re-renders once later ones follow (Qwen3's) was an error.
        # No reasoning check: the RM reads the conversation as its template shows it, and one that drops
        # <think> reasoning (DeepSeek-R1's) scores the policy's answer alone.
        ids = tokenize_messages(messages, self.tokenizer, add_bos=self.add_bos, add_eos=self.add_eos,
                                loss_start=answer, add_generation_prompt=self.cfg.add_generation_prompt,
                                check_reasoning=False)["input_ids"]
        if len(ids) > self.max_length:
            raise ValueError(f"the conversation has {len(ids)} tokens, more than {self.length_key}={self.max_length}")
        return ids

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> torch.Tensor:
        """RM scores `[n]` of tokenized conversations (right padded in batches of `batch_size`)."""
        from posttrain.data.processors import collate

        scores = []
        for s in range(0, len(token_ids), self.cfg.batch_size):
            examples = [{"input_ids": ids, "loss_mask": [0] * len(ids)} for ids in token_ids[s : s + self.cfg.batch_size]]
            # The model scores a row at its last token that is not the config's pad_token_id: pad
            # with that id (an RM's tokenizer may pad with another, e.g. EOS when it has no pad token).
            batch = collate(examples, self.model.config.pad_token_id)
            scores.append(self.model(input_ids=batch["input_ids"]).logits[:, 0].float())
        return torch.cat(scores) if scores else torch.zeros(0)

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"step: {len(message_logs)} conversations but {len(metadata)} metadata dicts")
        metadata = [{k: v for k, v in (m or {}).items() if k != ENV_ERROR_KEY} for m in metadata]
        ok, ids = [], []
        for i, messages in enumerate(message_logs):
            try:
                ids.append(self._tokenize(messages))
                ok.append(i)
            except Exception as e:  # noqa: BLE001 - an unscorable sample scores 0 and is recorded
                metadata[i][ENV_ERROR_KEY] = f"{type(e).__name__}: {e}"
        rewards = torch.zeros(len(message_logs))
        rewards[ok] = self.score(ids)
        answers = []
        for messages, meta in zip(message_logs, metadata):
            answers.append(None if meta.get(ENV_ERROR_KEY) else last_assistant_text(messages))
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Reward model score: {float(r):.3f}"} for r in rewards],
            metadata=metadata,
            next_stop_strings=[None] * len(message_logs),
            rewards=rewards.tolist(),
            terminateds=[True] * len(message_logs),
            answers=answers,
        )
