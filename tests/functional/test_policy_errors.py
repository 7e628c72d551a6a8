"""Policy setup failures: clear errors before any weights load; and a model the policy must not
batch as it does others (a sliding window)."""

import re
from types import SimpleNamespace

import psutil
import pytest
import torch
from transformers import LlamaConfig

from posttrain.config import ConfigError, InputError, load_config
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.policy.hf_io import InsufficientMemoryError, check_fits_in_memory, estimate_memory
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


def test_model_too_large_fails_before_loading(cluster, tmp_path, save_68b_config, monkeypatch, capsys):
    save_68b_config(tmp_path)
    with pytest.raises(MemoryError, match=r"(?s)'.*' \([\d,.]+M parameters\) needs about [\d,.]+ GiB.*"
                                          r"policy.max_memory_fraction=0.8") as raised:
        Policy(cluster, PolicyConfig(model_name=str(tmp_path)))
    # Bad input, raised in a worker: the CLI prints the worker's message alone and exits with 2
    # (a MemoryError was a Ray traceback and exit 1).
    import posttrain.cli

    def run(*_):
        raise raised.value

    monkeypatch.setattr(posttrain.cli, "_run_algorithm", run)
    with pytest.raises(SystemExit) as done:
        posttrain.cli.main(["sft"], supervise=False)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain sft: model ") and "Traceback" not in err
    assert "raise policy.max_memory_fraction" in err


def test_a_reference_too_large_fails_before_loading(cluster, tiny_model_path, tmp_path, save_68b_config):
    # A distillation teacher can be far larger than the policy: the memory check counts it.
    save_68b_config(tmp_path, LlamaConfig.from_pretrained(tiny_model_path).vocab_size)  # the policy's vocabulary
    with pytest.raises(MemoryError, match=r"\(0.1M parameters\) needs about [\d,.]+ GiB.* \+ a [\d,.]+M-parameter "
                                          r"reference"):
        Policy(cluster, PolicyConfig(model_name=tiny_model_path, reference_model_name=str(tmp_path)),
               init_reference=True)


GIB = 2**30
# The shape of Llama-3.2-3B (3.2B parameters), and of the 58.5M model whose peaks
# benchmarks/results/memory_check.md measured.
LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
M58 = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, vocab_size=32000,
           tie_word_embeddings=False)


def _memory(monkeypatch, *, ram: float, gpu: float = 0.0) -> None:
    """This machine, as the memory check sees it: `ram` GiB available on the host, `gpu` GiB free per GPU."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=ram * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu * GIB, 80 * GIB))


def _check(shape: dict, cfg: PolicyConfig, device: str, world_size: int, local_workers: int) -> int:
    return check_fits_in_memory("m", LlamaConfig(**shape), cfg, model_kind="causal_lm", device=torch.device(device),
                                world_size=world_size, local_workers=local_workers, reference_config=None)


def test_gpu_workers_are_checked_against_their_own_gpu_and_the_hosts_ram(monkeypatch):
    # 8 workers on one node, one GPU each: the sharded state (6.0 GiB) + logits (2.9) + activations
    # (6.8) of one worker on its own 80 GiB GPU; the 8 full fp32 copies loaded first (8 x 12.5 GiB
    # with the runtime) in the host's RAM. It was "143.6 GiB" of one GPU, refused.
    bf16 = PolicyConfig(precision="bfloat16")
    _memory(monkeypatch, ram=1000, gpu=80)
    assert _check(LLAMA_3B, bf16, "cuda", 8, 8) == 3_212_749_824
    _memory(monkeypatch, ram=100, gpu=80)
    with pytest.raises(InsufficientMemoryError, match=r"needs about 99.7 GiB of this node's RAM \(8 workers on this "
                                                      r"node x 12.47 GiB: worker runtime 0.50, a full fp32 copy while "
                                                      r"loading 11.97 GiB\), but only 80.0 GiB"):
        _check(LLAMA_3B, bf16, "cuda", 8, 8)
    _memory(monkeypatch, ram=1000, gpu=12)
    with pytest.raises(InsufficientMemoryError, match=r"needs about 15.7 GiB of the worker's own GPU .*"
                                                      r"more GPUs \(the state is sharded over them\) or "
                                                      r"policy.dtensor_cfg.cpu_offload=true"):
        _check(LLAMA_3B, bf16, "cuda", 8, 8)
    # cpu_offload keeps the sharded state on the host: the GPU holds the logits and activations (9.7
    # GiB), the host the state besides the load copies.
    offload = PolicyConfig(precision="bfloat16", dtensor_cfg={"cpu_offload": True}, max_memory_fraction=1)
    assert _check(LLAMA_3B, offload, "cuda", 8, 8) == 3_212_749_824
    _memory(monkeypatch, ram=140, gpu=12)
    with pytest.raises(InsufficientMemoryError, match=r"147.6 GiB of this node's RAM .*Adam states \(sharded over 8 "
                                                      r"workers\) 5.98 GiB"):
        _check(LLAMA_3B, offload, "cuda", 8, 8)


def test_the_cpu_estimate_counts_logits_and_activations_of_a_micro_batch(monkeypatch):
    # Measured peak RSS of one worker (benchmarks/results/memory_check.md), 58.5M fp32, rows of ~500
    # tokens: 4.36-4.60 GiB at a micro-batch of 8, 2.09 GiB at 2; its weights, grads and Adam states
    # are 0.87 GiB of it (all the check counted: 1.1 GiB with a load copy).
    _memory(monkeypatch, ram=4)
    cfg = dict(precision="float32", max_total_sequence_length=512, max_memory_fraction=1)
    assert _check(M58, PolicyConfig(train_micro_batch_size=2, **cfg), "cpu", 1, 1) == 58_466_816
    with pytest.raises(InsufficientMemoryError) as refused:
        _check(M58, PolicyConfig(train_micro_batch_size=8, **cfg), "cpu", 1, 1)
    message = str(refused.value)
    assert isinstance(refused.value, InputError)  # printed alone by the CLI, exit 2
    assert re.search(r"needs about 4.6 GiB of this node's RAM \(worker runtime \+ freed memory malloc keeps 1.00, fp32 "
                     r"weights \+ grads \+ 2 Adam states 0.87, logits of a 4,096-token micro-batch 1.46, activations "
                     r"1.31 GiB\), but only 4.0 GiB", message), message
    assert "policy.train_micro_batch_size" in message and "activation_checkpointing=true" in message
    assert "workers" not in message  # more workers on one node would each add their own memory
    # GPT-2's config has no intermediate_size (n_inner, None: 4 x hidden): estimated all the same.
    from transformers import GPT2Config

    estimate = estimate_memory(GPT2Config(), PolicyConfig(**cfg), model_kind="causal_lm", device_type="cpu",
                               world_size=1, reference_config=None)
    assert estimate.parameters == 124_439_808 and estimate.terms["activations"] > 0
    # Two workers on the node: each holds its own, and a full copy while loading (gone before training).
    with pytest.raises(InsufficientMemoryError, match=r"needs about 4.3 GiB of this node's RAM \(2 workers on this "
                                                      r"node x 2.13 GiB: .*fewer workers on this node"):
        _check(M58, PolicyConfig(train_micro_batch_size=2, **cfg), "cpu", 2, 2)


def test_colocated_generation_checks_its_copy_of_the_weights_beside_the_training(monkeypatch):
    # At the first generate: a second fp32 model and the engine's weights (8 bytes a parameter in
    # float32: 0.44 GiB for 58.5M), plus the part of the training's estimated peak (2.57 GiB at a
    # micro-batch of 2 x 512) that the worker does not hold yet.
    from posttrain.policy.hf_io import check_generation_fits

    cfg = PolicyConfig(precision="float32", max_total_sequence_length=512, train_micro_batch_size=2,
                       max_memory_fraction=1)

    def check(ram: float, held: float) -> None:
        _memory(monkeypatch, ram=ram)
        monkeypatch.setattr(psutil, "Process", lambda: SimpleNamespace(
            memory_info=lambda: SimpleNamespace(rss=held * GIB)))
        check_generation_fits("m", LlamaConfig(**M58), cfg, device=torch.device("cpu"), world_size=1, local_workers=1)

    check(ram=0.5, held=2.6)  # after a warm-up SFT: the training's memory is held already
    with pytest.raises(InsufficientMemoryError, match=r"needs about 0.4 GiB of this node's RAM \(the generation copy "
                                                      r"of the weights \(torch backend\) 0.44 GiB\), but only 0.3 GiB"):
        check(ram=0.3, held=2.6)
    with pytest.raises(InsufficientMemoryError, match=r"needs about 2.0 GiB .*the rest of the training's peak \(2.57 "
                                                      r"GiB, 1.00 held now\) 1.57 GiB\)"):
        check(ram=1.5, held=1.0)  # before the first step: its logits and activations are still to come


def test_unsupported_or_incomplete_config_fails_at_load():
    with pytest.raises(ValueError, match="set policy.sequence_packing.logprob_mb_tokens"):
        PolicyConfig(sequence_packing={"enabled": True, "train_mb_tokens": 64})
    # Each named by its whole key, which the config loader then locates (it gave the section's line).
    with pytest.raises(ValueError, match="policy.dtensor_cfg.context_parallel_size=2: context parallelism"):
        PolicyConfig(dtensor_cfg={"context_parallel_size": 2})
    with pytest.raises(ValueError, match="policy.dtensor_cfg.custom_parallel_plan is not supported yet"):
        PolicyConfig(dtensor_cfg={"custom_parallel_plan": "plans.py:plan"})
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
    # A torch-engine slot holds a sequence of up to max_total_sequence_length tokens: a smaller budget
    # failed in the engine at the first long prompt, mid-run.
    with pytest.raises(ValueError, match=r"policy.generation.torch_cfg.max_tokens_in_flight \(100\) is less than "
                                         r"policy.max_total_sequence_length \(128\).*at least 128"):
        PolicyConfig(max_total_sequence_length=128, generation={"torch_cfg": {"max_tokens_in_flight": 100}})
    PolicyConfig(max_total_sequence_length=128, generation={"torch_cfg": {"max_tokens_in_flight": 128}})
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
    # (Refused by its architecture first, as a tied one must be, which has nothing missing.)
    with pytest.raises(InputError, match=r"policy.reference_model_name='.*rm' is a reward model "
                                         r"\(LlamaForSequenceClassification: a score head"):
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
