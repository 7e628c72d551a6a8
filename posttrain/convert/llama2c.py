"""Convert a llama2.c checkpoint (`.bin`) and its sentencepiece tokenizer to a Hugging Face
`LlamaForCausalLM` folder (safetensors) that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load.

The llama2.c file format (Karpathy's `export.py`, legacy version 0):
    header: 7 int32 = dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
            (a negative vocab_size means the classifier is stored separately at the end)
    fp32 weights, each tensor for all layers at once, row-major with torch's Linear layout
    ([out_features, in_features]):
        token_embedding [V, D], rms_att [L, D], wq [L, D, D], wk [L, KV*Hd, D],
        wv [L, KV*Hd, D], wo [L, D, D], rms_ffn [L, D], w1 [L, F, D], w2 [L, D, F],
        w3 [L, F, D], rms_final [D], freq_cis_real [T, Hd/2], freq_cis_imag [T, Hd/2],
        (wcls [V, D] only when vocab_size < 0)

Rotary layout. llama2.c (like Meta's original Llama) rotates interleaved pairs (x0, x1),
(x2, x3), ... of each head, while transformers' Llama rotates the two halves of the head
(x_i, x_{i+Hd/2}). Permuting the output rows of wq and wk per head, exactly as
transformers' own `convert_llama_weights_to_hf.py` does, makes the two forwards identical:
row 2i of a head moves to row i and row 2i+1 to row i + Hd/2.

Stopping. stories260K-style models (trained on TinyStories with llama2.c) end a story with
BOS (id 1), never EOS (id 2): llama2.c's `run.c` stops on BOS. The exported `config.json`
and `generation_config.json` therefore list both ids as `eos_token_id` ([2, 1]), so HF
`generate` and posttrain's generation backends (which stop on the model config's EOS ids)
end a story where llama2.c does. The tokenizer's own `eos_token` stays `</s>` (id 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posttrain.config import InputError, MissingInputError
from posttrain.convert.output import check_replaceable, writing_folder

HEADER_INTS = 7
# llama2.c's export.py --version 1 / 2 (fp32 / int8) files start with uint32 0x616b3432 ("ak42").
VERSIONED_MAGIC = (0x616B3432).to_bytes(4, "little")
# Tokens of a llama2.c sentencepiece vocabulary (`llama2.c/tokenizer.py` trains with these ids).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# The tokenizer has no pad token; <unk> (id 0) pads because byte fallback means it never
# occurs in encoded text, so a pad can never be mistaken for a real token.
PAD_ID = UNK_ID
# A plain-text chat template: these are text completers, a conversation is BOS then its
# contents in order (llama2.c trained every story after a BOS; without it the model is lost).
# The space after BOS stands for sentencepiece's dummy prefix: "<s> Once" tokenizes as
# [BOS, "▁Once"], exactly like encoding "Once" with special tokens, while "<s>Once" would not.
PLAIN_CHAT_TEMPLATE = "{{ bos_token }} {% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def read_llama2c(bin_path: str | os.PathLike) -> tuple[Llama2cHeader, dict[str, np.ndarray]]:
    """Read a llama2.c `.bin` into its header and named fp32 arrays (llama2.c's own layout).

    Arrays: `token_embedding [V, D]`, per layer stacked on dim 0: `rms_att [L, D]`,
    `wq [L, D, D]`, `wk/wv [L, KV*Hd, D]`, `wo [L, D, D]`, `rms_ffn [L, D]`, `w1/w3 [L, F, D]`,
    `w2 [L, D, F]`; `rms_final [D]`; `wcls [V, D]` (the embedding when shared).
    The rotary tables are checked for size and dropped (transformers recomputes them).
    """
    path = Path(bin_path)
    if not path.is_file():
        raise MissingInputError(f"llama2.c checkpoint not found: {path}")
    raw = path.read_bytes()
    if len(raw) < HEADER_INTS * 4:
        raise InputError(f"{path}: {len(raw)} bytes is too short for the 7-int32 llama2.c header")
    if raw[:4] == VERSIONED_MAGIC:
        version = int(np.frombuffer(raw, np.int32, 1, offset=4)[0])
        raise InputError(f"{path}: a llama2.c version-{version} export (export.py --version {version}, header "
                         "magic 'ak42'); this converter reads the legacy format: re-export the model with "
                         "`python export.py --version 0`")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = (int(x) for x in np.frombuffer(raw, np.int32, HEADER_INTS))
    hdr = Llama2cHeader(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len, shared_classifier=vocab > 0)
    if (min(dim, hidden, n_layers, n_heads, n_kv, hdr.vocab_size, seq_len) <= 0 or dim % n_heads or n_heads % n_kv
            or hdr.head_dim % 2):
        raise InputError(
            f"{path}: implausible llama2.c header {hdr} (is this a llama2.c legacy-format .bin? "
            "dim must divide by n_heads into an even head size (rotary pairs), and n_heads by n_kv_heads)"
        )
    D, F, L, V, T, Hd = dim, hidden, n_layers, hdr.vocab_size, seq_len, hdr.head_dim
    kv_dim = n_kv * Hd
    shapes = [
        ("token_embedding", (V, D)),
        ("rms_att", (L, D)),
        ("wq", (L, D, D)),
        ("wk", (L, kv_dim, D)),
        ("wv", (L, kv_dim, D)),
        ("wo", (L, D, D)),
        ("rms_ffn", (L, D)),
        ("w1", (L, F, D)),
        ("w2", (L, D, F)),
        ("w3", (L, F, D)),
        ("rms_final", (D,)),
        ("freq_cis_real", (T, Hd // 2)),
        ("freq_cis_imag", (T, Hd // 2)),
    ]
    if not hdr.shared_classifier:
        shapes.append(("wcls", (V, D)))
    expected = sum(int(np.prod(s)) for _, s in shapes)
    # In bytes: a file cut mid-value (a partial download) is not a whole number of fp32 values.
    payload = len(raw) - HEADER_INTS * 4
    if payload != 4 * expected:
        raise InputError(
            f"{path}: holds {payload} bytes after the header, the header {hdr} implies {expected} fp32 values "
            f"({4 * expected} bytes): a file cut short or not this model's"
        )
    floats = np.frombuffer(raw, np.float32, offset=HEADER_INTS * 4)
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = floats[pos : pos + n].reshape(shape).copy()
        pos += n
    del arrays["freq_cis_real"], arrays["freq_cis_imag"]
    if hdr.shared_classifier:
        arrays["wcls"] = arrays["token_embedding"]
    return hdr, arrays


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the output rows of a q/k projection from interleaved to half-split rotary pairs.

    w: [n_heads * Hd, D] -> [n_heads * Hd, D]; within each head, row 2i -> i, 2i+1 -> i + Hd/2.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_state_dict(hdr: Llama2cHeader, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map llama2.c arrays to transformers' `LlamaForCausalLM` parameter names (tied lm_head omitted)."""
    sd = {
        "model.embed_tokens.weight": arrays["token_embedding"],
        "model.norm.weight": arrays["rms_final"],
    }
    for i in range(hdr.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        sd[p + "self_attn.q_proj.weight"] = permute_rotary(arrays["wq"][i], hdr.n_heads)
        sd[p + "self_attn.k_proj.weight"] = permute_rotary(arrays["wk"][i], hdr.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        sd[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        # llama2.c FFN: w2(silu(w1 x) * w3 x) = down(silu(gate x) * up x).
        sd[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        sd[p + "mlp.up_proj.weight"] = arrays["w3"][i]
        sd[p + "mlp.down_proj.weight"] = arrays["w2"][i]
    if not hdr.shared_classifier:
        sd["lm_head.weight"] = arrays["wcls"]
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def _read_sentencepiece(tokenizer_model_path: Path, vocab_size: int):
    """The sentencepiece model at `tokenizer_model_path`, checked against the llama2.c model's
    vocabulary and llama2.c's special ids before anything is written."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model_path))
    except (RuntimeError, OSError) as e:
        # Without this, transformers goes on to read the file as a tiktoken BPE and fails
        # asking for tiktoken. tok512.bin, llama2.c's binary form, sits beside tok512.model.
        raise InputError(f"{tokenizer_model_path}: not a sentencepiece model (the .model file, e.g. tok512.model; "
                         f"{e})") from None
    if sp.vocab_size() != vocab_size:
        raise InputError(
            f"{tokenizer_model_path}: sentencepiece vocab {sp.vocab_size()} != model vocab_size {vocab_size}"
        )
    if (sp.unk_id(), sp.bos_id(), sp.eos_id()) != (UNK_ID, BOS_ID, EOS_ID):
        raise InputError(
            f"{tokenizer_model_path}: special ids unk/bos/eos = {sp.unk_id()}/{sp.bos_id()}/{sp.eos_id()}, "
            f"expected {UNK_ID}/{BOS_ID}/{EOS_ID} (llama2.c's sentencepiece recipe)"
        )
    return sp


def _build_tokenizer(tokenizer_model_path: Path, out_dir: Path, sp):
    """Write `tokenizer.model` + config into out_dir, load it with AutoTokenizer and check it
    against `sp`, the same model read by sentencepiece itself."""
    from transformers import AutoTokenizer

    shutil.copyfile(tokenizer_model_path, out_dir / "tokenizer.model")
    os.chmod(out_dir / "tokenizer.model", 0o644)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 1_000_000,
            },
            indent=2,
        )
    )
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    _check_tokenizer(tok, tokenizer_model_path, sp)
    return tok


def _check_tokenizer(tok, tokenizer_model_path: Path, sp) -> None:
    """Fail loud if the HF tokenizer disagrees with sentencepiece itself (transformers 5.x can
    silently build an empty tokenizer that encodes every text to [BOS])."""
    probe = 'Once upon a time, there was a little girl named Lily.\nShe said, "Hi! 123"'
    ids = tok(probe, add_special_tokens=False)["input_ids"]
    if ids != sp.encode(probe) or tok.decode(ids) != probe:
        raise RuntimeError(
            f"the Hugging Face tokenizer built from {tokenizer_model_path} does not match sentencepiece "
            f"(hf ids {ids[:12]}..., sentencepiece {sp.encode(probe)[:12]}...): is `sentencepiece` installed?"
        )


def convert(bin_path: str | os.PathLike, tokenizer_model_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert llama2.c `bin_path` + sentencepiece `tokenizer_model_path` into an HF folder.

    Writes `model.safetensors`, `config.json` and `generation_config.json` (eos = [EOS, BOS])
    and the tokenizer files into `out_dir` atomically (a temp folder renamed into place; an
    existing `out_dir` is replaced when it is empty or a model folder, one with a config.json,
    and refused otherwise). Returns the folder path.
    """
    tok_path = Path(tokenizer_model_path)
    if not tok_path.is_file():
        raise MissingInputError(f"sentencepiece tokenizer model not found: {tok_path}")
    out = Path(out_dir)
    check_replaceable(out, {"--model": bin_path, "--tokenizer": tok_path})
    hdr, arrays = read_llama2c(bin_path)
    sp = _read_sentencepiece(tok_path, hdr.vocab_size)
    # Imported once the inputs are read: a wrong one fails before their ~7 s.
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    with writing_folder(out) as tmp:
        config = LlamaConfig(
            vocab_size=hdr.vocab_size,
            hidden_size=hdr.dim,
            intermediate_size=hdr.hidden_dim,
            num_hidden_layers=hdr.n_layers,
            num_attention_heads=hdr.n_heads,
            num_key_value_heads=hdr.n_kv_heads,
            max_position_embeddings=hdr.seq_len,
            rms_norm_eps=1e-5,  # llama2.c's RMSNorm epsilon
            rope_theta=10000.0,  # llama2.c's rotary base (its freq_cis tables use it)
            tie_word_embeddings=hdr.shared_classifier,
            bos_token_id=BOS_ID,
            eos_token_id=[EOS_ID, BOS_ID],
            pad_token_id=PAD_ID,
            dtype="float32",
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(hdr, arrays).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        allowed_missing = {"lm_head.weight"} if hdr.shared_classifier else set()
        if set(missing) - allowed_missing or unexpected:
            raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
        if hdr.shared_classifier:
            model.tie_weights()
        # Rotary buffers were created on the meta device; rebuild them on CPU.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=[EOS_ID, BOS_ID], pad_token_id=PAD_ID, do_sample=False
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tok = _build_tokenizer(tok_path, tmp, sp)
        tok.save_pretrained(tmp)
    return out


def main(args: argparse.Namespace | list[str] | None = None) -> Path:
    """CLI: `posttrain convert llama2c-to-hf --model X.bin --tokenizer tok.model --output DIR`.

    `args` is the namespace `posttrain.cli` already parsed, or an argv list (None: sys.argv).
    """
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="posttrain convert llama2c-to-hf", description=__doc__.split("\n\n")[0])
        parser.add_argument("--model", required=True, help="llama2.c checkpoint (.bin, legacy format)")
        parser.add_argument("--tokenizer", required=True, help="its sentencepiece tokenizer (.model)")
        parser.add_argument("--output", required=True, help="output folder (a model folder there is replaced)")
        args = parser.parse_args(args)
    out = convert(args.model, args.tokenizer, args.output)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
