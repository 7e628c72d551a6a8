"""LoRA: only adapter weights train; merged and adapter-only exports reproduce the trained model."""

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.policy.lora import (
    adapter_state_dict,
    maybe_apply_lora,
    merge_lora_state_dict,
    save_adapter,
)
from posttrain.schemas import LoraConfig

CFG = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _train(model, steps=3):
    """A few real AdamW steps of next-token NLL on random tokens."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(8, 60, (2, 12))
    for _ in range(steps):
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return x


def _trained_lora(tiny_model_path):
    """A LoRA model of the tiny model after `_train`, in eval mode: (model, its inputs, their logits)."""
    model = maybe_apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), CFG)
    x = _train(model)
    model.eval()
    with torch.no_grad():
        return model, x, model(x).logits


def test_disabled_is_identity(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert maybe_apply_lora(model, LoraConfig()) is model


def test_only_adapter_parameters_change(tiny_model_path):
    model = maybe_apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), CFG)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(8, 60, (1, 8))
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_path)(x).logits
    assert torch.equal(model(x).logits, base_logits)  # lora_B starts at zero: the base model exactly
    _train(model)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {k for k in before if ".lora_A." in k or ".lora_B." in k}


def test_merged_export_equals_base_plus_adapter(tiny_model_path, tmp_path):
    model, x, trained = _trained_lora(tiny_model_path)
    sd = model.state_dict()
    merged = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_path))
    merged.load_state_dict(merge_lora_state_dict(sd, CFG), strict=True)
    merged.eval()
    with torch.no_grad():
        assert torch.allclose(merged(x).logits, trained, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        assert not torch.allclose(base(x).logits, trained, atol=1e-3)  # the adapter did change the model

    # The merged weight is exactly W + (alpha / r) * B @ A.
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    expected = sd[f"{key}.base_layer.weight"] + (CFG.alpha / CFG.rank) * (
        sd[f"{key}.lora_B.default.weight"] @ sd[f"{key}.lora_A.default.weight"]
    )
    assert torch.allclose(merge_lora_state_dict(sd, CFG)["model.layers.0.self_attn.q_proj.weight"], expected)

    # Adapter-only export, loaded back by peft onto a fresh base model.
    from peft import PeftModel

    save_adapter(sd, CFG, tmp_path / "adapter", tiny_model_path, model)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, trained, atol=1e-6)


@pytest.mark.parametrize("base_name", ["embedded:tiny", "relative"])
def test_adapter_export_loads_with_transformers_from_anywhere(tiny_model_path, tmp_path, monkeypatch, base_name):
    # The adapter names its base as a folder transformers and peft can open from any working
    # directory: not "embedded:tiny" (an invalid hub id to them), nor a folder relative to the run.
    import os
    import shutil

    model, x, trained = _trained_lora(tiny_model_path)
    if base_name == "relative":
        shutil.copytree(tiny_model_path, tmp_path / "run" / "base")
        monkeypatch.chdir(tmp_path / "run")
        base_name = "base"
    save_adapter(model.state_dict(), CFG, tmp_path / "adapter", base_name, model)
    monkeypatch.chdir(tmp_path)
    assert os.path.isabs(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
                         ["base_model_name_or_path"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()  # base + adapter
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, trained, atol=1e-6)


def test_posttrain_eval_takes_an_adapter_folder(tiny_model_path, tmp_path):
    # The tokenizer check read the vocabulary size from the folder's config, which an adapter
    # export has not: `posttrain eval` refused the folder it documents it loads.
    from posttrain.config import load_config
    from posttrain.data.processors import load_policy_tokenizer

    model, _, _ = _trained_lora(tiny_model_path)
    save_adapter(model.state_dict(), CFG, tmp_path / "adapter", tiny_model_path, model)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # as the run's hf/ export has them
        if (Path(tiny_model_path) / f).is_file():
            (tmp_path / "adapter" / f).write_bytes((Path(tiny_model_path) / f).read_bytes())
    cfg = load_config("eval", None, [f"policy.model_name={tmp_path / 'adapter'}"])
    assert len(load_policy_tokenizer(cfg.policy)) > 0
    bad = load_config("eval", None, [f"policy.model_name={tmp_path / 'adapter'}", "policy.generation.stop_token_ids=[100000]"])
    with pytest.raises(ValueError, match=r"stop_token_ids: \[100000\] are not token ids"):  # its base's vocabulary
        load_policy_tokenizer(bad.policy)
    # The attention kernel of "auto" reads the base's config (the folder has none).
    from posttrain.policy.hf_io import named_model_attention_kernel

    assert named_model_attention_kernel("auto", 4096, "cpu", str(tmp_path / "adapter")) == "sdpa"
    # A base model that is not there is named as the adapter's, not as policy.model_name (which the
    # user set to the adapter).
    import json

    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()),
                                          "base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ValueError, match=rf"^policy.model_name='{tmp_path / 'adapter'}' \(a LoRA adapter\): its "
                                         rf"adapter_config.json's base_model_name_or_path='{tmp_path / 'gone'}': "
                                         r"cannot load a model config .*no such folder"):
        load_policy_tokenizer(cfg.policy)


def test_an_adapter_folder_loads_as_plain_merged_weights(tiny_model_path, tmp_path):
    # transformers loads base + adapter into peft layers whose `.weight` is the base weight: the
    # torch engine (posttrain eval of a policy.lora.export=adapter folder) read those and sampled
    # from the untrained base model, silently.
    from transformers import AutoTokenizer

    from posttrain.generation import load_model_and_tokenizer

    model, x, trained = _trained_lora(tiny_model_path)
    save_adapter(model.state_dict(), CFG, tmp_path / "adapter", tiny_model_path, model)
    merged = merge_lora_state_dict(model.state_dict(), CFG)
    loaded, _ = load_model_and_tokenizer(str(tmp_path / "adapter"), tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))
    assert not any("lora" in k or "base_layer" in k for k in loaded.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(loaded.get_parameter(q), merged[q], atol=1e-6)
    assert not torch.allclose(merged[q], AutoModelForCausalLM.from_pretrained(tiny_model_path).get_parameter(q))
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(x).logits, trained, atol=1e-5)


def test_target_modules_the_model_lacks_fail_before_any_worker_starts():
    from posttrain.config import InputError
    from posttrain.policy.hf_io import load_model_configs
    from posttrain.schemas import PolicyConfig

    def check(targets, model_kind="causal_lm"):
        cfg = PolicyConfig(model_name="embedded:tiny", lora={"enabled": True, "target_modules": targets})
        load_model_configs(cfg, with_reference=False, model_kind=model_kind)

    # A misspelt name beside a valid one: peft adapted q_proj alone, silently.
    with pytest.raises(InputError, match=r"policy.lora.target_modules=\['q_proj', 'qkv'\]: no linear layer named "
                                         r"qkv in LlamaForCausalLM; its linear layers are .*down_proj.*q_proj"):
        check(["q_proj", "qkv"])
    with pytest.raises(InputError, match="no linear layer named self_attn in"):  # a module, not a layer
        check(["self_attn"])
    with pytest.raises(InputError, match="no linear layer named embed_tokens in"):
        check(["embed_tokens"])
    with pytest.raises(InputError, match=r"target_modules='q_proj': matches no module .* a regular expression"):
        check("q_proj")  # peft's string form is a regex over whole names
    check(r".*\.(q|v)_proj")
    # The tied LM head is refused there too.
    with pytest.raises(InputError, match="tied to the input embedding"):
        check(["lm_head"])
    # Checked on the model of the run's kind: a reward model has a score head, a causal LM none.
    check(["q_proj", "score"], model_kind="sequence_classification")
    # The head alone adapts nothing (it is trained in full), and is no layer to suggest.
    with pytest.raises(InputError, match=r"names only the score head \(score\), which is trained in full") as e:
        check(["score"], model_kind="sequence_classification")
    assert "score" not in str(e.value).split("its linear layers are ")[1].split(" (")[0]
    # A regular expression matching a module that is no linear layer: the key named, not peft's traceback.
    for pattern in (r".*self_attn", r".*mlp", r"model\.layers\.0"):
        with pytest.raises(InputError, match=rf"target_modules={re.escape(repr(pattern))}: matches a \w+, not a "
                                             r"linear layer in LlamaForCausalLM"):
            check(pattern)
    with pytest.raises(InputError, match="no linear layer named score in LlamaForCausalLM"):
        check(["q_proj", "score"])


def test_layers_the_merge_cannot_handle_are_refused():
    # GPT-2's projections are transformers' Conv1D (weight [in, out]): W + B @ A failed on the
    # rectangular ones and silently merged the square ones transposed.
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.config import InputError

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(InputError, match=r"adapts transformer.h.0.attn.c_attn, .* which are not torch.nn.Linear"):
        maybe_apply_lora(model, LoraConfig(enabled=True, rank=2))
    with pytest.raises(InputError, match=r"no linear layer named c_proj in GPT2LMHeadModel"):
        maybe_apply_lora(model, LoraConfig(enabled=True, rank=2, target_modules=["c_proj"]))


def test_reward_model_score_head_trains_and_exports(tiny_model_path):
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model = maybe_apply_lora(base, LoraConfig(enabled=True, rank=2, alpha=4.0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable)  # the new head trains with the adapter
    x = torch.randint(8, 60, (2, 10))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=x).logits.sum().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=x).logits
    merged = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model_path, num_labels=1))
    merged.load_state_dict(merge_lora_state_dict(model.state_dict(), LoraConfig(rank=2, alpha=4.0)), strict=True)
    merged.eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, trained, atol=1e-5)
    assert "base_model.model.score.weight" in adapter_state_dict(model.state_dict())


def test_merge_without_lora_is_an_error(tiny_model_path):
    sd = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    with pytest.raises(ValueError, match="no LoRA weights"):
        merge_lora_state_dict(sd, CFG)


def test_a_tied_lm_head_cannot_be_adapted(tiny_model_path):
    # The tiny model ties its LM head to the input embedding: W + BA on the head alone has no
    # place in the tied architecture the merged export and the generation refit load.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.tie_word_embeddings
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"policy.lora.target_modules=.*adapts lm_head, whose weight is tied"):
        maybe_apply_lora(model, cfg)
    # "all-linear" leaves the output layer out.
    wrapped = maybe_apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                               LoraConfig(enabled=True, rank=4, alpha=8.0))
    assert not hasattr(wrapped.base_model.model.lm_head, "lora_A")
