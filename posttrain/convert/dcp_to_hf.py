"""`posttrain convert dcp-to-hf`: a saved policy checkpoint (torch.distributed.checkpoint) ->
a Hugging Face folder (safetensors + config + tokenizer), without Ray or a process group.

The policy checkpoint folder (`step_N/policy`, written by `Policy.save_checkpoint`) holds the
sharded weights and optimizer, `hf_config/` (model config + tokenizer) and `policy_meta.json`
(model kind and LoRA settings), so no run config is needed; `--config` (the run's YAML) is
only used when `hf_config/` is missing, to find `policy.model_name` and the tokenizer the run
exported (`policy.tokenizer.name` and `chat_template`, `data.add_bos` / `add_eos`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.checkpoint import complete_checkpoints, policy_checkpoint_dir
from posttrain.config import ConfigError, InputError, MissingInputError, load_yaml_with_defaults
from posttrain.convert.output import check_replaceable
from posttrain.embedded import resolve_model_path
from posttrain.policy.hf_io import (config_for_kind, exported_chat_template, load_generation_config, load_hf_config,
                                    model_class, save_hf)
from posttrain.schemas import LoraConfig, PolicyConfig, chat_template_text

log = logging.getLogger(__name__)

META_FILE = "policy_meta.json"
HF_CONFIG_DIR = "hf_config"


def _policy_dir(checkpoint: Path) -> Path:
    found = policy_checkpoint_dir(checkpoint)
    if found is not None:
        return found
    hint = ""
    inside = complete_checkpoints(checkpoint)
    if inside:  # a checkpointing.checkpoint_dir, named instead of one of its step_N checkpoints
        hint = f"; it holds the checkpoints {', '.join(p.name for p in inside)}: pass one, e.g. --checkpoint {inside[-1]}"
    raise MissingInputError(f"no torch.distributed.checkpoint in {checkpoint} or {checkpoint / 'policy'} "
                            f"(missing .metadata){hint}")


def _model_source(policy_dir: Path, config_path: str | None) -> tuple[str, dict | None]:
    """The model folder or name to build the model and tokenizer from, and, when that came from
    the run's config (a checkpoint without `hf_config/`), the config's tokenizer settings, which
    the export writes as the run's own export does (`exported_chat_template`)."""
    if (policy_dir / HF_CONFIG_DIR / "config.json").is_file():
        if config_path is not None and (policy_dir / META_FILE).is_file():
            log.warning("--config %s is not read: the checkpoint carries its model's config and tokenizer (%s/)",
                        config_path, HF_CONFIG_DIR)
        return str(policy_dir / HF_CONFIG_DIR), None
    setting = _run_config(policy_dir, config_path, f"{policy_dir} has no {HF_CONFIG_DIR}/")
    name = setting("policy.model_name", PolicyConfig().model_name, (str,))
    template = setting("policy.tokenizer.chat_template", None, (str, type(None)))
    return name, {"tokenizer": setting("policy.tokenizer.name", None, (str, type(None))) or name,
                  # The run's template, not its base model's (the export rendered prompts otherwise).
                  "chat_template": chat_template_text(template),
                  "add_bos": setting("data.add_bos", True, (bool,)),
                  "add_eos": setting("data.add_eos", True, (bool,))}


def _run_config(policy_dir: Path, config_path: str | None, missing: str) -> Callable[[str, Any, tuple], Any]:
    """A reader of the run's config (`--config`, else the config.yaml saved with the checkpoint):
    `setting(key, default, types)`. Read as the run read it (`defaults:`, interpolation); the run's
    algorithm is not known here, so a key it lacks takes the `default` given."""
    candidates = [Path(config_path)] if config_path else [policy_dir / "config.yaml", policy_dir.parent / "config.yaml"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise MissingInputError(f"{missing} and no run config was found (tried {', '.join(map(str, candidates))}); "
                                "pass --config")
    cfg = load_yaml_with_defaults(found)

    def setting(key: str, default: Any, kinds: tuple[type, ...]) -> Any:
        try:
            value = OmegaConf.select(cfg, key, default=default)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{found}: cannot read {key}: {str(e).splitlines()[0]}") from None
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
        if not isinstance(value, kinds):
            raise ConfigError(f"{found}: {key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        return value

    return setting


def _policy_meta(policy_dir: Path, config_path: str | None) -> dict[str, Any]:
    """The model kind and LoRA settings the checkpoint was saved with (`META_FILE`), else the run
    config's: without them a LoRA checkpoint failed as "another model's", naming neither."""
    if (policy_dir / META_FILE).is_file():
        return json.loads((policy_dir / META_FILE).read_text())
    try:
        setting = _run_config(policy_dir, config_path, f"{policy_dir} has no {META_FILE}")
    except MissingInputError:  # a causal LM without LoRA, as most are (a misfit is then named)
        return {"model_kind": "causal_lm", "lora": {}, "guessed": True}
    rm = setting("policy.reward_model_cfg.enabled", False, (bool,))
    return {"model_kind": "sequence_classification" if rm else "causal_lm", "lora": setting("policy.lora", {}, (dict,))}


def _cause(error: BaseException) -> str:
    """`error` in one line: a CheckpointException's text is every rank's whole traceback, so its
    first rank's own error stands for it."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _drop_dcp_record(record: logging.LogRecord) -> bool:
    return "torch/distributed/checkpoint/" not in record.pathname.replace("\\", "/")


@contextlib.contextmanager
def _without_dcp_fallback_logs() -> Iterator[None]:
    """dcp.load logs each metadata fallback of an unreadable checkpoint on the root logger, with
    its whole traceback (27 lines before the one-line error that names the checkpoint and cause)."""
    root = logging.getLogger()
    root.addFilter(_drop_dcp_record)
    try:
        yield
    finally:
        root.removeFilter(_drop_dcp_record)


def convert(checkpoint: str | Path, output: str | Path, config_path: str | None = None) -> Path:
    """Write the policy weights of `checkpoint` as a transformers checkpoint in `output`."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    from posttrain.policy.lora import maybe_apply_lora, merge_lora_state_dict

    if config_path is not None and not Path(config_path).is_file():
        raise MissingInputError(f"--config {config_path}: no such file")
    policy_dir = _policy_dir(Path(checkpoint))
    check_replaceable(Path(output), {"--checkpoint": checkpoint, "--config": config_path})
    meta = _policy_meta(policy_dir, config_path)
    model_kind = meta["model_kind"]
    lora = LoraConfig(**meta["lora"])
    source, run_tokenizer = _model_source(policy_dir, config_path)
    path, hf_config = load_hf_config(source)
    # Built on the meta device, then given uninitialised CPU storage: dcp.load fills every
    # saved tensor, so no time goes into a random init that would be overwritten.
    with torch.device("meta"):
        model = maybe_apply_lora(model_class(model_kind).from_config(config_for_kind(hf_config, model_kind),
                                                                     dtype=torch.float32), lora)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings(), _without_dcp_fallback_logs():  # a single process without a group is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(policy_dir))
        # A truncated or foreign checkpoint: name it, no traceback (CheckpointException, what
        # dcp raises for an unreadable one, is a BaseException).
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001
            cause = _cause(e)
            if "size mismatch" in cause.lower() or "missing key" in cause.lower():
                why = (f"its {META_FILE} (model kind, LoRA settings) is missing, and no run config says them"
                       if meta.get("guessed") else "it is another model's")
                raise InputError(f"the checkpoint in {policy_dir} does not fit the model of {source} ({cause}); "
                                 f"{why}: pass the run's own config (--config)") from e
            raise InputError(f"cannot read the checkpoint in {policy_dir} ({cause}); a save cut "
                             "short or files copied in part? Convert another step_N") from e
    sd = {k: v.detach() for k, v in state["model"].items()}
    if lora.enabled:
        sd = merge_lora_state_dict(sd, lora)
    tokenizer = AutoTokenizer.from_pretrained(path if run_tokenizer is None else
                                              resolve_model_path(run_tokenizer["tokenizer"]))
    if run_tokenizer is not None:
        if run_tokenizer["chat_template"] is not None:
            tokenizer.chat_template = run_tokenizer["chat_template"]
        scored_eos = run_tokenizer["add_eos"] and model_kind == "sequence_classification"
        tokenizer.chat_template = exported_chat_template(tokenizer, bos=run_tokenizer["add_bos"], eos=scored_eos)
    save_hf(sd, hf_config, tokenizer, output, model_kind, load_generation_config(path))
    log.info("wrote %s from %s", output, policy_dir)
    return Path(output)


def main(args) -> None:
    """CLI entry: `args.checkpoint`, `args.output`, optional `args.config`."""
    convert(args.checkpoint, args.output, args.config)
