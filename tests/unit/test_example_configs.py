"""Every YAML under examples/configs validates through the schema of its algorithm.

The algorithm comes from the file name: grpo_*, sft*, dpo*, rm*, and
anything under evals/ is an eval config. A file that matches none of these fails, so a new
exemplar cannot be left unchecked.
"""

from pathlib import Path

import pytest

from posttrain.config import load_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
PREFIXES = [("grpo_", "grpo"), ("sft", "sft"), ("dpo", "dpo"), ("rm", "rm")]


def algorithm_of(path: Path) -> str:
    rel = path.relative_to(CONFIGS)
    if rel.parts[0] == "evals":
        return "eval"
    for prefix, algo in PREFIXES:
        if rel.name.startswith(prefix):
            return algo
    raise AssertionError(f"{rel}: cannot tell its algorithm from its name (expected one of "
                         f"{', '.join(p for p, _ in PREFIXES)}* or evals/)")


ALL = sorted(CONFIGS.rglob("*.yaml"))


def test_there_are_exemplars():
    assert any(p.name == "grpo_math_1B.yaml" for p in ALL)


@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(CONFIGS)) for p in ALL])
def test_example_config_validates(path, tmp_path):
    algo = algorithm_of(path)
    cfg = load_config(algo, path)
    resolved = to_yaml(cfg)
    assert "${" not in resolved  # every interpolation resolved
    # The resolved config written into a run (and shown by --print-config) loads back the same.
    (tmp_path / "resolved.yaml").write_text(resolved)
    assert load_config(algo, tmp_path / "resolved.yaml") == cfg


def test_grpo_math_1b_is_the_documented_gpu_exemplar():
    cfg = load_config("grpo", CONFIGS / "grpo_math_1B.yaml")
    assert cfg.policy.model_name == cfg.policy.tokenizer.name == "Qwen/Qwen2.5-1.5B"
    # 8 GPUs: 4 train, 4 generate (vLLM runs in generation workers of its own).
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node) == (1, 4)
    assert cfg.policy.generation.backend == "vllm" and not cfg.policy.generation.colocated.enabled
    assert cfg.policy.generation.colocated.resources.gpus_per_node == 4
    assert cfg.policy.dynamic_batching.train_mb_tokens == 512 * 4
    assert cfg.policy.generation.vllm_cfg.max_model_len == cfg.policy.max_total_sequence_length
    assert cfg.policy.train_global_batch_size == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert "math" in cfg.env.model_dump()


def test_training_exemplars_have_their_own_checkpoint_dir():
    """A config inheriting another must not inherit its checkpoint_dir: run after it, it would
    resume the other run's checkpoints instead of training."""
    owners: dict[str, str] = {}
    for path in ALL:
        algo = algorithm_of(path)
        if algo == "eval":
            continue
        name = str(path.relative_to(CONFIGS))
        checkpoint_dir = load_config(algo, path).checkpointing.checkpoint_dir
        assert checkpoint_dir not in owners, f"{name} and {owners[checkpoint_dir]} share {checkpoint_dir}"
        owners[checkpoint_dir] = name
