"""The policy computes logits only from the first position a trained token needs
(`logits_to_keep`), on plain rows and on shared-prefix rows, and its logprobs of the trained
tokens are those of the full forward (fp32, 1e-5); tokens before a row's first trained token
are 0 on every path. The entropies that come with the logprobs (loss_fn.top_entropy_quantile)
are the full forward's too, on plain, shared-prefix and packed rows."""


import pytest
import torch
from policy_oracle import prompt_batch, reference_logprobs
from transformers import AutoModelForCausalLM

from posttrain.data.batch import BatchedDataDict
from posttrain.policy.fsdp_worker import FSDPPolicyWorker, _takes_logits_to_keep
from posttrain.schemas import PolicyConfig


@pytest.fixture
def make_worker(tiny_model_path, single_rank_worker_env):
    def make(**policy) -> FSDPPolicyWorker:
        cfg = PolicyConfig(model_name=tiny_model_path, precision="float32", max_total_sequence_length=32,
                           logprob_batch_size=8, **policy)
        worker = FSDPPolicyWorker(cfg, init_reference=False)
        worker.setup()
        return worker

    return make


@pytest.mark.parametrize("shared", [False, True], ids=["plain_rows", "shared_prefix"])
def test_logits_only_from_the_first_trained_token(make_worker, tiny_model_path, shared):
    worker = make_worker()
    heads: list[int] = []  # positions per row the LM head computes
    worker.model.lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape[1]))
    prompts, lengths = ([9, 9, 9, 9], [20, 14, 17, 12]) if shared else ([9, 6, 11, 7], [20, 14, 17, 12])
    b = prompt_batch(prompts, lengths, shared)
    got = worker.get_logprobs(b)["logprobs"]
    if shared:  # one packed row: the 9-token prompt, then the 4 completions (11 + 5 + 8 + 3 tokens)
        assert heads == [9 + 11 + 5 + 8 + 3 - 8]
    else:  # rows padded to 20; the earliest trained token is at 6, scored by the logit at 5
        assert heads == [20 - 5]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    full = reference_logprobs(hf, BatchedDataDict({k: v for k, v in b.items() if k != "token_mask"}))
    trained = b["token_mask"] > 0
    torch.testing.assert_close(got[trained], full[trained], atol=1e-5, rtol=0)
    before_first = torch.arange(b["input_ids"].shape[1])[None] < torch.tensor(prompts)[:, None]
    assert (got[before_first] == 0).all() and (full[before_first] != 0).any()


def test_rows_without_a_token_mask_keep_every_logit(make_worker, tiny_model_path):
    worker = make_worker(prefix_sharing={"enabled": False})
    heads: list[int] = []
    worker.model.lm_head.register_forward_hook(lambda m, i, o: heads.append(i[0].shape[1]))
    b = prompt_batch([9, 6, 11, 7], [20, 14, 17, 12], shared=False)
    del b["token_mask"]
    got = worker.get_logprobs(b)["logprobs"]
    assert heads == [20]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.testing.assert_close(got, reference_logprobs(hf, b), atol=1e-5, rtol=0)


def test_lora_model_takes_logits_to_keep(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert _takes_logits_to_keep(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return input_ids

    assert not _takes_logits_to_keep(NoKeep())


@pytest.mark.parametrize("path", ["plain_rows", "shared_prefix", "packed"])
def test_entropies_come_with_the_logprobs_on_every_path(make_worker, tiny_model_path, path):
    # loss_fn.top_entropy_quantile's input: the entropy of the distribution behind each trained
    # token's logprob, as a full forward gives it, and 0 where the logprob is 0.
    policy = {"plain_rows": {"prefix_sharing": {"enabled": False}}, "shared_prefix": {},
              "packed": {"sequence_packing": {"enabled": True, "train_mb_tokens": 256, "logprob_mb_tokens": 256}}}[path]
    worker = make_worker(**policy)
    shared = path == "shared_prefix"
    prompts, lengths = ([9, 9, 9, 9], [20, 14, 17, 12]) if shared else ([9, 6, 11, 7], [20, 14, 17, 12])
    mbs, rows = worker._microbatches(prompt_batch(prompts, lengths, shared), train=False, group=1)
    assert len(mbs) == 1 and (path == "packed") == bool(rows)
    b = prompt_batch(prompts, lengths, shared).select_indices(mbs[0])  # packing may order the rows otherwise
    lengths = b["input_lengths"].tolist()
    got_lp, got_h = worker._forward(worker.model, b, rows[0] if rows else None, entropy=True)
    torch.testing.assert_close(got_lp, worker._forward(worker.model, b, rows[0] if rows else None))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=b["input_ids"]).logits.float(), -1)
    full = -(logp.exp() * logp).sum(-1)  # [b, S]: the distribution of position t + 1
    full = torch.cat([torch.zeros(len(lengths), 1), full[:, :-1]], dim=1)
    trained = b["token_mask"] > 0
    torch.testing.assert_close(got_h[trained], full[trained], atol=1e-5, rtol=0)
    assert (got_h[~trained & (got_lp == 0)] == 0).all() and not got_h.requires_grad
