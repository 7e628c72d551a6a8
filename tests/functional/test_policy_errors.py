"""Policy setup failures: clear errors before any weights load; and a model the policy must not
batch as it does others (a sliding window)."""

import pytest
from transformers import LlamaConfig

from posttrain.config import ConfigError, load_config
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.policy.lm_policy import Policy
from posttrain.schemas import ClusterConfig, PolicyConfig


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster(ClusterConfig(workers_per_node=1, cpus_per_worker=1), name="errors")
    yield c
    c.shutdown()


def test_missing_model_path(cluster, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=rf"policy.model_name='{missing}': cannot load a model config"):
        Policy(cluster, PolicyConfig(model_name=missing))


def test_model_too_large_fails_before_loading(cluster, tmp_path, save_68b_config):
    save_68b_config(tmp_path)
    with pytest.raises(MemoryError, match=r"(?s)'.*' \([\d,.]+M parameters\) needs about [\d,.]+ GiB.*"
                                          r"policy.max_memory_fraction=0.8"):
        Policy(cluster, PolicyConfig(model_name=str(tmp_path)))


def test_a_reference_too_large_fails_before_loading(cluster, tiny_model_path, tmp_path, save_68b_config):
    # A distillation teacher can be far larger than the policy: the memory check counts it.
    save_68b_config(tmp_path, LlamaConfig.from_pretrained(tiny_model_path).vocab_size)  # the policy's vocabulary
    with pytest.raises(MemoryError, match=r"\(0.1M parameters\) needs about [\d,.]+ GiB.* \+ a [\d,.]+M-parameter "
                                          r"reference"):
        Policy(cluster, PolicyConfig(model_name=tiny_model_path, reference_model_name=str(tmp_path)),
               init_reference=True)


def test_unsupported_or_incomplete_config_fails_at_load():
    with pytest.raises(ValueError, match="set policy.sequence_packing.logprob_mb_tokens"):
        PolicyConfig(sequence_packing={"enabled": True, "train_mb_tokens": 64})
    with pytest.raises(ValueError, match="context parallelism"):
        PolicyConfig(dtensor_cfg={"context_parallel_size": 2})
    with pytest.raises(ValueError, match="set policy.dtensor_cfg.tensor_parallel_size > 1"):
        PolicyConfig(dtensor_cfg={"sequence_parallel": True})
    with pytest.raises(ValueError, match=r"policy.make_sequence_length_divisible_by=3 must be a multiple of "
                                         r"tensor_parallel_size=2.*divisible_by=4\)"):
        PolicyConfig(dtensor_cfg={"sequence_parallel": True, "tensor_parallel_size": 2},
                     make_sequence_length_divisible_by=3)
    with pytest.raises(ValueError, match="policy.sequence_packing.sequence_length_round=63 must be a multiple"):
        PolicyConfig(dtensor_cfg={"sequence_parallel": True, "tensor_parallel_size": 2},
                     make_sequence_length_divisible_by=2,
                     sequence_packing={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64,
                                       "sequence_length_round": 63})
    with pytest.raises(ValueError, match="are alternatives"):
        PolicyConfig(sequence_packing={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64},
                     dynamic_batching={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64})
    # Through the command line's loader: a config error that names the key, before anything starts.
    with pytest.raises(ConfigError, match="policy.dynamic_batching.train_mb_tokens"):
        load_config("sft", None, ["policy.dynamic_batching.enabled=true"])


def test_a_reward_model_folder_as_teacher_or_model_fails_instead_of_a_random_lm_head(cluster, tiny_model_path,
                                                                                   tmp_path):
    # A reward model export with its own LM-head-free weights (untied, as most large models): loaded
    # as a causal LM, transformers initialised lm_head randomly and only logged it, so the teacher
    # (or the evaluated model) computed noise.
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from posttrain.config import InputError
    from posttrain.generation import load_model_and_tokenizer

    config = LlamaConfig.from_pretrained(tiny_model_path, tie_word_embeddings=False, num_labels=1)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "rm")
    with pytest.raises(InputError, match=r"policy.reference_model_name='.*rm': .* has no weights for lm_head.weight "
                                         r"of LlamaForCausalLM \(a reward model's folder holds no LM head"):
        Policy(cluster, PolicyConfig(model_name=tiny_model_path, reference_model_name=str(tmp_path / "rm")),
               init_reference=True)
    with pytest.raises(InputError, match=r"policy.model_name='.*rm': .* has no weights for lm_head.weight"):
        load_model_and_tokenizer(str(tmp_path / "rm"))


def test_a_teacher_trained_on_shorter_sequences_is_named_in_a_warning(cluster, caplog):
    # embedded:small has 1024 positions, embedded:tiny 512: the teacher scores positions past its own.
    cfg = PolicyConfig(model_name="embedded:small", reference_model_name="embedded:tiny", max_total_sequence_length=768)
    with caplog.at_level("WARNING", logger="posttrain.policy.lm_policy"):
        policy = Policy(cluster, cfg, init_reference=True)
        policy.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert warnings == ["policy.max_total_sequence_length=768 exceeds the max_position_embeddings=512 of "
                        "policy.reference_model_name: positions past 512 were not trained"]


def test_prefix_sharing_keeps_a_sliding_window(cluster, tiny_model_path, tmp_path):
    # The shared-prefix mask is full causal attention: over a Mistral with a 4-token window every
    # row's logprobs were off (by up to 6 nats). Rows longer than the window are not shared.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MistralConfig, MistralForCausalLM

    from policy_oracle import make_batch, reference_logprobs

    tiny = AutoConfig.from_pretrained(tiny_model_path)
    config = MistralConfig(vocab_size=tiny.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    cfg = PolicyConfig(model_name=str(tmp_path), precision="float32", train_global_batch_size=4,
                       train_micro_batch_size=4, logprob_batch_size=4, max_total_sequence_length=32,
                       attn_implementation="eager")
    policy = Policy(cluster, cfg, init_reference=False, name_prefix="window")
    try:
        batch = make_batch(lengths=[16, 12, 14, 10], seq=16)  # one 8-token prompt, the loss after it
        batch["input_ids"][1:, :8] = batch["input_ids"][0, :8]
        batch["token_mask"][:, :8] = 0
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
        torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], reference_logprobs(hf, batch),
                                   atol=2e-5, rtol=0)
    finally:
        policy.shutdown()
