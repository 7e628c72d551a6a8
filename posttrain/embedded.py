"""The embedded default assets: a character-level tokenizer with a chat template and tiny
Llama-architecture causal LMs, made by posttrain itself so that nothing is downloaded.

`model_name: embedded:<size>` anywhere a model path is accepted resolves to a folder that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load like any
other checkpoint. The folder is written once (atomically) under `$POSTTRAIN_CACHE`
(default `~/.cache/posttrain`) from a fixed seed, so every process and every machine gets
the same randomly initialised weights.

How they are made:
- Tokenizer: one token per character of a fixed alphabet (digits, ASCII letters,
  punctuation, space, newline) plus the specials `<pad> <s> </s> <unk>` and the chat-role
  markers `<|system|> <|user|> <|assistant|> <|end|>`. Chat template:
  `<|role|>content<|end|>` per message, `<|assistant|>` as the generation prompt; `<|end|>`
  is the EOS token, so an assistant turn ends where its message ends. An assistant message's
  `tool_calls` follow its content as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
- Models: `LlamaConfig` with the sizes in `MODEL_SIZES`, initialised by transformers'
  own init under `torch.manual_seed(0)`; untrained (the quickstart warm-starts them with
  a short SFT on the task's reference answers before GRPO).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
# Bump when the recipe changes so cached folders are rebuilt (v2: small's 1024 positions; v3: the
# chat template writes structured tool calls; v4: tiny's 512 positions; v5: a newline in a run of
# them is a token, not the run one <unk>).
_VERSION = "v5"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ALPHABET = string.digits + "+-*/=()., ?!:;'\"\n" + string.ascii_letters + "#<>[]{}_|\\@$%^&~`"
# An assistant message's structured `tool_calls` (OpenAI form, as SFT data has them) are written
# after its content in the Hermes format the tool environments read: <tool_call>{json}</tool_call>.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% for c in (m['tool_calls'] if m['tool_calls'] is defined and m['tool_calls'] else []) %}"
    "{{ '<tool_call>' + {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson"
    " + '</tool_call>' }}{% endfor %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, intermediate, max_positions)
MODEL_SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    # ~0.1M params: unit tests, and the model of the schema defaults (policy.max_total_sequence_length
    # 512, which 256 positions warned about).
    "tiny": (64, 2, 4, 2, 176, 512),
    # ~0.75M params: the quickstart. 1024 positions for the sliding puzzle's multi-turn games
    # (RoPE: the weights are those of 256 positions, which v1 had).
    "small": (128, 4, 4, 2, 352, 1024),
    "medium": (256, 4, 8, 4, 688, 256),  # ~2.7M params
    "1m": (160, 4, 4, 4, 448, 512),  # ~1.2M params: benchmarks
    "30m": (512, 9, 8, 8, 1536, 512),  # ~31M params: benchmarks
}


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def build_tokenizer():
    """The character-level tokenizer as a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One piece per character: "." matches no newline, which left a run of them ("\n\n", a
    # paragraph break) one piece that is no token (<unk>).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(size: str = "tiny", vocab_size: int | None = None):
    """A freshly initialised `LlamaForCausalLM` of one of `MODEL_SIZES` (deterministic)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; valid: {', '.join(MODEL_SIZES)}")
    hidden, layers, heads, kv_heads, inter, max_pos = MODEL_SIZES[size]
    tok_vocab = len(SPECIAL_TOKENS) + len(ALPHABET)
    config = LlamaConfig(
        vocab_size=vocab_size or tok_vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("<|end|>"),
        initializer_range=0.02,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model


# What a complete folder of an embedded model holds (a folder without them is a leftover).
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def materialize(size: str) -> Path:
    """Write (once) and return the folder of embedded model `size` with its tokenizer.

    Processes that start at once (the ranks of a job, test workers) build it once: the first
    holds a lock file while it writes into a temporary folder and renames it into place. A
    folder that lacks a model file (seen once, a tokenizer-only folder from an interrupted
    build) is built again instead of failing every later run."""
    import fcntl

    if size not in MODEL_SIZES:
        from posttrain.config import InputError  # an InputError: the command prints it without a traceback

        raise InputError(f"unknown embedded model {EMBEDDED_PREFIX}{size}; valid: "
                         + ", ".join(EMBEDDED_PREFIX + s for s in MODEL_SIZES))
    target = cache_root() / "embedded" / f"{size}-{_VERSION}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _complete(target):  # built by the process that held the lock before
            return target
        if target.exists():
            logging.getLogger(__name__).warning("rebuilding %s: the folder lacks %s", target,
                                                ", ".join(f for f in _MODEL_FILES if not (target / f).is_file()))
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=target.parent))
        try:
            build_model(size).save_pretrained(tmp)
            build_tokenizer().save_pretrained(tmp)
            if not _complete(tmp):  # transformers saves no model on a rank other than 0 of a process group
                raise RuntimeError(f"{EMBEDDED_PREFIX}{size} could not be written to {target} from this process (it "
                                   f"holds {sorted(p.name for p in tmp.iterdir())}): build it before starting "
                                   "torch.distributed, or on its rank 0")
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _MODEL_FILES)


def resolve_model_path(name: str) -> str:
    """Map `embedded:<size>` to its folder; any other name is returned unchanged. A name that is
    no local folder is a hub id: see `offline_if_hub_unreachable`."""
    if name.startswith(EMBEDDED_PREFIX):
        return str(materialize(name[len(EMBEDDED_PREFIX):]))
    if not os.path.exists(os.path.expanduser(name)):
        offline_if_hub_unreachable()
    return name


# Files from which AutoTokenizer tells a folder's tokenizer class (or reads the tokenizer whole).
_TOKENIZER_CLASS_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")
# Files of which a tokenizer is read: without any, a folder holds a model without its tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tiktoken.model")
_HUB_OFFLINE_NOTE = ("the Hugging Face hub is unreachable from here, so models and datasets load offline: "
                     "HF_HUB_OFFLINE=1")


@functools.cache
def offline_if_hub_unreachable() -> bool:
    """Switch huggingface_hub to offline mode when its endpoint cannot be reached; True if it did.

    Without it, every hub id on a machine without internet (most cluster compute nodes, and
    this project's CI) costs ~50 s of huggingface_hub's connection retries before transformers
    falls back to the local cache or fails (a hub dataset's name ~25 s of `datasets`' retries), and a mistyped relative folder such as
    `results/my-model` reads as a hub id. Offline, a cached model loads at once and a missing
    one fails at once. The environment variable reaches the Ray workers started afterwards.
    Behind a proxy the direct probe says nothing, so it is skipped."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        return False
    except OSError:
        pass
    import huggingface_hub.constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True  # read at import: set it for this process too
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:  # `datasets` keeps its own copy, also read at import
        datasets_config.HF_HUB_OFFLINE = True
    logging.getLogger(__name__).info(_HUB_OFFLINE_NOTE)
    return True


def check_local_model(key: str, name: str, what: str = "a model") -> None:
    """Raise the error loading would, naming config `key`, when the model `name` is a local path
    (absolute, ./ or ~) that is not there. The `posttrain` command checks this before the run
    imports torch and transformers, where loading its tokenizer or config failed after ~6 s."""
    if _is_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise model_load_error(key, name, name, what, FileNotFoundError(name))


def _is_local_path(name: str) -> bool:
    """Whether a model name is written as a local path (absolute, ./ or ~), not a hub id or `embedded:`."""
    return os.path.isabs(name) or name.startswith((".", "~"))


def model_load_error(key: str, name: str, path: str, what: str, error: Exception):
    """The `MissingInputError` for `what` ("a model config", "a tokenizer") that transformers could
    not load from `path` (config key `key` = `name`): a local path that does not exist says so,
    rather than transformers' complaint that it is not a valid hub repo id."""
    from posttrain.config import MissingInputError

    from posttrain.checkpoint import EXPORT_DIR, complete_checkpoints, policy_checkpoint_dir

    local = _is_local_path(path)
    # A run's checkpointing.checkpoint_dir, named instead of one of its step_N checkpoints.
    inside = complete_checkpoints(os.path.expanduser(path))
    if local and not os.path.exists(os.path.expanduser(path)):
        reason = "no such folder"
    elif policy_checkpoint_dir(os.path.expanduser(path)) is not None or inside:
        checkpoint = inside[-1] if inside else path
        held = f"a folder of posttrain checkpoints ({', '.join(p.name for p in inside)})" if inside else \
            "a posttrain checkpoint"
        reason = (f"{held}, not a Hugging Face model folder; convert it with `posttrain convert "
                  f"dcp-to-hf --checkpoint {checkpoint} --output <folder>` and name that folder")
    elif any(os.path.isfile(os.path.join(os.path.expanduser(path), EXPORT_DIR, f))
             for f in ("config.json", "adapter_config.json")):
        # A run's folder (logger.log_dir), named instead of its final export (policy.lora.export=adapter:
        # an adapter, which loads as its base + adapter).
        reason = (f"a run's folder, not a Hugging Face model folder; its final export is "
                  f"{os.path.join(path, EXPORT_DIR)}: name that")
    elif os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json")):
        reason = ("a LoRA adapter (adapter_config.json), not a whole model; export the run with "
                  "policy.lora.export=merged, or convert its checkpoint with `posttrain convert dcp-to-hf` "
                  "(which merges the adapter), and name that folder")
    elif not os.path.exists(os.path.expanduser(path)) and offline_if_hub_unreachable():
        reason = f"no such folder under {os.getcwd()}, nor in the local Hugging Face cache; {_HUB_OFFLINE_NOTE}"
    elif what == "a tokenizer" and os.path.isdir(os.path.expanduser(path)) and not any(
            os.path.isfile(os.path.join(os.path.expanduser(path), f)) for f in _TOKENIZER_CLASS_FILES):
        # transformers then fails with "Couldn't instantiate the backend tokenizer ... install
        # sentencepiece or tiktoken", which neither says what is missing nor helps.
        held = ", ".join(sorted(os.listdir(os.path.expanduser(path)))) or "nothing"
        reason = (f"it holds {held} but no {' or '.join(_TOKENIZER_CLASS_FILES)}, which tell transformers the "
                  "tokenizer's class: beside GPT-2's vocab.json and merges.txt, write a tokenizer_config.json of "
                  '{"tokenizer_class": "GPT2Tokenizer"}')
    elif what == "a tokenizer" and os.path.isdir(os.path.expanduser(path)) and not any(
            os.path.isfile(os.path.join(os.path.expanduser(path), f)) for f in _TOKENIZER_FILES):
        # A model saved without its tokenizer (model.save_pretrained alone): transformers' message
        # ends in a colon after its first line and names no file.
        held = ", ".join(sorted(os.listdir(os.path.expanduser(path))))
        fix = "set policy.tokenizer.name to" if key.startswith("policy.") else "name"
        reason = (f"it holds {held} but no tokenizer files ({', '.join(_TOKENIZER_FILES)}): a model saved "
                  f"without its tokenizer; {fix} the folder or hub id of the tokenizer it was trained with, or "
                  "save that tokenizer into this folder (tokenizer.save_pretrained)")
    else:
        # transformers' messages run over several lines ("Couldn't instantiate the backend tokenizer
        # from one of:" and a list): all of it, on one line.
        reason = " ".join(str(error).split())[:600] or type(error).__name__
    where = "local folder" if local else "hub id or folder"
    return MissingInputError(f"{key}={name!r}: cannot load {what} from this {where} ({path}): {reason}")
