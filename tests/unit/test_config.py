"""Config loading: inheritance, every override form, interpolation, and every error message."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from posttrain.config import (
    ConfigError,
    InputError,
    apply_overrides,
    load_config,
    load_yaml_with_defaults,
    schema_keys,
    suggest_key,
    to_yaml,
    validate,
)
from posttrain.schemas import GRPOMasterConfig, PolicyConfig, SFTMasterConfig

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------- inheritance


def test_defaults_inheritance_chain_and_order(tmp_path):
    _write(tmp_path / "base" / "a.yaml", """
        policy: {model_name: a, max_grad_norm: 0.5, train_micro_batch_size: 2}
        grpo: {seed: 1}
    """)
    _write(tmp_path / "base" / "b.yaml", """
        defaults: a.yaml
        policy: {model_name: b}
        grpo: {max_num_steps: 7}
    """)
    _write(tmp_path / "c.yaml", "grpo: {seed: 3, max_num_steps: 9}\n")
    child = _write(tmp_path / "child.yaml", """
        defaults: [base/b.yaml, c.yaml]
        policy:
          train_global_batch_size: 8
    """)
    cfg = load_config("grpo", child)
    assert cfg.policy.model_name == "b"  # b overrides its parent a
    assert cfg.policy.max_grad_norm == 0.5  # inherited from a through b
    assert cfg.grpo.seed == 3 and cfg.grpo.max_num_steps == 9  # later parents override earlier ones
    assert cfg.policy.train_global_batch_size == 8  # the file's own keys win
    assert cfg.policy.train_micro_batch_size == 2
    assert cfg.grpo.num_generations_per_prompt == GRPOMasterConfig().grpo.num_generations_per_prompt
    assert "defaults" not in load_yaml_with_defaults(child)


def test_a_config_from_a_pipe_or_dev_null_is_read():
    # `--config <(...)` is /dev/fd/N, resolved to a "pipe:[...]" name: it was "config file not found".
    out = subprocess.run(["bash", "-c", f"{sys.executable} -c 'import sys; from posttrain.config import load_config; "
                          "print(load_config(\"grpo\", sys.argv[1]).grpo.max_num_steps)' <(echo 'grpo: {max_num_steps: 3}')"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["3"], out.stderr
    assert load_config("grpo", "/dev/null") == load_config("grpo", None)  # empty: the defaults


def test_a_config_on_the_standard_input_names_its_parents_from_the_working_folder(tmp_path):
    # Read from a pipe, a config's folder is /dev (or /proc/...): `defaults: base.yaml` was looked for there.
    _write(tmp_path / "base.yaml", "grpo: {seed: 7}\n")
    child = "defaults: base.yaml\npolicy: {max_grad_norm: 0.5}\n"
    load = ("import sys; from posttrain.config import load_config; c = load_config('grpo', sys.argv[1]); "
            "print(c.grpo.seed, c.policy.max_grad_norm)")
    for path in ("-", "/dev/stdin"):
        out = subprocess.run([sys.executable, "-c", load, path], input=child, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.stdout.split() == ["7", "0.5"], out.stderr
    (tmp_path / "sub").mkdir()
    out = subprocess.run([sys.executable, "-c", load, "-"], input=child, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path / "sub")
    assert (f"`defaults` names 'base.yaml', but {tmp_path / 'sub' / 'base.yaml'} does not exist (a config read from "
            "a pipe names its parents relative to the working folder)") in out.stderr


def test_a_defaults_item_that_is_no_path_is_named_with_its_line(tmp_path):
    path = _write(tmp_path / "c.yaml", """
        defaults:
          - base.yaml
          - {policy: 1}
    """)
    with pytest.raises(ConfigError, match=re.escape(f"{path}:4: `defaults` must be a file path or a list of file "
                                                    "paths (item 2 is {'policy': 1})")):
        load_config("grpo", path)


def test_an_environment_a_child_leaves_empty_keeps_what_its_parent_set(tmp_path):
    # `env: {arithmetic: }` ran it with the schema defaults: the parent's workers and cfg were gone.
    _write(tmp_path / "base.yaml", "env: {arithmetic: {num_workers: 2, cfg: {strip_response: false}}}\n")
    child = _write(tmp_path / "child.yaml", "defaults: base.yaml\nenv:\n  arithmetic:\n  math:\n")
    env = load_config("grpo", child).env
    assert (env.arithmetic.num_workers, env.arithmetic.cfg, env.math.num_workers) == (2, {"strip_response": False}, 1)


def test_a_list_over_a_mapping_is_a_config_error_not_a_traceback(tmp_path):
    # OmegaConf's "Cannot merge incompatible container types" came with a traceback: a child's or an
    # override's mapping over a parent's list (NeMo RL's list of schedulers), or a list over a section.
    _write(tmp_path / "base.yaml", "policy: {scheduler: [{name: LinearLR}]}\ndescription: ${policy.model_name}\n")
    child = _write(tmp_path / "child.yaml", "defaults: base.yaml\npolicy: {scheduler: {name: LinearLR}}\n")
    with pytest.raises(ConfigError, match=r"policy.scheduler: got \{'name': 'LinearLR'\}, expected a valid list  "
                                          r"\[set at .*child.yaml:2\]"):
        load_config("grpo", child)
    with pytest.raises(ConfigError, match=r"policy.scheduler: got \{'name': 'x'\}, .*\[set at command line"):
        load_config("grpo", tmp_path / "base.yaml", ["policy.scheduler={name: x}"])
    with pytest.raises(ConfigError, match=r"grpo: got \[1\], expected a valid dictionary.*\[set at .*c.yaml:1\]"):
        load_config("grpo", _write(tmp_path / "c.yaml", "grpo: [1]\ndescription: ${policy.model_name}\n"))
    # A list replaces a list as before, and the parent's other keys stay.
    cfg = load_config("grpo", _write(tmp_path / "d.yaml", "defaults: child.yaml\npolicy: {scheduler: []}\n"))
    assert cfg.policy.scheduler == [] and cfg.description == cfg.policy.model_name


@pytest.mark.parametrize("text,where", [("null: 2\n", "the top level"), ("grpo:\n  ~: 2\n", "grpo")])
def test_a_key_that_is_no_name_is_refused_with_its_line(tmp_path, text, where):
    # A null key failed with OmegaConf's "Incompatible key type 'NoneType'" (a traceback at the top level).
    line = text.count("\n")
    with pytest.raises(ConfigError, match=rf"c.yaml:{line}: a key under {where} reads as null, not a name"):
        load_config("grpo", _write(tmp_path / "c.yaml", text))
    with pytest.raises(ConfigError, match=r"top level: key '1' reads as a number, not a name; .* \[set at .*e.yaml:1"):
        load_config("grpo", _write(tmp_path / "e.yaml", "1: 2\n"))


def test_a_section_a_child_leaves_empty_keeps_what_its_parent_set(tmp_path):
    # `policy:` with its only line commented out was a null that replaced the parent's whole
    # section: every key it set fell back to the schema default without a word.
    _write(tmp_path / "base.yaml", """
        policy: {model_name: embedded:small, train_global_batch_size: 16, generation: {max_new_tokens: 7}}
        data: {column_map: {q: prompt}}
    """)
    child = _write(tmp_path / "child.yaml", """
        defaults: base.yaml
        policy:
          # model_name: embedded:tiny
          generation:
        data:
          column_map:
    """)
    # A key that may be null (not a section) is still set to null: here one the schema refuses.
    with pytest.raises(ConfigError, match=r"data.column_map: got None, expected a valid dictionary"):
        load_config("sft", child)
    child.write_text(child.read_text().replace("data:\n  column_map:\n", ""))
    cfg = load_config("sft", child)
    assert (cfg.policy.model_name, cfg.policy.train_global_batch_size) == ("embedded:small", 16)
    assert cfg.policy.generation.max_new_tokens == 7
    # On the command line a null section is refused; ~key is what resets it to the defaults.
    with pytest.raises(ConfigError, match=r"override 'policy.generation=null': 'policy.generation' is a section and "
                                          r"cannot be null; ~policy.generation resets it to the schema defaults"):
        load_config("sft", child, ["policy.generation=null"])
    assert load_config("sft", child, ["~policy.generation"]).policy.generation.max_new_tokens != 7


def test_defaults_cycle_and_missing_parent(tmp_path):
    _write(tmp_path / "x.yaml", "defaults: y.yaml\n")
    _write(tmp_path / "y.yaml", "defaults: x.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config("grpo", tmp_path / "x.yaml")
    bad = _write(tmp_path / "z.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError, match=r"z\.yaml:1.*nope\.yaml.*does not exist"):
        load_config("grpo", bad)


# --------------------------------------------------------------------------- overrides


def test_every_override_form(tmp_path):
    path = _write(tmp_path / "c.yaml", """
        policy:
          max_grad_norm: 0.5
          scheduler:
            - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0}}
        logger: {wandb: {name: old}}
    """)
    cfg = load_config("grpo", path, [
        "policy.model_name=embedded:small",          # set
        "+policy.generation.top_k=5",                 # add a key not set yet
        "++logger.wandb.name=new",                    # add or set (it is set)
        "++logger.wandb.entity=me",                   # add or set (it is not set)
        "~policy.scheduler",                          # remove: back to the default
        'policy.generation.stop_strings=["\\n", "."]',  # a list (YAML: double quotes escape)
        "data.operations=[+,-]",
        "policy.max_grad_norm=null",                  # null
        "grpo.val_at_start=false",
        "policy.optimizer.kwargs.lr=1e-3",
    ])
    assert cfg.policy.model_name == "embedded:small"
    assert cfg.policy.generation.top_k == 5
    assert cfg.logger.wandb.name == "new" and cfg.logger.wandb.entity == "me"
    assert cfg.policy.scheduler == []
    assert cfg.policy.generation.stop_strings == ["\n", "."]
    assert cfg.data.operations == ["+", "-"]
    assert cfg.policy.max_grad_norm is None
    assert cfg.grpo.val_at_start is False
    assert cfg.policy.optimizer.kwargs == {"lr": 1e-3}  # a set dict key replaces only what it names
    assert cfg.policy.tokenizer_name == "embedded:small"
    # The default tokenizer is the model's, resolved when used: the config keeps null, so a run's
    # config.yaml loaded again with another model_name takes that model's tokenizer.
    assert cfg.policy.tokenizer.name is None and "name: null" in to_yaml(cfg.policy.tokenizer.model_dump())


def test_an_override_value_that_yaml_reads_partly_as_a_comment_is_an_error():
    # `description=run #1` was "run", `description=#1` null, without a word.
    with pytest.raises(ConfigError) as e:
        load_config("sft", None, ["description=run #1", "logger.wandb.name=#1"])
    msg = str(e.value)
    assert "override 'description=run #1': YAML reads '#1' as a comment; quote the value: description='run #1'" in msg
    assert "override 'logger.wandb.name=#1': YAML reads '#1' as a comment" in msg
    cfg = load_config("sft", None, ["description='run #1'", "logger.wandb.name=exp#1", "policy.max_grad_norm= 0.5 "])
    assert (cfg.description, cfg.logger.wandb.name, cfg.policy.max_grad_norm) == ("run #1", "exp#1", 0.5)


def test_a_hydra_style_mapping_without_spaces_is_an_error_saying_how_to_write_it():
    # Hydra reads {a:b} as {a: b}; YAML as the key "a:b" with no value, reported as a None.
    with pytest.raises(ConfigError, match=r"override 'data.column_map=\{query:question,q:a\}': YAML reads "
                                          r"'query:question' as a key without a value; write \{query: question\}"):
        load_config("grpo", None, ["data.column_map={query:question,q:a}"])
    with pytest.raises(ConfigError, match=r"YAML reads 'x:y' as a key"):
        load_config("grpo", None, ["data.mixture=[{x:y}]"])
    cfg = load_config("grpo", None, ["data.column_map={query: question, 'a:b': c}", "env.x.target=[a.py:f,b.py:g]"])
    assert cfg.data.column_map == {"query": "question", "a:b": "c"}


def test_an_override_value_that_is_not_yaml_is_one_line_naming_the_place():
    # PyYAML's own text spans five lines quoting `in "<unicode string>", line 1, column 6`,
    # which broke the one-line-per-problem list of the error.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["data.operations=[+,-,*]", "description=@x"])
    assert str(e.value).splitlines()[1:] == [
        "  - override 'data.operations=[+,-,*]': cannot parse value '[+,-,*]' as YAML at character 7: "
        "expected alphabetic or numeric character, but found ']' (while scanning an alias)",
        "  - override 'description=@x': cannot parse value '@x' as YAML at character 1: "
        "found character '@' that cannot start any token (while scanning for the next token)",
    ]
    assert load_config("grpo", None, ["data.operations=[+,-,'*']"]).data.operations == ["+", "-", "*"]


def test_an_empty_stop_string_is_a_config_error():
    # It passed the config and failed at the first generate call, after the model and Ray started.
    with pytest.raises(ConfigError, match=r"policy.generation.stop_strings\[1\]: got ''"):
        load_config("eval", None, ["policy.generation.stop_strings=[x, '']"])


def test_an_output_folder_named_by_a_file_is_a_config_error(tmp_path):
    # It failed at the first write, with a traceback, after the model had loaded and Ray had started.
    taken = _write(tmp_path / "results", "")
    with pytest.raises(ConfigError) as e:
        load_config("eval", None, [f"eval.save_path={taken}", f"logger.log_dir={taken}"])
    for key in ("eval.save_path", "logger.log_dir"):
        assert f"{key}: '{taken}' is a file; name a folder" in str(e.value)
    with pytest.raises(ConfigError, match="checkpointing.checkpoint_dir: '.*' is a file; name a folder"):
        load_config("grpo", None, [f"checkpointing.checkpoint_dir={taken}"])
    cfg = load_config("eval", None, [f"eval.save_path={tmp_path / 'new'}", f"logger.log_dir={tmp_path}"])
    assert cfg.eval.save_path == str(tmp_path / "new")


def test_output_folders_expand_the_home_folder(tmp_path, monkeypatch):
    # As model and data paths do; the run wrote into ./~/runs/a (a folder named ~) instead.
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("grpo", None, ["logger.log_dir=~/runs/a", "checkpointing.checkpoint_dir=~/ckpt/a"])
    assert (cfg.logger.log_dir, cfg.checkpointing.checkpoint_dir) == (f"{tmp_path}/runs/a", f"{tmp_path}/ckpt/a")
    assert load_config("eval", None, ["eval.save_path=~/eval"]).eval.save_path == f"{tmp_path}/eval"
    _write(tmp_path / "taken", "")
    with pytest.raises(ConfigError, match="logger.log_dir: '~/taken' is a file"):
        load_config("grpo", None, ["logger.log_dir=~/taken"])


def test_a_mapping_override_merges_into_the_files_mapping(tmp_path):
    # As Hydra (NeMo RL) does; the file's other generation keys and kwargs fell back to the schema
    # defaults without a word (max_new_tokens 64, weight_decay 0.01, no betas).
    path = _write(tmp_path / "c.yaml", """
        policy:
          generation: {max_new_tokens: 17, temperature: 0.9}
          optimizer:
            kwargs: {lr: 1.0e-5, weight_decay: 0.1, betas: [0.9, 0.95]}
        """)
    cfg = load_config("grpo", path, ["policy.generation={temperature: 0.5}", "policy.optimizer.kwargs={lr: 2e-5}"])
    assert (cfg.policy.generation.max_new_tokens, cfg.policy.generation.temperature) == (17, 0.5)
    assert cfg.policy.optimizer.kwargs == {"lr": 2e-5, "weight_decay": 0.1, "betas": [0.9, 0.95]}
    # Removed first, it is replaced whole; a value that is not a mapping replaces it too.
    cfg = load_config("grpo", path, ["~policy.optimizer.kwargs", "+policy.optimizer.kwargs={lr: 2e-5}"])
    assert cfg.policy.optimizer.kwargs == {"lr": 2e-5}
    # Each key is blamed where it was set: the file's kept keys on the file, the mapping's on it.
    bad = _write(tmp_path / "bad.yaml", "policy:\n  generation: {max_new_tokens: -1}\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", bad, ["policy.generation={temperatur: 0.5}", "policy.scheduler={a: 1}"])
    msg = str(e.value)
    assert f"policy.generation.max_new_tokens: got -1, expected greater than or equal to 1  [set at {bad}:2]" in msg
    assert ("unknown key 'policy.generation.temperatur' (did you mean policy.generation.temperature?)  "
            "[set at command line (policy.generation={temperatur: 0.5})]") in msg
    assert "policy.scheduler: got {'a': 1}, expected a valid list" in msg


def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch):
    # W&B and MLflow are extras: without one the run failed at its logger's setup, with
    # ModuleNotFoundError's traceback.
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["logger.mlflow_enabled=true", "logger.wandb_enabled=true"])
    assert str(e.value).splitlines()[1:] == [
        "  - logger.mlflow_enabled: mlflow is not installed: pip install mlflow (or posttrain[mlflow])  "
        "[set at command line (logger.mlflow_enabled=true)]"]
    assert load_config("grpo", None, ["logger.wandb_enabled=true"]).logger.wandb_enabled


def test_add_existing_and_remove_missing_are_errors(tmp_path):
    path = _write(tmp_path / "c.yaml", "policy: {max_grad_norm: 0.5}\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path, ["+policy.max_grad_norm=1", "~policy.model_name", "justakey"])
    msg = str(e.value)
    assert "'policy.max_grad_norm' is already set; use policy.max_grad_norm=... or ++policy.max_grad_norm=..." in msg
    assert "cannot remove 'policy.model_name'" in msg
    assert "'justakey' is not of the form key=value" in msg and "--config" not in msg
    # A config file given without --config, and a key twice in an override's mapping (the last one won).
    with pytest.raises(ConfigError, match=rf"'{path}' is not of the form .* \(a config file is given as --config {path}"):
        load_config("grpo", None, [str(path)])
    with pytest.raises(ConfigError, match=r"'policy.generation=\{top_k: 1, top_k: 2\}': duplicate key 'top_k'"):
        load_config("grpo", None, ["policy.generation={top_k: 1, top_k: 2}"])


def test_overrides_of_list_items(tmp_path):
    path = _write(tmp_path / "c.yaml", """
        policy:
          scheduler:
            - {name: LinearLR, kwargs: {start_factor: 0.1}}
            - {milestones: [10]}
            - {name: ConstantLR}
    """)
    cfg = load_config("sft", path, ["policy.scheduler.0.name=CosineAnnealingLR", "~policy.scheduler[2]",
                                    "~policy.scheduler.1"])
    assert [e.name for e in cfg.policy.scheduler] == ["CosineAnnealingLR"]
    with pytest.raises(ConfigError) as e:
        load_config("sft", path, ["policy.scheduler.0.name=[1]", "policy.scheduler.x=1", "~policy.scheduler.7"])
    msg = str(e.value)
    # A bad value set through `a.0.b` is blamed on the command line, not on the file that set the item.
    assert "policy.scheduler[0].name: got [1], expected a valid string  [set at command line" in msg
    assert "override 'policy.scheduler.x=1': policy.scheduler is a list of 3 items: 'x' is not one of its indices" in msg
    assert "cannot remove 'policy.scheduler.7', it is not set in the config" in msg


def test_apply_overrides_on_omegaconf():
    from omegaconf import OmegaConf

    cfg = apply_overrides(OmegaConf.create({"a": {"b": 1}}), ["a.b=2", "+a.c=[1,2]", "~a.b"])
    assert OmegaConf.to_container(cfg) == {"a": {"c": [1, 2]}}
    # ~key=value (Hydra's): removed only when it holds that value; it was removed whatever it held.
    with pytest.raises(ConfigError, match=r"override '~a.c=\[1\]': a.c is \[1, 2\], not \[1\]; ~a.c=<value> removes "
                                          r"it only when it holds that value, ~a.c whatever it holds"):
        apply_overrides(cfg, ["~a.c=[1]"])
    assert OmegaConf.to_container(apply_overrides(cfg, ["~a.c=[1, 2]"])) == {"a": {}}


# --------------------------------------------------------------------------- interpolation


def test_interpolation_including_schema_defaults(tmp_path):
    path = _write(tmp_path / "c.yaml", """
        policy:
          model_name: my/model
          train_micro_batch_size: 2
          dynamic_batching:
            enabled: true
            # max_total_sequence_length is not set in this file: its schema default (512) is used
            train_mb_tokens: ${mul:${policy.max_total_sequence_length},${policy.train_micro_batch_size}}
            logprob_mb_tokens: 4096
          generation:
            max_new_tokens: ${policy.max_total_sequence_length}
        logger:
          wandb: {name: "${policy.model_name}-run"}
    """)
    cfg = load_config("grpo", path)
    assert cfg.policy.dynamic_batching.train_mb_tokens == 1024
    assert cfg.policy.generation.max_new_tokens == 512
    assert cfg.logger.wandb.name == "my/model-run"
    # Interpolations resolve after overrides, and an override may be an interpolation itself.
    cfg = load_config("grpo", path, ["policy.max_total_sequence_length=128",
                                     "grpo.max_num_steps=${policy.train_micro_batch_size}"])
    assert cfg.policy.dynamic_batching.train_mb_tokens == 256
    # A key set to such an interpolation can be overridden (it was refused: "not found").
    for ov in ("policy.generation.max_new_tokens=64", "++policy.generation.max_new_tokens=64"):
        assert load_config("grpo", path, [ov]).policy.generation.max_new_tokens == 64
    with pytest.raises(ConfigError, match="'policy.generation.max_new_tokens' is already set"):
        load_config("grpo", path, ["+policy.generation.max_new_tokens=64"])
    assert cfg.grpo.max_num_steps == 2
    # Inside lists, with spaces (as NeMo RL writes `${mul:a, b}`), and a list entry that fails.
    cfg = load_config("grpo", path, ["policy.generation.stop_strings=['${policy.model_name}', x]",
                                     "policy.logprob_chunk_size=${mul: 2, ${policy.train_micro_batch_size}}"])
    assert cfg.policy.generation.stop_strings == ["my/model", "x"]
    assert cfg.policy.logprob_chunk_size == 4
    with pytest.raises(ConfigError, match=r"policy.scheduler\[0\].name: cannot resolve the interpolation"):
        load_config("grpo", path, ["policy.scheduler=[{name: '${nope}'}]"])
    # Unquoted inside a list or mapping, as Hydra's grammar takes them: these were read as one
    # string ('[2, 7]', "{lr: ...}") and refused as not a list or not a dict.
    cfg = load_config("grpo", path, ["policy.generation.stop_token_ids=[${policy.train_micro_batch_size}, 7]",
                                     "policy.optimizer.kwargs={lr: ${mul:${policy.train_micro_batch_size},1e-5}}",
                                     "policy.generation.stop_strings=[a${policy.model_name}, '\\${x}']"])
    assert cfg.policy.generation.stop_token_ids == [2, 7]
    assert cfg.policy.optimizer.kwargs == {"lr": 2e-5}
    assert cfg.policy.generation.stop_strings == ["amy/model", "${x}"]
    with pytest.raises(ConfigError, match=r"override 'policy.generation.stop_token_ids=\[\${mul: 2': .*BRACE_CLOSE"):
        load_config("grpo", path, ["policy.generation.stop_token_ids=[${mul: 2"])


def test_interpolation_errors_name_key_and_place(tmp_path):
    path = _write(tmp_path / "c.yaml", "grpo:\n  max_num_steps: ${policy.nope}\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path)
    msg = str(e.value)
    assert "grpo.max_num_steps: cannot resolve the interpolation" in msg and "c.yaml:2" in msg
    assert msg.count("grpo.max_num_steps") == 1  # not reported again as a type error


# --------------------------------------------------------------------------- errors


def test_typo_names_key_place_and_suggestion(tmp_path):
    path = _write(tmp_path / "c.yaml", "policy:\n  model_name: x\n  max_grad_nrom: 1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path)
    msg = str(e.value)
    assert "unknown key 'policy.max_grad_nrom' (did you mean policy.max_grad_norm?)" in msg
    assert f"{path.resolve()}:3" in msg
    # A misspelt section holding one key suggests the whole key (it said "did you mean
    # policy?", and the fixed override then failed on its second typo); with more keys, the section.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["polcy.max_grad_nrom=1", "grp.val_period=3", "lgger={log_dir: a, jsonl: b}"])
    msg = str(e.value)
    assert "unknown key 'polcy' (did you mean policy.max_grad_norm?)" in msg
    assert "unknown key 'grp' (did you mean grpo.val_period?)" in msg
    assert "unknown key 'lgger' (did you mean logger?)" in msg


def test_errors_are_listed_in_the_order_their_keys_were_written(tmp_path):
    # By file and line, then the command line's: they came in the schema's order (policy's
    # before grpo's, whatever the file said), line 4 before line 2.
    path = _write(tmp_path / "c.yaml", "grpo:\n  max_num_step: 3\npolicy:\n  max_grad_nrom: 1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path, ["policy.lr_x=3", "grpo.seedd=2"])
    lines = str(e.value).splitlines()[1:]
    assert [line.split("'")[1] for line in lines] == ["grpo.max_num_step", "policy.max_grad_nrom", "policy.lr_x",
                                                      "grpo.seedd"], lines
    assert lines[0].endswith("c.yaml:2]") and lines[1].endswith("c.yaml:4]")


def test_a_section_of_another_command_says_whose_it_is(tmp_path):
    # The usual cause: a config (or override) written for another command.
    path = _write(tmp_path / "grpo.yaml", "grpo: {max_num_steps: 3}\nloss_fn: {ratio_clip_min: 0.1}\n")
    with pytest.raises(ConfigError) as e:
        load_config("sft", path, ["env.math.num_workers=1"])
    msg = str(e.value)
    assert "unknown key 'grpo' (a section of `posttrain grpo`, not of `posttrain sft`)" in msg
    assert "unknown key 'env' (a section of `posttrain grpo` and `posttrain eval`, not of `posttrain sft`)" in msg
    with pytest.raises(ConfigError, match=r"unknown key 'bogus'  \["):
        load_config("sft", None, ["bogus=1"])


def test_wrong_type_names_key_value_and_expected():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.train_micro_batch_size=abc", "logger.wandb.mode=sometimes"])
    msg = str(e.value)
    assert "policy.train_micro_batch_size: got 'abc', expected a valid integer" in msg
    assert "logger.wandb.mode: got 'sometimes', expected 'online', 'offline' or 'disabled'" in msg
    assert "command line (policy.train_micro_batch_size=abc)" in msg


def test_a_leading_dash_on_the_command_line_is_named_as_a_yaml_list():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["logger.log_dir=-", "data.task_name=- x"])
    msg = str(e.value)
    for key, got in (("logger.log_dir", "[None]"), ("data.task_name", "['x']")):
        assert (f"{key}: got {got}, expected a valid string (a value starting with '-' is a YAML list: quote "
                "the text)") in msg
    assert load_config("grpo", None, ["data.task_name='- x'"]).data.task_name == "- x"
    with pytest.raises(ConfigError) as e:  # a list where a number goes, written as a list: no dash hint
        load_config("grpo", None, ["grpo.max_num_steps=[1]"])
    assert "YAML list" not in str(e.value)


def test_a_boolean_is_no_number(tmp_path):
    # pydantic took true/false for a number as 1/0: these ran with 1 step and 1 printed sample.
    path = _write(tmp_path / "c.yaml", "logger:\n  num_val_samples_to_print: yes\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path, ["grpo.max_num_steps=true", "policy.max_grad_norm=off"])
    msg = str(e.value)
    assert "grpo.max_num_steps: got True, expected a number" in msg
    assert "policy.max_grad_norm: got False, expected a number" in msg
    assert "logger.num_val_samples_to_print: got True, expected a number" in msg and "c.yaml:2" in msg
    # Text that YAML reads as a boolean: the error says why a True the user never wrote is there.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["logger.wandb.name=yes"])
    assert ("logger.wandb.name: got True, expected a valid string (YAML reads true/false, yes/no, on/off as "
            "booleans: quote the text)") in str(e.value)
    # Nor inside a list or mapping of numbers: stop_token_ids [yes, no] stopped on token 0.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.generation.stop_token_ids=[7, no]", "env.x.target=[a:b, c:d]",
                                   "env.x.reward_weights=[0.5, yes]", "env.x.correct_at_least={c: true}",
                                   "policy.scheduler=[{name: LinearLR}, {name: ConstantLR}, {milestones: [on]}]"])
    msg = str(e.value)
    for key, got in (("policy.generation.stop_token_ids", [7, False]), ("env.x.reward_weights", [0.5, True]),
                     ("env.x.correct_at_least", {"c": True}), ("policy.scheduler[2].milestones", [True])):
        assert f"{key}: got {got!r}, expected numbers, not true/false (YAML reads" in msg
    # Booleans stay valid where a key takes one (also beside a number, or in a free-form dict).
    cfg = load_config("grpo", None, ["grpo.val_at_start=yes", "policy.optimizer.kwargs={lr: 1e-5, foreach: true}",
                                     "grpo.max_num_steps=3", "policy.max_grad_norm=0.5",
                                     "policy.generation.stop_token_ids=[7, 0]"])
    assert (cfg.grpo.val_at_start, cfg.policy.optimizer.kwargs["foreach"]) == (True, True)
    assert (cfg.grpo.max_num_steps, cfg.policy.max_grad_norm) == (3, 0.5)
    assert cfg.policy.generation.stop_token_ids == [7, 0]


def test_gpu_monitoring_is_off_in_a_run_whose_workers_take_no_gpu():
    # grpo_math_1B.yaml sets logger.monitor_gpus=true: every CPU run inheriting it warned that
    # nvidia-smi is not on PATH. It monitors the GPUs of the policy or separate generation workers.
    math = str(ROOT / "examples/configs/grpo_math_1B.yaml")
    cpu = ["cluster.gpus_per_node=0"]
    cases = {
        ("grpo", math, "policy.generation.colocated.resources.gpus_per_node=0"): False,
        ("grpo", math, "policy.generation.colocated.enabled=true", "policy.generation.backend=torch"): False,
        ("grpo", math, "policy.generation.colocated.resources.gpus_per_node=2"): True,  # generation's GPUs
        ("grpo", math, "cluster.gpus_per_node=1", "policy.generation.colocated.resources.gpus_per_node=0"): True,
        ("sft", None, "logger.monitor_gpus=true"): False,
        ("sft", None, "logger.monitor_gpus=true", "cluster.gpus_per_node=1"): True,
        ("sft", None, "cluster.gpus_per_node=1"): False,  # not asked for
    }
    for (command, path, *overrides), monitored in cases.items():
        cfg = load_config(command, path, ["policy.model_name=embedded:tiny", *cpu, *overrides])
        assert cfg.logger.monitor_gpus is monitored, overrides
        assert (f"monitor_gpus: {str(monitored).lower()}" in to_yaml(cfg)), overrides  # config.yaml says what ran


def test_bounds_of_values_that_would_silently_misbehave():
    # A negative max_grad_norm flips the gradients (clip scales them by max_norm / norm), a
    # negative KL clamp makes clamp(min=v, max=-v) a constant, a chunk size < 1 fails mid-run, a
    # negative overlong penalty (read as "a negative reward") rewards overlong responses; separate
    # generation resources of -1 failed after Ray started ("Bundles must be a non-empty list"), and
    # 0 nodes ran on 1.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.max_grad_norm=-1", "policy.logprob_chunk_size=0",
                                   "loss_fn.kl_input_clamp_value=-1", "loss_fn.kl_output_clamp_value=0",
                                   "data.max_input_seq_length=-5", "grpo.reward_shaping.overlong_buffer_penalty=-1",
                                   "policy.generation.colocated.resources.num_nodes=0",
                                   "policy.generation.colocated.resources.gpus_per_node=-1"])
    msg = str(e.value)
    assert "policy.generation.colocated.resources.num_nodes: got 0, expected greater than or equal to 1" in msg
    assert "policy.generation.colocated.resources.gpus_per_node: got -1, expected greater than or equal to 0" in msg
    assert "grpo.reward_shaping.overlong_buffer_penalty: got -1, expected greater than or equal to 0" in msg
    assert "policy.max_grad_norm: got -1, expected greater than 0" in msg
    assert "policy.logprob_chunk_size: got 0, expected greater than or equal to 1" in msg
    assert "loss_fn.kl_input_clamp_value: got -1, expected greater than 0" in msg
    assert "loss_fn.kl_output_clamp_value: got 0, expected greater than 0" in msg
    assert "data.max_input_seq_length: got -5, expected greater than or equal to 1" in msg
    cfg = load_config("grpo", None, ["policy.max_grad_norm=null", "loss_fn.kl_input_clamp_value=null"])
    assert cfg.policy.max_grad_norm is None and cfg.loss_fn.kl_input_clamp_value is None


def test_a_generation_engine_precision_that_is_no_dtype_fails_at_load():
    # It was any string, and "bf16" failed at the engine's start with a bare KeyError: 'bf16'.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.generation.torch_cfg.precision=bf16",
                                   "policy.generation.vllm_cfg.precision=fp16"])
    msg = str(e.value)
    assert "policy.generation.torch_cfg.precision: got 'bf16', expected 'float32', 'bfloat16' or 'float16'" in msg
    assert "policy.generation.vllm_cfg.precision: got 'fp16', expected 'float32', 'bfloat16' or 'float16'" in msg
    cfg = load_config("grpo", None, ["policy.generation.torch_cfg.precision=float32"])
    assert cfg.policy.generation.torch_cfg.precision == "float32"
    assert cfg.policy.generation.vllm_cfg.precision is None


def test_auto_precision_is_decided_when_the_config_is_read_and_recorded(monkeypatch):
    # The default. bfloat16 everywhere made a CPU without native bf16 (AVX2 only), which emulates
    # it ~75x slower than float32, miss the quickstart's 9 minutes in its warm-up.
    from posttrain import runtime

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: False)
    cfg = load_config("grpo", None, [])
    assert cfg.policy.precision == "float32"
    assert "precision: float32" in to_yaml(cfg.model_dump(mode="json"))  # config.yaml says what ran
    # Cluster GPUs: bfloat16 although the driver has none of its own; a dtype given stays.
    assert load_config("grpo", None, ["cluster.gpus_per_node=1"]).policy.precision == "bfloat16"
    assert load_config("grpo", None, ["cluster.gpus_per_node=1", "policy.precision=auto"]).policy.precision == \
        "bfloat16"
    assert load_config("grpo", None, ["cluster.gpus_per_node=1", "policy.precision=float32"]).policy.precision == \
        "float32"
    assert load_config("eval", None, ["policy.device=cuda"]).policy.precision == "bfloat16"
    # A training run's workers see a GPU only through cluster.gpus_per_node (eval runs in its own process).
    with pytest.raises(ConfigError, match=r"policy.device=cuda, but cluster.gpus_per_node=0 gives the policy workers "
                                          r"no GPU; set cluster.gpus_per_node"):
        load_config("sft", None, ["policy.device=cuda"])
    assert load_config("sft", None, ["policy.device=cuda", "cluster.gpus_per_node=2"]).policy.precision == "bfloat16"
    assert load_config("sft", None, ["policy.precision=bfloat16"]).policy.precision == "bfloat16"
    assert PolicyConfig().precision == "float32"  # on its own (a Policy of a test): by its device
    assert PolicyConfig(device="cuda").precision == "bfloat16"
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)  # AMX, AVX512-BF16
    assert load_config("sft", None, []).policy.precision == "bfloat16"
    assert PolicyConfig().precision == "bfloat16"


def test_a_negative_stop_token_id_fails_at_load():
    # No token has it: the torch engine never stopped on it, and HF generate then ignored every
    # EOS id ("should consist of positive integers"), running each batch to max_new_tokens.
    with pytest.raises(ConfigError, match=r"policy.generation.stop_token_ids\[1\]: got -1, expected greater than or "
                                          r"equal to 0"):
        load_config("grpo", None, ["policy.generation.stop_token_ids=[5, -1]"])


def test_an_optimizer_name_that_is_neither_registered_nor_a_path_fails_at_load():
    # It failed in the policy workers, after Ray started and the model loaded.
    with pytest.raises(ConfigError, match=r"policy.optimizer.name: unknown optimizer 'adamww'; valid: adamw, adam, "
                                          r"sgd or a dotted import path such as 'torch.optim.AdamW'"):
        load_config("sft", None, ["policy.optimizer.name=adamww"])
    for name in ("AdamW", "sgd", "my_pkg.optim.Lion"):  # a dotted path is imported by the workers
        assert load_config("sft", None, [f"policy.optimizer.name={name}"]).policy.optimizer.name == name


def test_optimizer_kwargs_without_lr_are_an_error():
    # kwargs replace the default {lr: 5e-6, weight_decay: 0.01} as a whole: setting betas alone
    # would run at torch's own lr (AdamW: 1e-3, 200x the default) without a word.
    with pytest.raises(ConfigError, match=r"policy.optimizer: policy.optimizer.kwargs sets no lr .* set "
                                          r"policy.optimizer.kwargs.lr too  \[set at command line"):
        load_config("grpo", None, ["+policy.optimizer.kwargs.betas=[0.9,0.99]"])
    cfg = load_config("grpo", None, ["policy.optimizer.kwargs={lr: 1e-3, betas: [0.9, 0.99]}"])
    assert cfg.policy.optimizer.kwargs == {"lr": 1e-3, "betas": [0.9, 0.99]}


def test_an_optimizer_lr_that_is_not_a_number_fails_at_load(tmp_path):
    # A quoted lr ("1e-5") reached torch as a string and failed in the policy workers, after
    # Ray started and the model loaded.
    path = _write(tmp_path / "c.yaml", """
        policy:
          optimizer:
            kwargs: {lr: "1e-5"}
        """)
    with pytest.raises(ConfigError, match=re.escape(
            "policy.optimizer.kwargs.lr must be a number, got '1e-5' (a string: remove its quotes)  "
            f"[policy.optimizer set at {path}:3; policy.optimizer.kwargs.lr set at {path}:4]")):
        load_config("grpo", path)
    for value in ("true", "null", "[1e-5]"):
        with pytest.raises(ConfigError, match="policy.optimizer.kwargs.lr must be a number"):
            load_config("grpo", None, [f"policy.optimizer.kwargs.lr={value}"])
    assert load_config("grpo", None, ["policy.optimizer.kwargs.lr=1"]).policy.optimizer.kwargs["lr"] == 1


def test_the_batch_must_split_over_the_policy_workers_at_load():
    # Found otherwise after Ray started: by the Policy (tensor parallel) or at the first training step.
    # A check across sections reads as its message alone (it was prefixed with "<root>: ").
    with pytest.raises(ConfigError, match=r"\n  - policy.train_global_batch_size \(32\) must be a multiple of the 3 "
                                          r"data-parallel policy workers"):
        load_config("sft", None, ["cluster.workers_per_node=3"])
    with pytest.raises(ConfigError, match=r"policy.dtensor_cfg.tensor_parallel_size \(3\) must divide the 2 "
                                          r"policy workers"):
        load_config("grpo", None, ["cluster.workers_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=3"])
    # eval has no policy workers (test_policy_worker_settings_of_an_eval_are_named)
    load_config("eval", None, ["cluster.workers_per_node=3", "policy.dtensor_cfg.tensor_parallel_size=2"])
    load_config("dpo", None, ["cluster.num_nodes=2", "cluster.gpus_per_node=4", "policy.train_global_batch_size=8",
                              "policy.dtensor_cfg.tensor_parallel_size=2"])


def test_workers_per_node_beside_gpus_is_refused():
    # Left unread: workers_per_node=4 with gpus_per_node=8 ran 8 workers per node without a word.
    with pytest.raises(ConfigError, match=r"workers_per_node=4 with gpus_per_node=8: with GPUs each node runs one "
                                          r"worker per GPU"):
        load_config("grpo", None, ["cluster.gpus_per_node=8", "cluster.workers_per_node=4"])
    assert load_config("grpo", None, ["cluster.gpus_per_node=2", "cluster.workers_per_node=2"]).cluster.num_workers == 2


def test_a_scheduler_chain_that_cannot_be_built_fails_at_load():
    # It failed in the policy workers, after Ray started and the model loaded.
    cases = {
        "[{name: ConstantLR}, {name: LinearLR}]": "2 schedulers: add an entry `milestones` with 1 step(s)",
        "[{name: ConstantLR}, {name: LinearLR}, {milestones: [2, 3]}]": "2 schedulers: add an entry `milestones` "
                                                                        "with 1 step(s) at which to switch (got [2, 3])",
        "[{milestones: [2]}, {milestones: [3]}]": "more than one `milestones` entry",
        "[{milestones: [2]}]": "`milestones` but no scheduler entries to chain",
        "[{name: ConstantLR}, {milestones: [2]}]": "`milestones` needs at least two schedulers",
        "[{name: ConstantLR}, {name: LinearLR}, {milestones: [0]}]": "`milestones` [0]: optimizer steps >= 1 in "
                                                                     "increasing order, one switch each",
        "[{name: ConstantLR}, {name: LinearLR}, {name: LinearLR}, {milestones: [5, 3]}]": "`milestones` [5, 3]: "
                                                                                        "optimizer steps >= 1",
    }
    for value, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(f"policy.scheduler: {message}")):
            load_config("sft", None, [f"policy.scheduler={value}"])


def test_all_errors_reported_at_once(tmp_path):
    path = _write(tmp_path / "c.yaml", "grpo:\n  max_grad_norm: 1\npolicy:\n  precision: fp8\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path, ["polcy.max_grad_norm=1", "+grpo.max_grad_norm=2", "data.num_digits=-1"])
    lines = [l for l in str(e.value).splitlines() if l.startswith("  - ")]
    text = "\n".join(lines)
    assert len(lines) == 5, text
    assert "'grpo.max_grad_norm' is already set" in text
    assert "unknown key 'grpo.max_grad_norm' (did you mean policy.max_grad_norm?)" in text
    assert "policy.precision: got 'fp8'" in text
    assert "data.num_digits: got -1, expected greater than or equal to 1" in text
    assert "unknown key 'polcy' (did you mean policy.max_grad_norm?)" in text


def test_union_and_cross_field_errors():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.lora.target_modules={a: 1}"])
    assert "policy.lora.target_modules: got {'a': 1}, expected a valid list or a valid string" in str(e.value)
    with pytest.raises(ConfigError, match="policy.lora.alpha: got 0, expected greater than 0"):
        load_config("grpo", None, ["policy.lora.alpha=0"])
    # Cross-field checks of a section run once its fields are valid.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.train_global_batch_size=6", "policy.train_micro_batch_size=4"])
    msg = str(e.value)
    assert "policy: policy.train_global_batch_size (6) must be a multiple of policy.train_micro_batch_size (4)" in msg


def test_a_vllm_backend_without_vllm_installed_fails_at_setup_naming_the_choices(monkeypatch, tmp_path):
    import importlib.util

    from posttrain.generation import check_backend_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(InputError, match=r"backend=vllm, but vllm is not installed .*backend=torch"):
        check_backend_installed(load_config("eval", None, ["policy.generation.backend=vllm"]).policy.generation)
    check_backend_installed(load_config("grpo", None, []).policy.generation)  # torch: nothing to install
    # Separate workers under another venv's Python: that venv is checked instead (vllm_cfg.python),
    # before any worker starts (a venv without vllm failed in the first actor, after the policy loaded).
    import json

    import ray

    venv = tmp_path / "python"
    venv.write_text("#!/bin/sh\necho '" + json.dumps({"python": "%d.%d" % sys.version_info[:2],
                                                       "ray": ray.__version__, "missing": []}) + "'\n")
    venv.chmod(0o755)
    other = load_config("grpo", None, ["policy.generation.backend=vllm", "policy.generation.colocated.enabled=false",
                                       f"policy.generation.vllm_cfg.python={venv}"])
    check_backend_installed(other.policy.generation)
    without = other.policy.generation.model_copy(update={"vllm_cfg": other.policy.generation.vllm_cfg.model_copy(
        update={"python": sys.executable})})  # this venv has no vllm (find_spec is patched in this process only)
    with pytest.raises(InputError, match=rf"vllm_cfg.python='{re.escape(sys.executable)}' cannot import vllm "
                                         r"\(scripts/setup_vllm_cpu.sh"):
        check_backend_installed(without)
    # But not for eval, which generates in its own process: the message says to run it in that venv.
    with pytest.raises(InputError, match=r"run this command with that venv's posttrain .*vllm_cfg.python does not apply"):
        check_backend_installed(other.policy.generation, in_process=True)


def test_vllm_python_is_checked_at_load(tmp_path):
    notexec = _write(tmp_path / "notexec", "")
    for bad, why in ((tmp_path / "nope", "does not exist"), (tmp_path, "not a file"), (notexec, "not executable")):
        with pytest.raises(ConfigError) as e:
            load_config("grpo", None, [f"policy.generation.vllm_cfg.python={bad}"])
        assert f"policy.generation.vllm_cfg.python='{bad}': {why}" in str(e.value)
    # The vllm venv hosts separate generation workers only: colocated generation runs in the policy workers.
    vllm = ["policy.generation.backend=vllm", f"policy.generation.vllm_cfg.python={sys.executable}"]
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, vllm)
    assert f"policy.generation.vllm_cfg.python='{sys.executable}' runs separate generation workers" in str(e.value)
    assert "set policy.generation.colocated.enabled=false" in str(e.value)
    cfg = load_config("grpo", None, vllm + ["policy.generation.colocated.enabled=false"])
    assert cfg.policy.generation.vllm_cfg.python == sys.executable


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml$"):
        load_config("grpo", "/nowhere.yaml")
    # A misspelt name is answered with the closest file of its folder, also in `defaults:`.
    _write(tmp_path / "grpo_quickstart.yaml", "grpo: {seed: 1}\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"config file not found: {tmp_path / 'grpo_quickstrat.yaml'} (did you mean "
            f"{tmp_path / 'grpo_quickstart.yaml'}?)")):
        load_config("grpo", tmp_path / "grpo_quickstrat.yaml")
    child = _write(tmp_path / "child.yaml", "defaults: grpo_quikstart.yaml\n")
    with pytest.raises(ConfigError, match=re.escape(f"(did you mean {tmp_path / 'grpo_quickstart.yaml'}?)")):
        load_config("grpo", child)


def test_a_config_that_is_not_utf8_text_or_not_a_file_is_a_config_error(tmp_path):
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"\xff\xfe\x00policy: {}")  # e.g. a weights file passed as --config
    with pytest.raises(ConfigError, match=r"model\.yaml: cannot read the config as UTF-8 text"):
        load_config("grpo", binary)
    (tmp_path / "configs").mkdir()
    with pytest.raises(ConfigError, match=r"configs is a folder, not a config file"):
        load_config("grpo", tmp_path / "configs")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.yaml", "policy:\n  model_name: x\n  max_grad_norm: [1, 2\ngrpo: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path)
    assert f"YAML syntax error at {path}:4" in str(e.value)


def test_duplicate_key_is_an_error(tmp_path):
    path = _write(tmp_path / "dup.yaml", "policy:\n  max_grad_norm: 1\n  max_grad_norm: 2\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml:3: duplicate key 'policy.max_grad_norm' \(first set at line 2\)"):
        load_config("grpo", path)


def test_unknown_algorithm_and_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'; valid: grpo, sft"):
        load_config("ppo")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config("grpo", _write(tmp_path / "l.yaml", "- 1\n"))


@pytest.mark.parametrize("bad,expected", [
    ("policy.max_grad_nrom", "policy.max_grad_norm"),
    ("grpo.max_grad_norm", "policy.max_grad_norm"),  # right name, wrong section
    ("polcy.max_grad_norm", "policy.max_grad_norm"),
    ("policy.generaton.temprature", "policy.generation.temperature"),
    ("policy.scheduler[0].kwargz", "policy.scheduler[0].kwargs"),  # as the user names the item
    ("checkpointing.keep_topk", "checkpointing.keep_top_k"),
    ("env.math.num_worker", "env.math.num_workers"),  # an entry of env, named by the user
    ("zzzzzz", None),
])
def test_suggest_key(bad, expected):
    assert suggest_key(bad, schema_keys(GRPOMasterConfig)) == expected


def test_errors_inside_an_env_entry_name_the_entry(tmp_path):
    path = _write(tmp_path / "env.yaml", "env:\n  math:\n    num_worker: 2\n  arithmetic: 3\n  code:\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path)
    msg = str(e.value)
    assert f"  - unknown key 'env.math.num_worker' (did you mean env.math.num_workers?)  [set at {path}:3]" in msg
    # Deeper in the entry the same (it read "env: unknown key 'env.math.cfg...").
    with pytest.raises(ConfigError, match=r"\n  - unknown key 'env.math.cfg.float_roundin' \(did you mean "
                                          r"env.math.cfg.float_rounding\?\)"):
        load_config("grpo", None, ["env.math.cfg.float_roundin=3"])
    with pytest.raises(ConfigError, match=r"\n  - env.math.cfg.float_rounding: got 'abc', expected a valid integer"):
        load_config("grpo", None, ["env.math.cfg.float_rounding=abc"])
    assert "env.arithmetic: got 3, expected a valid dictionary" in msg and f"[set at {path}:4]" in msg
    assert "env.code" not in msg  # an entry without settings runs with the defaults
    assert load_config("grpo", None, ["++env.code=null"]).env.get_worker_cfg("code").num_workers == 1
    # Entry names that look like pydantic's union tags (a dash, a type name) are kept, each on its own.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["env.my-env.num_workers=0", "env.int.timeout_s=0"])
    msg = str(e.value)
    assert "env.my-env.num_workers: got 0, expected greater than or equal to 1  [set at command line" in msg
    assert "env.int.timeout_s: got 0, expected greater than 0  [set at command line" in msg


def test_a_check_across_keys_says_where_each_key_it_names_was_set(tmp_path):
    # It gave the line of the section (`policy:`), not where the keys were set: here one at the
    # command line, the other in the file.
    path = _write(tmp_path / "b.yaml", "policy:\n  model_name: embedded:tiny\n  train_micro_batch_size: 16\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path, ["policy.train_global_batch_size=24"])
    msg = str(e.value)
    assert "policy.train_global_batch_size (24) must be a multiple of policy.train_micro_batch_size (16)" in msg
    assert (f"[policy.train_global_batch_size set at command line (policy.train_global_batch_size=24); "
            f"policy.train_micro_batch_size set at {path}:3]") in msg


# --------------------------------------------------------------------------- output


def test_to_yaml_roundtrip(tmp_path):
    cfg = load_config("sft", None, ["policy.model_name=m", "sft.max_num_steps=3",
                                    "policy.scheduler=[{name: x, kwargs: {a: 1}}, {name: y}, {milestones: [2]}]"])
    text = to_yaml(cfg)
    assert yaml.safe_load(text)["sft"]["max_num_steps"] == 3
    path = _write(tmp_path / "resolved.yaml", text)
    assert load_config("sft", path) == cfg
    assert validate(yaml.safe_load(text), SFTMasterConfig) == cfg
    # Strings that the config loader would read as numbers (`1e5` is a float to it) are quoted.
    cfg = load_config("sft", None, ['logger.wandb.name="1e5"', 'description="2E-3"'])
    assert load_config("sft", _write(tmp_path / "strings.yaml", to_yaml(cfg))) == cfg
    # A literal `${` (escaped where it was set) stays literal, backslashes before it included:
    # unescaped, the saved config.yaml failed to load as an interpolation of a missing key.
    path = _write(tmp_path / "literal.yaml", r"""
        policy:
          generation:
            stop_strings: ['\${x}', 'a\\\${y}', '${policy.model_name}']
        """)
    cfg = load_config("sft", path)
    assert cfg.policy.generation.stop_strings == ["${x}", "a\\${y}", cfg.policy.model_name]
    assert load_config("sft", _write(tmp_path / "saved.yaml", to_yaml(cfg))) == cfg
    # Non-ASCII text reads as written, not as "L\xF6sung \u6570\u5B66".
    cfg = load_config("sft", None, ["description=Lösung 数学"])
    assert "description: Lösung 数学\n" in to_yaml(cfg)
    assert load_config("sft", _write(tmp_path / "unicode.yaml", to_yaml(cfg))) == cfg


@pytest.mark.parametrize("typo, meant", [("policy.max_grad_nrom=1", "policy.max_grad_norm"),
                                         ("grpo.max_num_stepz=1", "grpo.max_num_steps")])
def test_typo_fails_fast_without_heavy_imports(typo, meant):
    # The CLI validates before torch/transformers/ray are imported (also policy.precision=auto).
    code = (
        "import sys\n"
        "from posttrain.cli import main\n"
        f"try:\n    main(['grpo', {typo!r}])\n"
        "except SystemExit as e:\n"
        "    heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "    print(e.code, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert f"did you mean {meant}?" in out.stderr


def test_config_docs_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # A constrained item type reads as its type (policy.generation.stop_strings: list[str] | None).
    assert "FieldInfo(" not in (ROOT / "docs" / "config.md").read_text()


def test_exponent_floats_without_dot_are_floats(tmp_path):
    # PyYAML (YAML 1.1) would read these as strings; dict-typed keys would then reach torch as str.
    path = _write(tmp_path / "c.yaml", "policy:\n  optimizer:\n    kwargs: {lr: 5e-6, eps: 1.0e8, weight_decay: 0}\n")
    cfg = load_config("grpo", path, ["++policy.optimizer.kwargs.lr=1e-3"])
    assert cfg.policy.optimizer.kwargs == {"lr": 1e-3, "eps": 1e8, "weight_decay": 0}
    assert isinstance(load_config("grpo", path).policy.optimizer.kwargs["lr"], float)


def test_date_like_values_are_text(tmp_path):
    # YAML 1.1 reads them as dates, which OmegaConf refused ("Value 'date' is not a supported
    # primitive type", without the file's line): a run named by its date is its name.
    path = _write(tmp_path / "c.yaml", "logger:\n  wandb: {name: 2024-01-01}\ndescription: 2024-01-01 12:00:00\n")
    cfg = load_config("grpo", path, ["logger.mlflow.run_name=2024-12-31"])
    assert (cfg.logger.wandb.name, cfg.description, cfg.logger.mlflow.run_name) == (
        "2024-01-01", "2024-01-01 12:00:00", "2024-12-31")
    again = _write(tmp_path / "again.yaml", to_yaml(cfg))
    assert load_config("grpo", again) == cfg


def test_base_60_numbers_are_text(tmp_path):
    # YAML 1.1 reads them as base-60 numbers: a one-day limit, 1:00:00:00, failed as "got 216000,
    # expected a valid string", and a run named 12:30 as "got 750".
    path = _write(tmp_path / "c.yaml", "checkpointing: {checkpoint_must_save_by: 1:00:00:00}\n")
    cfg = load_config("grpo", path, ["logger.wandb.name=12:30", "description=-1:30.5"])
    assert (cfg.checkpointing.checkpoint_must_save_by, cfg.logger.wandb.name, cfg.description) == (
        "1:00:00:00", "12:30", "-1:30.5")
    assert load_config("grpo", _write(tmp_path / "again.yaml", to_yaml(cfg))) == cfg
    # Numbers stay numbers.
    cfg = load_config("grpo", None, ["grpo.seed=-5", "policy.max_grad_norm=1_0.5", "grpo.max_num_steps=+7"])
    assert (cfg.grpo.seed, cfg.policy.max_grad_norm, cfg.grpo.max_num_steps) == (-5, 10.5, 7)


def test_a_seed_torch_cannot_take_is_refused_with_the_config():
    # It failed at the run's first torch.manual_seed, as "Overflow when unpacking long long", and
    # one of 10**16 at GRPO's first shuffled minibatch (seed * 1_000_003 + step), minutes in.
    with pytest.raises(ConfigError, match=r"grpo.seed: got 99999999999999999999, expected less than 4294967296"):
        load_config("grpo", None, ["grpo.seed=99999999999999999999"])
    with pytest.raises(ConfigError, match=r"policy.generation.seed: got 10000000000000000, expected less than"):
        load_config("grpo", None, ["policy.generation.seed=10000000000000000"])
    seed = load_config("eval", None, [f"eval.seed={2**32 - 1}"]).eval.seed
    assert seed == 2**32 - 1 and load_config("grpo", None, [f"grpo.seed={-(2**32)}"]).grpo.seed == -(2**32)
    # The largest seeds' derived ones are seeds torch takes.
    import torch

    from posttrain.algorithms.grpo import minibatch_permutation
    from posttrain.generation.sampling import version_seed

    torch.Generator().manual_seed(version_seed(seed + 1023, 10**9))
    assert sorted(minibatch_permutation(8, 2**32 - 1, 10**9).tolist()) == list(range(8))


def test_zero_padded_numbers_are_decimal_or_text(tmp_path):
    # YAML 1.1 reads them as octal: seed 0123 was 83 (and 09 was 9), a run named 007 "got 7".
    path = _write(tmp_path / "c.yaml", "grpo: {seed: 0123}\nlogger:\n  wandb: {name: 007}\n")
    cfg = load_config("grpo", path, ["grpo.max_num_steps=010", "policy.max_grad_norm=02", "description=-01"])
    assert (cfg.grpo.seed, cfg.logger.wandb.name, cfg.grpo.max_num_steps) == (123, "007", 10)
    assert (cfg.policy.max_grad_norm, cfg.description) == (2.0, "-01")
    assert load_config("grpo", _write(tmp_path / "again.yaml", to_yaml(cfg))) == cfg
    assert load_config("grpo", None, ["grpo.seed=0x10"]).grpo.seed == 16  # a prefixed base stays


def test_config_paths_expand_the_home_folder(tmp_path, monkeypatch):
    # --config=~/c.yaml (the shell leaves that ~ alone) and a `defaults:` path under ~ were read
    # relative to the working directory / the naming file: 'config file not found: <cwd>/~/c.yaml'.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _write(tmp_path / "home" / "base.yaml", "grpo: {seed: 7}\n")
    _write(tmp_path / "home" / "c.yaml", "defaults: ~/base.yaml\npolicy: {max_grad_norm: 0.5}\n")
    cfg = load_config("grpo", "~/c.yaml")
    assert (cfg.grpo.seed, cfg.policy.max_grad_norm) == (7, 0.5)


def test_every_config_key_has_its_own_description():
    # Each key's meaning in docs/config.md is its own comment in posttrain/schemas.py (a comment
    # never documents the fields after it), so a field added without one must fail here.
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    described = gen.descriptions()
    assert "policy.max_grad_norm" in described and "env.<name>.timeout_s" in described
    # The settings of each built-in environment (env.<name>.cfg), which the `cfg` row points to.
    from posttrain.schemas import BUILTIN_ENV_CONFIGS

    for env, model in BUILTIN_ENV_CONFIGS.items():
        assert {f"env.{env}.cfg.{key}" for key in model.model_fields} <= described.keys(), env
    missing = gen.missing_descriptions()
    assert not missing, (
        f"{len(missing)} config keys have no description; write a comment on or just above each field "
        "in posttrain/schemas.py: " + ", ".join(missing)
    )
    # The comment above one field is not the description of the next (the old group rule).
    assert len({described[k] for k in ("grpo.use_dynamic_sampling", "grpo.dynamic_sampling_max_gen_batches",
                                        "grpo.batch_multiplier", "grpo.seed")}) == 4


# --------------------------------------------------------------------------- cross-key checks


def test_dropout_is_off_by_default_except_for_sft():
    for algo, off in (("grpo", True), ("dpo", True), ("rm", True), ("sft", False)):
        assert load_config(algo).policy.disable_dropout is off
    assert load_config("sft", None, ["policy.disable_dropout=true"]).policy.disable_dropout is True
    assert load_config("grpo", None, ["policy.disable_dropout=false"]).policy.disable_dropout is False


def test_reward_model_cfg_enabled_follows_the_command():
    # Unset, the command decides: only `posttrain rm` trains a reward model.
    for algo in ("grpo", "sft", "dpo", "eval"):
        assert load_config(algo).policy.reward_model_cfg.enabled is False
    assert load_config("rm").policy.reward_model_cfg.enabled is True
    assert load_config("rm", None, ["policy.reward_model_cfg.enabled=null"]).policy.reward_model_cfg.enabled is True
    assert load_config("sft", None, ["policy.reward_model_cfg.enabled=null"]).policy.reward_model_cfg.enabled is False
    # An explicit value the command contradicts fails, naming the key.
    with pytest.raises(ConfigError) as e:
        load_config("rm", None, ["policy.reward_model_cfg.enabled=false"])
    assert "policy.reward_model_cfg.enabled=false, but `posttrain rm` trains a reward model" in str(e.value)
    for algo in ("grpo", "sft", "dpo"):
        with pytest.raises(ConfigError) as e:
            load_config(algo, None, ["policy.reward_model_cfg.enabled=true"])
        assert f"policy.reward_model_cfg.enabled=true, but `posttrain {algo}` trains a causal LM" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("rm", None, ["policy.reward_model_cfg.reward_model_type=regression"])
    assert "policy.reward_model_cfg.reward_model_type: got 'regression', expected 'bradley_terry'" in str(e.value)


def test_greedy_validation_with_several_samples_per_prompt_is_rejected():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["grpo.num_val_generations_per_prompt=4"])  # val_greedy defaults to true
    msg = str(e.value)
    assert "grpo.val_greedy=true with grpo.num_val_generations_per_prompt=4" in msg
    assert "set grpo.val_greedy=false" in msg
    cfg = load_config("grpo", None, ["grpo.num_val_generations_per_prompt=4", "grpo.val_greedy=false"])
    assert cfg.grpo.num_val_generations_per_prompt == 4
    assert load_config("grpo", None, ["grpo.val_greedy=true"]).grpo.num_val_generations_per_prompt == 1
    # The same in `posttrain eval`, by eval.greedy or a sampling setting that picks the top token (it
    # reported pass@4 of four identical samples).
    n4 = ["eval.num_tests_per_prompt=4", "eval.k_value=4"]
    for extra, msg in ((["eval.greedy=true"], "eval.greedy=true with eval.num_tests_per_prompt=4: every prompt gets 4 "
                        "identical samples, so pass@k and cons@k mean nothing; set eval.greedy=false (or null), or "
                        "eval.num_tests_per_prompt=1"),
                       (["policy.generation.top_k=1"], "policy.generation.top_k=1 (the most likely token only) with "
                        "eval.num_tests_per_prompt=4: every prompt gets 4 identical samples, so pass@k and cons@k mean "
                        "nothing; set a sampling policy.generation.top_k, or eval.num_tests_per_prompt=1")):
        with pytest.raises(ConfigError) as e:
            load_config("eval", None, n4 + extra)
        assert msg in str(e.value)
    assert load_config("eval", None, n4).eval.greedy is None  # sampled
    assert load_config("eval", None, ["eval.greedy=true", "policy.generation.temperature=0"]).eval.greedy


def test_a_lower_clip_above_1_is_refused():
    # 1 - ratio_clip_min < 0 clips nothing, as 1 does: a larger value is a misread key.
    with pytest.raises(ConfigError, match=r"loss_fn.ratio_clip_min: got 1.5, expected less than or equal to 1"):
        load_config("grpo", None, ["loss_fn.ratio_clip_min=1.5"])
    assert load_config("grpo", None, ["loss_fn.ratio_clip_min=1"]).loss_fn.ratio_clip_min == 1


def test_exclusive_loss_modes_are_named_by_their_dotted_keys():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=true"])
    assert "loss_fn: loss_fn.disable_ppo_ratio and loss_fn.use_cispo are mutually exclusive" in str(e.value)


def test_on_policy_distillation_settings():
    with pytest.raises(ConfigError, match="needs a teacher: set policy.reference_model_name"):
        load_config("grpo", None, ["grpo.adv_estimator=on_policy_distillation"])
    with pytest.raises(ConfigError, match="grpo.use_dynamic_sampling, grpo.reward_scaling.enabled: act on rewards"):
        load_config("grpo", None, ["grpo.adv_estimator=on_policy_distillation", "policy.reference_model_name=t",
                                   "grpo.use_dynamic_sampling=true", "grpo.reward_scaling.enabled=true"])
    cfg = load_config("grpo", None, ["grpo.adv_estimator=on_policy_distillation", "policy.reference_model_name=t"])
    assert cfg.needs_reference() and not load_config("grpo", None, []).needs_reference()
    # A warm-up before a KL penalty is refused only when the reference is the policy's own start.
    kl = ["grpo.warmup_sft_steps=5", "loss_fn.reference_policy_kl_penalty=0.1"]
    with pytest.raises(ConfigError, match="name the reference in policy.reference_model_name"):
        load_config("grpo", None, kl)
    assert load_config("grpo", None, [*kl, "policy.reference_model_name=t"]).needs_reference()
    with pytest.raises(ConfigError, match="grpo.warmup_sft_steps > 0 with grpo.reward_kl_penalty > 0: the KL "
                                          "reference is the model before the warm-up"):
        load_config("grpo", None, ["grpo.warmup_sft_steps=5", "grpo.reward_kl_penalty=0.1"])
    assert load_config("grpo", None, ["grpo.reward_kl_penalty=0.1"]).needs_reference()
    with pytest.raises(ConfigError, match="grpo.reward_kl_penalty: act on rewards"):
        load_config("grpo", None, ["grpo.adv_estimator=on_policy_distillation", "policy.reference_model_name=t",
                                   "grpo.reward_kl_penalty=0.1"])
    # A teacher named while the estimator stayed grpo was never loaded, and the run trained without it.
    with pytest.raises(ConfigError, match="policy.reference_model_name='t' is set, but nothing in this `posttrain "
                                          "grpo` run uses a reference model: loss_fn.reference_policy_kl_penalty=0, "
                                          "grpo.reward_kl_penalty=0 and grpo.adv_estimator=grpo"):
        load_config("grpo", None, ["policy.reference_model_name=t"])


def test_reference_sync_needs_a_reference_it_may_move():
    # TR-DPO's update of a reference the run does not load, of LoRA's base model, or of a
    # distillation teacher: refused before anything starts.
    on = "policy.reference_sync.enabled=true"
    for command, extra in (("sft", []), ("grpo", []), ("dpo", ["dpo.loss.name=simpo"])):
        with pytest.raises(ConfigError, match=f"policy.reference_sync.enabled=true, but this `posttrain {command}` "
                                              "run loads no reference model to update"):
            load_config(command, None, [on, *extra])
    with pytest.raises(ConfigError, match="with policy.lora.enabled=true: the reference is the base model"):
        load_config("dpo", None, [on, "policy.lora.enabled=true"])
    with pytest.raises(ConfigError, match="on_policy_distillation: the reference is the teacher"):
        load_config("grpo", None, [on, "grpo.adv_estimator=on_policy_distillation", "policy.reference_model_name=t"])
    for command, extra in (("dpo", []), ("kto", []), ("grpo", ["loss_fn.reference_policy_kl_penalty=0.01"])):
        sync = load_config(command, None, [on, *extra]).policy.reference_sync
        assert (sync.enabled, sync.mixup_alpha, sync.sync_steps) == (True, 0.6, 512)  # TRL's defaults
    with pytest.raises(ConfigError, match="policy.reference_sync.mixup_alpha: got 0"):
        load_config("dpo", None, [on, "policy.reference_sync.mixup_alpha=0"])


def test_a_reference_model_nothing_uses_is_refused():
    # SimPO and the commands without a reference never loaded it, nor checked its path: the run
    # went on as if it were not there.
    with pytest.raises(ConfigError) as e:
        load_config("dpo", None, ["policy.reference_model_name=ref", "dpo.loss.name=simpo"])
    assert ("policy.reference_model_name='ref' is set, but nothing in this `posttrain dpo` run uses a reference "
            "model: dpo.loss.name=simpo is reference-free; use sigmoid, ipo, robust or hinge with it, or unset it  "
            "[policy.reference_model_name set at command line (policy.reference_model_name=ref); dpo.loss.name set "
            "at command line (dpo.loss.name=simpo)]") in str(e.value)
    assert load_config("dpo", None, ["policy.reference_model_name=ref"]).needs_reference()
    assert not load_config("dpo", None, ["dpo.loss.name=simpo"]).needs_reference()
    assert not load_config("dpo", None, ["dpo.loss.name=orpo"]).needs_reference()
    with pytest.raises(ConfigError, match="dpo.loss.name=orpo is reference-free; use sigmoid, ipo, robust or hinge"):
        load_config("dpo", None, ["policy.reference_model_name=ref", "dpo.loss.name=orpo"])
    # ORPO's odds and SimPO's length normalisation need means: false was ignored.
    with pytest.raises(ConfigError, match="dpo.preference_average_log_probs=false: dpo.loss.name=orpo always "
                                          "averages the sequence logprobs; unset it"):
        load_config("dpo", None, ["dpo.loss.name=orpo", "dpo.preference_average_log_probs=false"])
    for command in ("sft", "rm", "eval"):
        with pytest.raises(ConfigError, match=f"nothing in this `posttrain {command}` run uses a reference model: "
                                              f"`posttrain {command}` has none; unset it"):
            load_config(command, None, ["policy.reference_model_name=ref"])


def test_grpo_estimator_options_are_refused_with_the_estimators_that_ignore_them(tmp_path):
    # Only the grpo estimator reads them: rloo with normalize_rewards=true ran unnormalized without a word.
    cfg = load_config("grpo", None, [])
    assert (cfg.grpo.normalize_rewards, cfg.grpo.use_leave_one_out_baseline) == (True, True)  # null: true for grpo
    assert load_config("grpo", None, ["grpo.normalize_rewards=false"]).grpo.normalize_rewards is False
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["grpo.adv_estimator=rloo", "grpo.normalize_rewards=true"])
    assert ("grpo.normalize_rewards=true set, but grpo.adv_estimator=rloo does not read it (options of the grpo "
            "estimator only): rloo always takes the mean of the group's other samples as the baseline and divides "
            "by no std") in str(e.value)
    assert ("[grpo.normalize_rewards set at command line (grpo.normalize_rewards=true); grpo.adv_estimator set at "
            "command line (grpo.adv_estimator=rloo)]") in str(e.value)
    # A value that agrees with what the estimator does is refused too: it is no setting of it.
    path = _write(tmp_path / "dr.yaml", """
        grpo:
          adv_estimator: dr_grpo
          use_leave_one_out_baseline: false
    """)
    with pytest.raises(ConfigError, match=re.escape(
            f"does not read it (options of the grpo estimator only): dr_grpo always takes the group mean as the "
            f"baseline and divides by no std; unset it (over a file that sets it: "
            f"grpo.use_leave_one_out_baseline=null), or use grpo.adv_estimator=grpo  "
            f"[grpo.use_leave_one_out_baseline set at {path}:4; grpo.adv_estimator set at {path}:3]")):
        load_config("grpo", path)
    # The way out the message names works over a file that sets the option.
    assert load_config("grpo", path, ["grpo.use_leave_one_out_baseline=null"]).grpo.adv_estimator == "dr_grpo"
    for estimator in ("reinforce_pp", "on_policy_distillation"):
        with pytest.raises(ConfigError, match=f"use_leave_one_out_baseline=true set, but grpo.adv_estimator="
                                              f"{estimator} does not read them"):
            load_config("grpo", None, [f"grpo.adv_estimator={estimator}", "policy.reference_model_name=t",
                                       "grpo.normalize_rewards=false", "grpo.use_leave_one_out_baseline=true"])
    # Unset they stay null, so the run's config.yaml (every key written out) loads back.
    cfg = load_config("grpo", None, ["grpo.adv_estimator=reinforce_pp"])
    assert cfg.grpo.normalize_rewards is None and cfg.grpo.use_leave_one_out_baseline is None
    assert load_config("grpo", _write(tmp_path / "saved.yaml", to_yaml(cfg))) == cfg


def test_normalize_rewards_takes_a_scale_by_name_as_trl_s_scale_rewards_does(tmp_path):
    # NeMo RL's booleans stay as written (true: the group's std); "batch" is Lite PPO's batch std.
    for text, value in (("true", True), ("false", False), ("group", "group"), ("batch", "batch"), ("none", "none")):
        cfg = load_config("grpo", None, [f"grpo.normalize_rewards={text}"])
        assert cfg.grpo.normalize_rewards == value
        assert load_config("grpo", _write(tmp_path / f"{text}.yaml", to_yaml(cfg))) == cfg  # a run's config.yaml
    path = _write(tmp_path / "typo.yaml", """
        grpo:
          normalize_rewards: batc
    """)
    with pytest.raises(ConfigError, match=re.escape(
            f"grpo.normalize_rewards: got 'batc', expected true, false or 'group', 'batch' or 'none'  "
            f"[set at {path}:3]")):
        load_config("grpo", path)
    with pytest.raises(ConfigError, match="grpo.normalize_rewards=batch set, but grpo.adv_estimator=rloo does not read it"):
        load_config("grpo", None, ["grpo.adv_estimator=rloo", "grpo.normalize_rewards=batch"])


def test_grpo_refuses_deterministic_decoding_of_the_samples_it_compares():
    # Greedy samples of a prompt are one response with one reward: every advantage was 0 and the run
    # trained nothing, accepted without a word.
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, ["policy.generation.temperature=0"])
    assert ("policy.generation.temperature=0 (greedy) makes the grpo.num_generations_per_prompt=8 samples of each "
            "prompt one response repeated, with one reward: grpo.adv_estimator=grpo compares them") in str(e.value)
    assert "[policy.generation.temperature set at command line (policy.generation.temperature=0)]" in str(e.value)
    with pytest.raises(ConfigError, match=r"top_k=1 \(the most likely token only\) makes .* "
                                          "grpo.adv_estimator=reinforce_pp compares them"):
        load_config("grpo", None, ["policy.generation.top_k=1", "grpo.adv_estimator=reinforce_pp"])
    with pytest.raises(ConfigError, match=r"min_p=1 \(the most likely token only\) makes .* min_p below 1"):
        load_config("grpo", None, ["policy.generation.min_p=1"])
    load_config("grpo", None, ["policy.generation.min_p=0.1"])
    # A group of one keeps its reward under REINFORCE++, and distillation learns from the teacher.
    load_config("grpo", None, ["policy.generation.temperature=0", "grpo.num_generations_per_prompt=1",
                               "grpo.adv_estimator=reinforce_pp", "policy.train_global_batch_size=16"])
    load_config("grpo", None, ["policy.generation.temperature=0", "grpo.adv_estimator=on_policy_distillation",
                               "policy.reference_model_name=t"])
    load_config("grpo", None, ["policy.generation.temperature=0.1", "policy.generation.top_k=2"])


def test_eval_refuses_an_input_cap_it_does_not_read():
    # Eval scores every row of its benchmark; a prompt cap below the context did nothing there.
    with pytest.raises(ConfigError) as e:
        load_config("eval", None, ["data.max_input_seq_length=128"])
    assert ("data.max_input_seq_length=128 is below policy.max_total_sequence_length=512, but `posttrain "
            "eval` scores every row and does not cap prompts") in str(e.value)
    assert "[data.max_input_seq_length set at command line (data.max_input_seq_length=128)]" in str(e.value)
    # At the context it caps nothing, as NeMo RL's configs set it.
    load_config("eval", None, ["data.max_input_seq_length=${policy.max_total_sequence_length}"])
    for command in ("sft", "grpo"):  # which read it
        assert load_config(command, None, ["data.max_input_seq_length=128"]).data.max_input_seq_length == 128


def test_add_generation_prompt_defaults_true():
    for algo in ("grpo", "sft", "dpo", "rm", "eval"):
        assert load_config(algo).data.add_generation_prompt is True
    for algo in ("sft", "grpo"):
        assert load_config(algo, None, ["data.add_generation_prompt=false"]).data.add_generation_prompt is False


def test_offline_algorithms_have_val_at_end():
    for algo in ("sft", "dpo", "rm"):
        assert getattr(load_config(algo), algo).val_at_end is True
        assert getattr(load_config(algo, None, [f"{algo}.val_at_end=false"]), algo).val_at_end is False


def test_unquoted_yaml_on_off_reads_as_the_word():
    # `policy.prefix_sharing.blockwise_attention=on` parses as YAML true; the key means "on".
    for value, word in (("on", "on"), ("off", "off"), ("auto", "auto")):
        cfg = load_config("grpo", None, [f"policy.prefix_sharing.blockwise_attention={value}"])
        assert cfg.policy.prefix_sharing.blockwise_attention == word
    with pytest.raises(ConfigError, match="blockwise_attention: got 'sometimes'"):
        load_config("grpo", None, ["policy.prefix_sharing.blockwise_attention=sometimes"])


def test_reward_shaping_and_scaling_the_first_step_would_refuse_fail_at_load():
    # Before: the first GRPO step raised, after the setup, the warm-up SFT and the first validation.
    shaping = ["grpo.reward_shaping.enabled=true", "policy.generation.max_new_tokens=64"]
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, shaping)  # overlong_buffer_length defaults to 128
    assert ("grpo.reward_shaping.overlong_buffer_length (128) exceeds the response length that gets the full "
            "penalty (64, policy.generation.max_new_tokens") in str(e.value)
    with pytest.raises(ConfigError, match=r"\(100, grpo.reward_shaping.max_response_length\)"):
        load_config("grpo", None, [*shaping, "grpo.reward_shaping.max_response_length=100"])
    cfg = load_config("grpo", None, [*shaping, "grpo.reward_shaping.overlong_buffer_length=64"])
    assert cfg.grpo.reward_shaping.overlong_buffer_length == 64
    # One whose penalty starts past the longest one-turn response never penalizes (it ran at 0 silently).
    with pytest.raises(ConfigError, match=r"never penalizes: its penalty starts past grpo.reward_shaping."
                                          r"max_response_length - overlong_buffer_length = 97 tokens, and a response "
                                          r"has at most policy.generation.max_new_tokens=64"):
        load_config("grpo", None, [*shaping, "grpo.reward_shaping.max_response_length=100",
                                   "grpo.reward_shaping.overlong_buffer_length=3"])
    load_config("grpo", None, [*shaping, "grpo.reward_shaping.max_response_length=66",
                               "grpo.reward_shaping.overlong_buffer_length=3"])  # 64 tokens are past 63
    assert load_config("grpo", None, ["policy.generation.max_new_tokens=64"]).grpo.reward_shaping.enabled is False
    # Multi-turn: the response length counts every turn's tokens; max_new_tokens bounds one (a game of
    # three 30-token turns took the full penalty of a 64-token limit it never reached).
    multi_turn = [*shaping, "grpo.reward_shaping.overlong_buffer_length=16", "grpo.max_rollout_turns=3"]
    with pytest.raises(ConfigError, match="grpo.reward_shaping.enabled=true with grpo.max_rollout_turns=3 needs "
                                          "grpo.reward_shaping.max_response_length"):
        load_config("grpo", None, multi_turn)
    cfg = load_config("grpo", None, [*multi_turn, "grpo.reward_shaping.max_response_length=192"])
    assert cfg.grpo.reward_shaping.max_response_length == 192
    with pytest.raises(ConfigError, match=r"grpo.reward_scaling: source_max \(0.0\) must exceed source_min \(0.0\)"):
        load_config("grpo", None, ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_max=0"])
    assert load_config("grpo", None, ["grpo.reward_scaling.source_max=0"]).grpo.reward_scaling.source_max == 0


def test_a_ratio_fixed_to_one_with_several_updates_per_rollout_batch_fails_at_load():
    # Accepted before: the second optimizer step trained a moved policy on the first one's samples
    # with ratio 1 and no clip.
    batch = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_micro_batch_size=4"]
    on_policy = [*batch, "loss_fn.force_on_policy_ratio=true"]
    with pytest.raises(ConfigError) as e:
        load_config("grpo", None, [*on_policy, "policy.train_global_batch_size=8"])
    assert ("loss_fn.force_on_policy_ratio=true is exact for one optimizer step per rollout batch, but each step "
            "would run 2") in str(e.value)
    assert "Set policy.train_global_batch_size=16 and grpo.num_iterations=1" in str(e.value)
    with pytest.raises(ConfigError, match="would run 3"):
        load_config("grpo", None, [*on_policy, "policy.train_global_batch_size=16", "grpo.num_iterations=3"])
    assert load_config("grpo", None, [*on_policy, "policy.train_global_batch_size=16"]).loss_fn.force_on_policy_ratio
    assert load_config("grpo", None, [*batch, "policy.train_global_batch_size=8"]).policy.train_global_batch_size == 8


def test_grpo_packing_budgets_below_the_longest_rollout_fail_at_load():
    # Accepted before: the workers refused the first rollout longer than the budget mid-run, after
    # the setup and that step's generation ("raise the *_mb_tokens setting").
    packing = ["policy.max_total_sequence_length=128", "policy.sequence_packing.enabled=true"]
    for key, other in (("train_mb_tokens", "logprob_mb_tokens"), ("logprob_mb_tokens", "train_mb_tokens")):
        with pytest.raises(ConfigError, match=rf"policy.sequence_packing.{key} \(64\) is less than "
                                              r"policy.max_total_sequence_length \(128\), the longest a rollout"):
            load_config("grpo", None, [*packing, f"policy.sequence_packing.{key}=64",
                                       f"policy.sequence_packing.{other}=1024"])
    budgets = ["policy.sequence_packing.train_mb_tokens=128", "policy.sequence_packing.logprob_mb_tokens=256"]
    assert load_config("grpo", None, [*packing, *budgets]).policy.sequence_packing.enabled
    # SFT checks its data's longest row at setup instead: short rows may use a smaller budget.
    load_config("sft", None, [*packing, "policy.sequence_packing.train_mb_tokens=64",
                              "policy.sequence_packing.logprob_mb_tokens=64"])


def test_one_sample_per_prompt_with_a_group_baseline_fails_at_load():
    # Accepted before: every group was its own baseline, so every advantage was 0 and the run
    # trained nothing (dynamic sampling: dropped every group and stopped at step 0).
    one = ["grpo.num_prompts_per_step=32", "grpo.num_generations_per_prompt=1"]
    for estimator in ("grpo", "rloo", "dr_grpo"):
        with pytest.raises(ConfigError, match=f"grpo.adv_estimator={estimator} compares each sample with the other "
                                              "samples of its prompt, but grpo.num_generations_per_prompt=1"):
            load_config("grpo", None, [*one, f"grpo.adv_estimator={estimator}"])
    reinforce_pp = [*one, "grpo.adv_estimator=reinforce_pp"]
    assert load_config("grpo", None, reinforce_pp).grpo.num_generations_per_prompt == 1
    with pytest.raises(ConfigError, match="grpo.use_dynamic_sampling=true drops the groups whose rewards are all "
                                          "equal, which with grpo.num_generations_per_prompt=1 is every group"):
        load_config("grpo", None, [*reinforce_pp, "grpo.use_dynamic_sampling=true"])
    distillation = [*one, "grpo.adv_estimator=on_policy_distillation", "policy.reference_model_name=t"]
    assert load_config("grpo", None, distillation).grpo.num_generations_per_prompt == 1


def test_an_importance_sampling_correction_against_the_generation_logprobs_themselves_fails_at_load():
    # Accepted before: from the second step on prev_logprobs were the generation logprobs, so every
    # correction weight pi_prev / pi_gen was 1 (the quickstart takes them from generation).
    quickstart = ROOT / "examples/configs/grpo_quickstart.yaml"
    with pytest.raises(ConfigError) as e:
        load_config("grpo", quickstart, ["loss_fn.use_importance_sampling_correction=true"])
    assert ("loss_fn.use_importance_sampling_correction=true weighs each token by pi_prev / pi_gen, but "
            "grpo.prev_logprobs_from_generation=true takes prev_logprobs from the generation logprobs") in str(e.value)
    fixed = load_config("grpo", quickstart, ["loss_fn.use_importance_sampling_correction=true",
                                             "grpo.prev_logprobs_from_generation=false"])
    assert fixed.loss_fn.use_importance_sampling_correction
    # One optimizer step per batch: prev_logprobs are the training forward's own, whatever the key says.
    one_update = load_config("grpo", quickstart, ["loss_fn.use_importance_sampling_correction=true",
                                                  "policy.train_global_batch_size=512"])
    assert one_update.grpo.prev_logprobs_from_generation


def test_oversampling_without_dynamic_sampling_fails_at_load():
    # Accepted before: every step generated twice the samples it trained, dropped half, and used up
    # twice the prompts.
    with pytest.raises(ConfigError, match="grpo.batch_multiplier=2 oversamples prompts for dynamic sampling, but "
                                          "grpo.use_dynamic_sampling=false"):
        load_config("grpo", None, ["grpo.batch_multiplier=2"])
    cfg = load_config("grpo", None, ["grpo.batch_multiplier=2", "grpo.use_dynamic_sampling=true"])
    assert cfg.grpo.batch_multiplier == 2


def test_grpo_refuses_colocated_vllm():
    # The policy workers' colocated generation cannot run vLLM (it loads its own model): it used
    # to generate with the torch engine instead, whatever the config said.
    with pytest.raises(ConfigError, match=r"policy.generation.backend=vllm runs in separate generation workers: "
                                          r"set policy.generation.colocated.enabled=false"):
        load_config("grpo", None, ["policy.generation.backend=vllm"])
    cfg = load_config("grpo", None, ["policy.generation.backend=vllm", "policy.generation.colocated.enabled=false"])
    assert cfg.policy.generation.backend == "vllm"
    # Evaluation builds its generation backend in the driver: no placement to refuse.
    assert load_config("eval", None, ["policy.generation.backend=vllm"]).policy.generation.backend == "vllm"


def test_a_number_given_to_a_text_key_is_its_text():
    # `data.task_name=1` (YAML reads 1 as a number) was "got 1, expected a valid string": a typed
    # Hydra/OmegaConf config takes it as the text "1".
    cfg = load_config("grpo", None, ["data.task_name=1", "logger.wandb.name=2024"])
    assert cfg.data.task_name == "1" and cfg.logger.wandb.name == "2024"


def test_a_section_left_empty_in_yaml_keeps_its_defaults(tmp_path):
    # `tokenizer:` with nothing under it is null to YAML: "got None, expected a valid dictionary".
    path = _write(tmp_path / "c.yaml", """
        policy:
          tokenizer:
          lora:
    """)
    cfg = load_config("sft", path, [])
    assert cfg.policy.tokenizer.chat_template is None and cfg.policy.lora.enabled is False


@pytest.mark.parametrize("override,message", [
    ("logger.log_dir=", "logger.log_dir: an empty path"),  # an unset $OUT: the run wrote into the working directory
    ("checkpointing.checkpoint_dir=", "checkpointing.checkpoint_dir: an empty path"),
    ("policy.model_name=", "policy.model_name: got '', expected String should have at least 1 character"),
    ("data.operations=[]", "data.operations: got [], expected List should have at least 1 item"),  # a traceback 23 s in
])
def test_empty_values_that_named_nothing_are_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("grpo", None, [override])


def test_unknown_keys_are_named_as_written(tmp_path):
    # A dashed key was dropped from its path as if it were a type tag ("unknown key 'grpo'"); a
    # dotted key in YAML got a suggestion of itself.
    with pytest.raises(ConfigError, match=re.escape("unknown key 'grpo.max-num-steps' (did you mean grpo.max_num_steps?)")):
        load_config("grpo", None, ["grpo.max-num-steps=5"])
    with pytest.raises(ConfigError, match=re.escape("unknown key 'policy.generation.top-k' (did you mean "
                                                    "policy.generation.top_k?)")):
        load_config("grpo", None, ["policy.generation.top-k=5"])
    (tmp_path / "dotted.yaml").write_text("grpo.max_num_steps: 5\n")
    with pytest.raises(ConfigError, match=re.escape("unknown key 'grpo.max_num_steps': a key with dots in a YAML file "
                                                    "is one key, not a path; nest it (grpo: {max_num_steps: ...})")):
        load_config("grpo", str(tmp_path / "dotted.yaml"), [])


# --------------------------------------------------------------------------- settings left unread


def test_settings_a_default_mode_leaves_unread_are_named_with_their_origin(tmp_path, caplog):
    # A vllm_cfg under the default torch backend, a warm-up rate without warm-up steps, LoRA's rank
    # without LoRA: each changed nothing, and nothing said so.
    path = _write(tmp_path / "run.yaml", """
        grpo: {warmup_sft_lr: 1.0e-3}
        policy:
          generation:
            vllm_cfg: {max_model_len: 64, gpu_memory_utilization: 0.5}
    """)
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config("grpo", path, ["policy.lora.rank=4", "policy.generation.torch_cfg.max_batch_size=8"])
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"grpo.warmup_sft_lr (set at {path}:2): read only with grpo.warmup_sft_steps > 0; it is 0 (the default), "
        "so it changes nothing",
        f"policy.generation.vllm_cfg.gpu_memory_utilization (set at {path}:5), policy.generation.vllm_cfg.max_model_len "
        f"(set at {path}:5): read only with policy.generation.backend=vllm; it is 'torch' (the default), so they "
        "change nothing",
        "policy.lora.rank (command line): read only with policy.lora.enabled=true; it is false (the default), so it "
        "changes nothing",
    ]  # torch_cfg: the default backend reads it
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config("grpo", None, ["env.u.target=r.py:f", "env.u.max_tool_calls=2", "env.v.target=r.py:f",
                                   "env.v.tools=[t.py:add]", "env.v.tool_timeout_s=3", "grpo.max_rollout_turns=5"])
    assert caplog.messages == ["env.u.max_tool_calls (command line): read only with env.u.tools (the tool functions "
                               "of its reward functions); it is null (the default), so it changes nothing"]


def test_nemo_rl_keys_nothing_reads_are_named_when_changed(caplog):
    # Accepted so that NeMo RL configs load; changed, they were taken without a word.
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config("sft", None, ["sft.val_micro_batch_size=1"])  # the default
        load_config("sft", None, ["sft.val_micro_batch_size=8"])
        load_config("grpo", None, ["policy.generation.backend=vllm", "policy.generation.colocated.enabled=false",
                                   "policy.generation.vllm_cfg.async_engine=true"])
        load_config("dpo", None, ["logger.monitor_gpus=true", "logger.gpu_monitoring.flush_interval=3"])
    unread = "a NeMo RL key posttrain accepts and does not read"
    assert caplog.messages == [
        f"sft.val_micro_batch_size (command line): {unread} (validation forwards use policy.logprob_batch_size), so "
        "it changes nothing",
        f"policy.generation.vllm_cfg.async_engine (command line): {unread} (the vLLM backend runs its offline "
        "engine), so it changes nothing",
        f"logger.gpu_monitoring.flush_interval (command line): {unread} (GPU readings are logged with each step's "
        "metrics), so it changes nothing"]
    with pytest.raises(ConfigError, match=r"sft.per_device_eval_batch_size' \(posttrain's name for it: "
                                          r"policy.logprob_batch_size\)"):
        load_config("sft", None, ["sft.per_device_eval_batch_size=3"])


@pytest.mark.parametrize("command", ["grpo", "sft"])
def test_a_validation_metric_of_a_run_that_validates_at_no_save_is_named(command, caplog):
    # Every checkpoint ranked "not measured" (newest first, as without a metric); each save warned.
    never = [f"{command}.val_period=0", f"{command}.val_at_end=false"]
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config(command, None, ["checkpointing.metric_name=val:loss", *never])
        load_config(command, None, ["checkpointing.metric_name=val:loss", never[0]])  # the last save validates
        load_config(command, None, ["checkpointing.metric_name=train:loss", *never])
        load_config(command, None, ["checkpointing.metric_name=val:loss", "checkpointing.enabled=false", *never])
    assert caplog.messages == [
        f"checkpointing.metric_name (command line): a validation metric, but {command}.val_period=0 and "
        f"{command}.val_at_end=false validate at no save (checkpoints rank newest first), so it changes nothing"]


def test_generation_settings_of_a_command_that_generates_nothing_are_named(caplog, tmp_path):
    # `posttrain sft policy.generation.backend=vllm` (not even installed) trained without a word; its
    # vllm_cfg was said to need backend=vllm, which would have changed nothing either.
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config("dpo", None, ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.max_model_len=4096"])
    assert caplog.messages == [
        "policy.generation.backend (command line), policy.generation.vllm_cfg.max_model_len (command line): read "
        "only by the commands that generate (grpo, eval); `posttrain dpo` generates nothing, so they change nothing"]
    # A run's own config.yaml holds every default of policy.generation: re-read, it names none.
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.config"):
        saved = load_config("sft", _write(tmp_path / "config.yaml", to_yaml(load_config("sft", None))))
    assert caplog.messages == [] and "generation" in saved.policy.model_fields_set


def test_policy_worker_settings_of_an_eval_are_named(caplog):
    # Eval generates in its own process: tensor_parallel_size=2 was refused as not dividing "the 1
    # policy workers", and colocated.enabled=false or an optimizer passed without a word.
    with caplog.at_level("WARNING", logger="posttrain.config"):
        load_config("eval", None, ["policy.dtensor_cfg.tensor_parallel_size=2", "policy.max_grad_norm=2",
                                   "policy.generation.colocated.enabled=false", "policy.generation.seed=3",
                                   "policy.generation.temperature=0.5", "policy.precision=float32"])
        load_config("eval", None, ["policy.max_grad_norm=1.0", "policy.generation.colocated.enabled=true"])  # defaults
    assert caplog.messages == [
        "policy.dtensor_cfg.tensor_parallel_size (command line), policy.max_grad_norm (command line), "
        "policy.generation.colocated.enabled (command line), policy.generation.seed (command line): read only by the "
        "training commands' policy and generation workers; `posttrain eval` generates in its own process (its seed: "
        "eval.seed), so they change nothing"]


@pytest.mark.parametrize("overrides", [
    ["grpo.warmup_sft_lr=1e-3", "grpo.warmup_sft_steps=0"],  # the mode turned off on purpose (over a quickstart)
    ["policy.generation.vllm_cfg.max_model_len=4096", "policy.generation.backend=vllm",
     "policy.generation.colocated.enabled=false"],
    ["policy.generation.colocated.resources.num_nodes=1", "policy.generation.colocated.enabled=false"],
    ["grpo.reward_shaping.overlong_buffer_length=4", "grpo.reward_shaping.enabled=true",
     "grpo.reward_shaping.max_response_length=64"],
])
def test_settings_with_their_switch_given_warn_nothing(overrides, caplog):
    with caplog.at_level("WARNING", logger="posttrain.config"):
        cfg = load_config("grpo", None, overrides)
    assert not caplog.records
    assert cfg.model_dump() != load_config("grpo").model_dump()


def test_a_saved_config_reloads_without_unread_warnings(tmp_path, caplog):
    # config.yaml of a run holds every key, switches included: loading it back says nothing.
    cfg = load_config("grpo", None, ["grpo.warmup_sft_lr=1e-3"])
    assert len(caplog.records) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.config"):
        assert load_config("grpo", _write(tmp_path / "config.yaml", to_yaml(cfg))) == cfg
    assert not caplog.records


@pytest.mark.parametrize("written, kind", [("1", "a number"), ("2.5", "a number"), ("yes", "a boolean")])
def test_a_key_yaml_reads_as_a_number_or_boolean_is_named_as_written_with_its_line(tmp_path, written, kind):
    path = _write(tmp_path / "c.yaml", f"""
        policy:
          max_grad_norm: 1.0
          {written}: 2
    """)
    with pytest.raises(ConfigError) as e:
        load_config("grpo", path)
    assert f"  - policy: key '{written}' reads as {kind}" in str(e.value)
    assert str(e.value).endswith(f"not a name; quote it if that is the name  [set at {path}:4]")


def test_sequence_packing_for_a_reward_model_is_refused_before_its_budget_is_asked_for():
    # The packing section's own check came first ("set policy.sequence_packing.train_mb_tokens"), and
    # whoever followed it learned only then that a reward model trains on no packed rows.
    with pytest.raises(ConfigError) as e:
        load_config("rm", None, ["policy.sequence_packing.enabled=true"])
    assert str(e.value).splitlines()[1:] == [
        "  - policy.sequence_packing.enabled=true: a reward model is not trained on packed rows (its score is the "
        "head's output at each row's last token); use policy.dynamic_batching for token-budget micro-batches  "
        "[policy.sequence_packing.enabled set at command line (policy.sequence_packing.enabled=true)]"]
    load_config("rm", None, ["policy.sequence_packing.enabled=false"])


@pytest.mark.parametrize("algorithm, override, named", [
    ("sft", "policy.lr=1e-5", "policy.optimizer.kwargs.lr"),  # spelling said policy.lora
    ("sft", "sft.per_device_train_batch_size=2", "policy.train_micro_batch_size"),  # said val_micro_batch_size
    ("sft", "learning_rate=1e-5", "policy.optimizer.kwargs.lr"),
    ("sft", "num_train_epochs=2", "sft.max_num_epochs"),
    ("dpo", "num_train_epochs=2", "dpo.max_num_epochs"),
    ("sft", "packing=true", "policy.sequence_packing.enabled"),
    ("dpo", "dpo.beta=0.1", "dpo.reference_policy_kl_penalty"),
    ("grpo", "beta=0.04", "loss_fn.reference_policy_kl_penalty"),
    ("grpo", "num_generations=8", "grpo.num_generations_per_prompt"),
    ("grpo", "epsilon_high=0.28", "loss_fn.ratio_clip_max"),
    ("grpo", "loss_fn.ratio_clip_high=0.28", "loss_fn.ratio_clip_max"),  # spelling said ratio_clip_min
    ("grpo", "grpo.num_generations=8", "grpo.num_generations_per_prompt"),  # spelling said num_iterations
    ("grpo", "loss_fn.importance_sampling_level=sequence", "loss_fn.sequence_level_importance_ratios"),
    ("grpo", "grpo.kl_coef=0.001", "grpo.reward_kl_penalty"),  # verl's KL in the reward
    ("grpo", "loss_fn.kl_loss_coef=0.001", "loss_fn.reference_policy_kl_penalty"),  # verl's in the loss
])
def test_another_librarys_name_of_a_setting_names_posttrains(algorithm, override, named):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"unknown key '{key}' (posttrain's name for it: {named}")):
        load_config(algorithm, None, [override])


def test_another_librarys_setting_posttrain_has_no_need_of_says_so():
    with pytest.raises(ConfigError, match=re.escape("unknown key 'sft.completion_only_loss' (posttrain has no such "
                                                    "setting: assistant turns alone get loss")):
        load_config("sft", None, ["sft.completion_only_loss=true"])
    with pytest.raises(ConfigError, match=re.escape("unknown key 'grpo.async_grpo.in_flight_weight_updates' (NeMo RL's "
                                                    "async GRPO setting, not needed here")):
        load_config("grpo", None, ["grpo.async_grpo.in_flight_weight_updates=true"])


def test_settings_a_cluster_run_could_not_start_with_fail_at_load():
    # Each accepted, then failed (or cut) inside vLLM after Ray and the model started, or trained
    # in float16 without loss scaling.
    math = "examples/configs/grpo_math_1B.yaml"
    with pytest.raises(ConfigError, match=r"vllm_cfg.tensor_parallel_size=8: each generation worker runs its vLLM "
                                          r"engine on its own one GPU"):
        load_config("grpo", math, ["policy.generation.vllm_cfg.tensor_parallel_size=8"])
    with pytest.raises(ConfigError, match=r"vllm_cfg.max_model_len \(256\) is less than policy.max_total_sequence_length"):
        load_config("grpo", math, ["policy.generation.vllm_cfg.max_model_len=256"])
    assert load_config("grpo", math, ["policy.generation.vllm_cfg.max_model_len=4096"]).policy.generation.vllm_cfg
    for command in ("grpo", "sft", "dpo"):
        with pytest.raises(ConfigError, match=r"policy.precision=float16: training in float16 needs loss scaling"):
            load_config(command, None, ["policy.precision=float16"])
    assert load_config("eval", None, ["policy.precision=float16"]).policy.precision == "float16"  # it generates only
