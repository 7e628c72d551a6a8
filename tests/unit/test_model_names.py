"""Model names that are no local folder (hub ids): offline mode when the hub is unreachable,
so a missing model fails at once and a cached one loads without ~50 s of connection retries."""

import os
import socket
import time
from pathlib import Path

import huggingface_hub.constants
import pytest

from posttrain.config import MissingInputError
from posttrain.embedded import offline_if_hub_unreachable
from posttrain.policy.hf_io import load_hf_config


@pytest.fixture
def online_env(monkeypatch, tmp_path):
    """No offline flag and no proxy (tests/conftest.py sets HF_HUB_OFFLINE), a fresh probe, and
    the working directory in tmp_path; everything is restored afterwards."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    offline_if_hub_unreachable.cache_clear()
    yield monkeypatch
    offline_if_hub_unreachable.cache_clear()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_unreachable_hub_switches_to_offline_and_names_the_folder(online_env, tmp_path):
    online_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(MissingInputError) as e:
        load_hf_config("results/no-such-model")
    msg = str(e.value)
    assert msg.startswith("policy.model_name='results/no-such-model': cannot load a model config")
    assert f"no such folder under {tmp_path}" in msg and "HF_HUB_OFFLINE=1" in msg, msg
    # Both the variable (for the Ray workers started later) and this process's huggingface_hub.
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True


def test_reachable_hub_or_a_proxy_leaves_the_hub_online(online_env):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        online_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert offline_if_hub_unreachable() is False
    offline_if_hub_unreachable.cache_clear()
    online_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    online_env.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # the direct probe would say nothing
    assert offline_if_hub_unreachable() is False
    assert "HF_HUB_OFFLINE" not in os.environ and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_an_existing_local_folder_never_probes(online_env, tmp_path, tiny_model_path):
    online_env.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed the hub"))
    path, config = load_hf_config(tiny_model_path)
    assert path == tiny_model_path and config.vocab_size > 0


def test_a_posttrain_checkpoint_as_model_name_says_to_convert_it(tmp_path):
    step = tmp_path / "ckpt" / "step_3"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / ".metadata").write_text("")
    with pytest.raises(MissingInputError, match=rf"policy.model_name='{step}': .* a posttrain checkpoint, not a "
                                                 rf"Hugging Face model folder; convert it with `posttrain convert "
                                                 rf"dcp-to-hf --checkpoint {step} --output <folder>`"):
        load_hf_config(str(step))
    # The run's checkpoint folder (checkpointing.checkpoint_dir) named instead: transformers' own
    # complaint said nothing of checkpoints; the newest complete one is the one to convert.
    (step / "COMPLETE").write_text("")
    (tmp_path / "ckpt" / "step_1").mkdir()  # incomplete: not offered
    with pytest.raises(MissingInputError, match=rf"a folder of posttrain checkpoints \(step_3\), not a Hugging Face "
                                                 rf"model folder; convert it with `posttrain convert dcp-to-hf "
                                                 rf"--checkpoint {step} --output <folder>`"):
        load_hf_config(str(tmp_path / "ckpt"))
    # A run's folder (logger.log_dir) named instead of its final export, hf/ in it.
    run = tmp_path / "logs"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    with pytest.raises(MissingInputError, match=rf"a run's folder, not a Hugging Face model folder; its final export "
                                                 rf"is {run / 'hf'}: name that"):
        load_hf_config(str(run))
    from posttrain.data.processors import load_policy_tokenizer
    from posttrain.schemas import PolicyConfig

    # Also when the export is a LoRA adapter (policy.lora.export=adapter), which has no config.json:
    # the tokenizer's load said to write a GPT-2 tokenizer_config.json.
    (run / "hf" / "config.json").rename(run / "hf" / "adapter_config.json")
    with pytest.raises(MissingInputError, match=rf"a run's folder, not a Hugging Face model folder; its final export "
                                                 rf"is {run / 'hf'}: name that"):
        load_policy_tokenizer(PolicyConfig(model_name=str(run)))


def test_the_default_model_holds_the_default_context():
    # A run on the schema defaults warned that its context exceeds the model's positions.
    from transformers import AutoConfig

    from posttrain.embedded import resolve_model_path
    from posttrain.schemas import PolicyConfig

    cfg = PolicyConfig()
    positions = AutoConfig.from_pretrained(resolve_model_path(cfg.model_name)).max_position_embeddings
    assert positions >= cfg.max_total_sequence_length


def test_a_lora_adapter_as_model_name_says_how_to_get_a_whole_model(tmp_path):
    # policy.lora.export=adapter writes adapter_config.json and no config.json: transformers'
    # complaint was about a missing model_type key.
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(MissingInputError, match=r"policy.model_name=.*: a LoRA adapter \(adapter_config.json\), not "
                                                 r"a whole model; export the run with policy.lora.export=merged"):
        load_hf_config(str(tmp_path))


def test_a_reward_models_export_where_a_language_model_must_be_is_refused(tmp_path, tiny_model_path):
    # transformers loads a ...ForSequenceClassification folder as a causal LM without a word (the
    # score head dropped; the tied LM head, the embedding, is not missing): a DPO reference that
    # never learned to write (margin -5.0 at step 0), an eval of a model that cannot answer.
    import json
    import shutil

    from posttrain.algorithms.eval import run
    from posttrain.config import InputError, load_config
    from posttrain.policy.hf_io import load_model_configs
    from posttrain.schemas import PolicyConfig

    rm = tmp_path / "rm"
    shutil.copytree(tiny_model_path, rm)
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    refused = r"={!r} is a reward model \(LlamaForSequenceClassification: a score head".format(str(rm))
    with pytest.raises(InputError, match="policy.model_name" + refused):
        load_model_configs(PolicyConfig(model_name=str(rm)), with_reference=False)
    with pytest.raises(InputError, match="policy.reference_model_name" + refused):
        load_model_configs(PolicyConfig(model_name=tiny_model_path, reference_model_name=str(rm)), with_reference=True)
    with pytest.raises(InputError, match="policy.model_name" + refused):
        run(load_config("eval", "examples/configs/evals/arithmetic.yaml", [f"policy.model_name={rm}",
                                                                           f"logger.log_dir={tmp_path / 'logs'}"]))
    # A reward model may start from either.
    load_model_configs(PolicyConfig(model_name=str(rm)), with_reference=False, model_kind="sequence_classification")


def test_a_model_with_fewer_learned_positions_than_the_context_is_refused(tmp_path, tiny_model_path):
    # A GPT-2 teacher of 12 positions under a 32-token context: only a warning, then an IndexError
    # inside torch.embedding at the first step's reference logprobs, after its rollouts.
    from transformers import GPT2Config

    from posttrain.config import InputError
    from posttrain.policy.hf_io import load_model_configs
    from posttrain.schemas import PolicyConfig

    gpt2 = tmp_path / "gpt2"
    GPT2Config(vocab_size=104, n_positions=12, n_embd=8, n_layer=1, n_head=2).save_pretrained(gpt2)
    for key, cfg in (("policy.reference_model_name", PolicyConfig(model_name=tiny_model_path,
                                                                    reference_model_name=str(gpt2))),
                     ("policy.model_name", PolicyConfig(model_name=str(gpt2)))):
        with pytest.raises(InputError, match=rf"^{key}='{gpt2}' \(gpt2\) has 12 positions \(max_position_embeddings, "
                                             r".*than policy.max_total_sequence_length=32: set it to at most 12"):
            load_model_configs(cfg.model_copy(update={"max_total_sequence_length": 32}), with_reference=True)
    load_model_configs(PolicyConfig(model_name=str(gpt2), max_total_sequence_length=12), with_reference=True)


def test_a_reference_with_a_chat_template_of_its_own_is_named(tmp_path, tiny_model_path, caplog):
    # A teacher trained on another layout scored the student's prompts without a word.
    import shutil

    from transformers import AutoTokenizer

    from posttrain.policy.hf_io import load_model_configs
    from posttrain.schemas import PolicyConfig

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_path, teacher)
    cfg = PolicyConfig(model_name=tiny_model_path, reference_model_name=str(teacher))
    with caplog.at_level("WARNING", logger="posttrain.policy.hf_io"):
        load_model_configs(cfg, with_reference=True, check_files=True)
        assert caplog.messages == []  # the same template
        tok = AutoTokenizer.from_pretrained(teacher)
        tok.chat_template = "{% for m in messages %}<|system|>{{ m['content'] }}<|end|>{% endfor %}"
        tok.save_pretrained(teacher)
        load_model_configs(cfg, with_reference=True)  # a worker's load: the driver has warned
        load_model_configs(cfg, with_reference=True, check_files=True)
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith(
        f"policy.reference_model_name='{teacher}' has a chat template of its own that differs from the one the "
        f"policy's conversations are rendered with ({tiny_model_path}'s)")
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.policy.hf_io"):
        load_model_configs(cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(
            update={"chat_template": tok.chat_template})}), with_reference=True, check_files=True)
    assert caplog.messages == []  # the policy's given the teacher's


def test_a_hub_dataset_name_with_the_hub_unreachable_fails_at_once_offline(online_env):
    # `datasets` keeps its own copy of the flag (tests/conftest.py set it at import): online here.
    import datasets.config

    from posttrain.config import InputError
    from posttrain.data.datasets import load_rows
    from posttrain.schemas import DataConfig

    online_env.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    online_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    with pytest.raises(InputError, match=r"data.dataset_name='nobody/no-such-set' is not a registered dataset .* "
                                         r"loading it from the hub failed"):
        load_rows(DataConfig(dataset_name="nobody/no-such-set"), "train")
    # Online, `datasets` retried its hub requests for ~25 s (5 retries) before failing.
    assert time.monotonic() - started < 10
    assert os.environ["HF_HUB_OFFLINE"] == "1" and datasets.config.HF_HUB_OFFLINE is True


def test_a_missing_model_is_named_by_policy_model_name_also_when_the_tokenizer_interpolates_it(tmp_path):
    # sft.yaml, dpo.yaml, rm.yaml, grpo_math_1B.yaml write NeMo RL's `tokenizer.name: ${policy.model_name}`:
    # run before the conversion their comments show, the error named policy.tokenizer.name, a key
    # the user never set.
    from posttrain.config import load_config
    from posttrain.data.processors import load_policy_tokenizer

    missing = tmp_path / "stories260K-hf"
    cfg = load_config("sft", Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft.yaml",
                      [f"policy.model_name={missing}"])
    assert cfg.policy.tokenizer.name == str(missing)
    with pytest.raises(MissingInputError, match=rf"^policy.model_name='{missing}': cannot load a tokenizer .*no such folder"):
        load_policy_tokenizer(cfg.policy)
    # A tokenizer of its own is still named by its key.
    other = load_config("sft", None, [f"policy.model_name={missing}", f"policy.tokenizer.name={missing}-tok"]).policy
    with pytest.raises(MissingInputError, match=r"^policy.tokenizer.name="):
        load_policy_tokenizer(other)


def _materialize_tiny(rank: int, cache: str) -> str:
    os.environ["POSTTRAIN_CACHE"] = cache
    from posttrain.embedded import materialize

    return str(materialize("tiny"))


def test_embedded_models_are_built_once_and_a_leftover_folder_is_rebuilt(tmp_path, monkeypatch):
    # A tokenizer-only folder (left by a build that did not finish) made every later run fail at
    # the rename into place ("Directory not empty"); it is built again. Two processes starting at
    # once (the ranks of a job) wait for one build instead of racing.
    from posttrain.distributed.local_ranks import run_local_ranks
    from posttrain.embedded import _VERSION, build_tokenizer, materialize

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    leftover = tmp_path / "embedded" / f"tiny-{_VERSION}"
    build_tokenizer().save_pretrained(leftover)
    assert materialize("tiny") == leftover and (leftover / "model.safetensors").is_file()
    # Two processes on a fresh cache: one folder, complete, and no temporary folder left beside it.
    cache = tmp_path / "fresh"
    (path,) = set(run_local_ranks(_materialize_tiny, 2, str(cache), timeout_s=120))
    assert sorted(n for n in os.listdir(cache / "embedded") if not n.endswith(".lock")) == [os.path.basename(path)]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))


def test_a_model_folder_whose_weights_cannot_load_fails_before_any_worker_starts(tmp_path, tiny_model_path):
    # Each was a traceback from inside transformers in the policy worker, after Ray had started.
    import json
    import shutil

    from posttrain.config import InputError
    from posttrain.policy.hf_io import check_weight_files

    def folder(name, change):
        path = tmp_path / name
        shutil.copytree(tiny_model_path, path)
        change(path)
        return load_hf_config(str(path))

    def cut(path):
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])

    def wider(path):
        config = json.loads((path / "config.json").read_text())
        config["intermediate_size"] *= 2
        (path / "config.json").write_text(json.dumps(config))

    def sharded(path):
        (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    cases = {
        "no_weights": (lambda p: (p / "model.safetensors").unlink(), r"has no weights \(.*\); it holds chat_template\.jinja, config\.json"),
        "cut": (cut, r"cannot read the weights file .*model\.safetensors \(SafetensorError"),
        "wider": (wider, r"do not fit its config\.json \(\d+ tensor\(s\): model\.layers\.0\.mlp\.down_proj\.weight is "),
        "sharded": (sharded, r"names shards the folder lacks: model-00002-of-00002\.safetensors"),
    }
    for name, (change, message) in cases.items():
        path, config = folder(name, change)
        with pytest.raises(InputError, match="policy.model_name: .*" + message):
            check_weight_files(path, config, "causal_lm", "policy.model_name")
    check_weight_files(*load_hf_config(tiny_model_path), "causal_lm", "policy.model_name")  # whole: no error


def test_a_tokenizer_or_stop_id_past_the_models_vocabulary_is_named(stories260k):
    from posttrain.config import InputError
    from posttrain.data.processors import load_policy_tokenizer
    from posttrain.schemas import PolicyConfig

    # stories260K's 512 tokens against the embedded model's 104 rows: an IndexError at the first step.
    policy = PolicyConfig(model_name="embedded:tiny", tokenizer={
        "name": stories260k, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    with pytest.raises(InputError, match=r"policy.tokenizer.name: the tokenizer has 512 tokens, more than the 104 rows"):
        load_policy_tokenizer(policy)
    policy = PolicyConfig(model_name="embedded:tiny", generation={"stop_token_ids": [7, 104]})
    with pytest.raises(InputError, match=r"policy.generation.stop_token_ids: \[104\] are not token ids .* \(0 to 103\)"):
        load_policy_tokenizer(policy)
    assert len(load_policy_tokenizer(PolicyConfig(model_name="embedded:tiny"))) == 104


def test_parameter_counts_tie_the_head_and_lora_trains_only_its_adapters(tiny_model_path):
    # Built empty, the LM head tied to the embedding counted as a second matrix (Qwen2.5-0.5B: 630M
    # for 494M), and the memory check budgeted Adam states for every weight of a LoRA run.
    from transformers import AutoModelForCausalLM

    from posttrain.policy.hf_io import count_parameters
    from posttrain.policy.lora import maybe_apply_lora
    from posttrain.schemas import LoraConfig

    config = load_hf_config(tiny_model_path)[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    n = sum(p.numel() for p in model.parameters())
    assert config.tie_word_embeddings and count_parameters(config, "causal_lm") == (n, n)
    lora = LoraConfig(enabled=True, rank=4)
    adapters = sum(p.numel() for p in maybe_apply_lora(model, lora).parameters() if p.requires_grad)
    assert 0 < adapters < n / 4 and count_parameters(config, "causal_lm", lora) == (n + adapters, adapters)


def test_an_unknown_embedded_model_is_an_input_error_listing_the_names():
    # A ValueError: the command printed a 30-line traceback around the list.
    from posttrain.config import InputError
    from posttrain.embedded import resolve_model_path

    with pytest.raises(InputError, match=r"unknown embedded model embedded:huge; valid: embedded:tiny, embedded:small"):
        resolve_model_path("embedded:huge")
