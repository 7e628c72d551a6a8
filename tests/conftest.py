"""Test-session setup: an isolated cache and Ray temp dir, and one shared local Ray cluster."""

import os
import shutil
import tempfile

import pytest

from posttrain.distributed.cluster import apply_ray_env_defaults

_TMP = tempfile.mkdtemp(prefix="posttrain-tests-")
os.environ.setdefault("POSTTRAIN_CACHE", os.path.join(_TMP, "cache"))
os.environ.setdefault("RAY_TMPDIR", os.path.join(_TMP, "ray"))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
apply_ray_env_defaults()  # the Ray settings `init_ray` runs posttrain's jobs with

SHARED_DATA = os.environ.get(
    "POSTTRAIN_SHARED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
)


@pytest.fixture(scope="session")
def shared_data():
    """Path of ../shared/data (real public data and stories260K); skips when absent."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set POSTTRAIN_SHARED_DATA)")
    return os.path.abspath(SHARED_DATA)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (starting one costs ~3 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


class KilledAfterSave(BaseException):
    """What `kill_after_save` raises: the run gone right after a checkpoint, as SIGKILL or the OOM
    killer leave it (a BaseException: no `except Exception` of the loop handles it)."""


@pytest.fixture
def kill_after_save(monkeypatch):
    """`kill_after_save(step)`: the driver's checkpoint of `step` is saved whole, then the run raises
    KilledAfterSave (`kill_after_save.error`: the test files cannot import this conftest), before the
    loop does anything more."""
    from posttrain.checkpoint import CheckpointManager

    def arm(step: int) -> None:
        save = CheckpointManager.save

        def save_then_die(self, at, *args, **kwargs):
            path = save(self, at, *args, **kwargs)
            if at == step:
                raise KilledAfterSave(path)
            return path

        monkeypatch.setattr(CheckpointManager, "save", save_then_die)

    arm.error = KilledAfterSave
    return arm


@pytest.fixture(scope="session")
def stories260k(shared_data, tmp_path_factory):
    """stories260K from the shared data, converted once per session by posttrain's llama2.c
    converter into an HF folder (tests only read it)."""
    from posttrain.convert.llama2c import convert

    src = os.path.join(shared_data, "models", "stories260K")
    return str(convert(os.path.join(src, "stories260K.bin"), os.path.join(src, "tok512.model"),
                       tmp_path_factory.mktemp("stories260K") / "hf"))


@pytest.fixture
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a torch.distributed rendezvous in this process."""
    from posttrain.distributed.ports import free_port as find

    return find("127.0.0.1")


@pytest.fixture
def single_rank_worker_env(monkeypatch, free_port):
    """The environment a policy worker reads when it runs in this process as rank 0 of 1 (no Ray);
    its process group is destroyed afterwards."""
    import torch.distributed as dist

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port)}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def save_68b_config():
    """`save(folder, vocab_size=128256)`: the model folder of a ~68B-parameter Llama, too large for
    the RAM of any test machine, whose weights file holds only its final norm (it passes the
    drivers' check of the files; loading would fail differently, so a memory error proves the
    memory check ran first)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    def save(folder, vocab_size: int = 128256):
        LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                    num_key_value_heads=8, vocab_size=vocab_size).save_pretrained(folder)
        save_file({"model.norm.weight": torch.ones(8192)}, f"{folder}/model.safetensors")
        return folder

    return save


@pytest.fixture(scope="session")
def tiny_model_path():
    from posttrain.embedded import resolve_model_path

    return resolve_model_path("embedded:tiny")


# Qwen3's rule for reasoning, over the embedded tokenizer's role markers: an assistant turn's reasoning
# is its `reasoning_content` field when it has one, else its content's <think> block; the turn keeps it
# only after the last user message, and the last turn always has a block (empty without reasoning);
# earlier turns are written as their text after </think>.
QWEN3_LIKE_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if m.reasoning_content is string %}{% set reasoning = m.reasoning_content.strip('\\n') %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<|assistant|><think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|end|>' }}"
    "{% else %}{{ '<|assistant|>' + content + '<|end|>' }}{% endif %}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture
def qwen3_like_tok():
    """The embedded tokenizer with `QWEN3_LIKE_TEMPLATE`."""
    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def qwen3_template() -> str:
    """Qwen3's chat template (tests/data/qwen3_chat_template.jinja)."""
    from pathlib import Path

    return (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()


@pytest.fixture(scope="session")
def qwen3_2507_like_template(qwen3_template) -> str:
    """Qwen3's chat template with the check the templates of its later releases (Qwen3-2507, Qwen3.5)
    make once they have looked for the last user query, raising as they do: a conversation without a
    user message (a system message alone, tool results alone) is refused. Wherever it renders, it
    renders as Qwen3's."""
    loop = "{%- for message in messages %}\n"  # the forward loop, after the search for the last query
    assert qwen3_template.count(loop) == 1
    guard = ("{%- if ns.multi_step_tool %}\n    {{- raise_exception('No user query found in messages.') }}\n"
             "{%- endif %}\n")
    return qwen3_template.replace(loop, guard + loop)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_TMP, ignore_errors=True)
