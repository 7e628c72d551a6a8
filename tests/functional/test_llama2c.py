"""The llama2.c -> HF converter on the real stories260K checkpoint: the documented greedy
story comes out token for token, and the logits equal an independent numpy implementation
of llama2.c's own forward (interleaved rotary, read straight from the .bin)."""

import os
import re

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def stories(shared_data):
    return os.path.join(shared_data, "models", "stories260K")


@pytest.fixture(scope="module")
def converted(stories, tmp_path_factory):
    from posttrain.convert.llama2c import main

    out = tmp_path_factory.mktemp("conv") / "stories260K-hf"
    main(["--model", os.path.join(stories, "stories260K.bin"),
          "--tokenizer", os.path.join(stories, "tok512.model"), "--output", str(out)])
    return str(out)


def _documented_story(stories: str) -> str:
    text = open(os.path.join(stories, "stories260K.md")).read()
    block = re.search(r"\$ \./run stories260K/stories260K\.bin -z stories260K/tok512\.bin -t 0\.0\n(.*?)\n```", text, re.S)
    assert block, "the documented greedy sample was not found in stories260K.md"
    return block.group(1)


def test_greedy_story_matches_documentation(stories, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    expected = _documented_story(stories)
    expected_ids = tok(expected)["input_ids"]  # BOS + story
    assert expected_ids[0] == 1 and len(expected_ids) > 200
    with torch.no_grad():
        out = model.generate(torch.tensor([[1]]), max_new_tokens=len(expected_ids) - 1, do_sample=False)
    ids = out[0].tolist()
    assert ids == expected_ids  # token for token
    assert tok.decode(ids, skip_special_tokens=True) == expected


def test_tokenizer_round_trips_and_stop_tokens(converted):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(converted)
    text = 'Tom said, "Look!"\nThe cat ran 12 times.'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1 and len(ids) > 5
    assert len(set(ids)) > 5  # not the empty tokenizer that encodes everything to [1]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (2, 0, 512)
    # The plain template: BOS + contents, tokenized exactly like the text itself.
    chat = tok.apply_chat_template([{"role": "user", "content": "Once upon"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s> Once upon"
    assert tok(chat, add_special_tokens=False)["input_ids"] == tok("Once upon")["input_ids"]
    gen = GenerationConfig.from_pretrained(converted)
    assert sorted(gen.eos_token_id) == [1, 2]  # stories end with BOS
    assert sorted(AutoConfig.from_pretrained(converted).eos_token_id) == [1, 2]


def test_generation_stops_at_the_story_ending_bos(converted):
    """The model's own greedy story (cut 20 tokens before its end) finishes with BOS (id 1),
    and `generate` stops there, well before the token limit, from the exported configs alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    story = (
        "Once upon a time, there was a cat. The cat was happy. The end.The cat liked to play with the cat. "
        "One day, the cat went to the cat and saw a big tree. The cat was very happy.\nThe cat said, "
        '"I want to play with you." The cat said, "Yes, I can help you." The cat said, "Yes, I can help you." '
        "The cat was happy.\nThe cat and the cat played together. They played together every day. "
        "The cat was happy to have a new friend. The cat was happy"
    )
    prompt = tok(story, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=60, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert new[-1] == 1 and len(new) < 60
    assert tok.decode(new, skip_special_tokens=True).endswith("They played together every day.")


def _read_bin(path):
    raw = np.fromfile(path, dtype=np.int32, count=7)
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = (int(x) for x in raw)
    shared, vocab = vocab > 0, abs(vocab)
    w = np.fromfile(path, dtype=np.float32, offset=28)
    hd = dim // heads
    names = [("emb", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
             ("wk", (layers, kv_heads * hd, dim)), ("wv", (layers, kv_heads * hd, dim)),
             ("wo", (layers, dim, dim)), ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)),
             ("w2", (layers, dim, hidden)), ("w3", (layers, hidden, dim)), ("rms_final", (dim,)),
             ("fcr", (seq_len, hd // 2)), ("fci", (seq_len, hd // 2))] + ([] if shared else [("wcls", (vocab, dim))])
    p, out = 0, {}
    for name, shape in names:
        n = int(np.prod(shape))
        out[name] = w[p:p + n].reshape(shape).astype(np.float64)
        p += n
    assert p == w.size
    out.setdefault("wcls", out["emb"])
    return (layers, heads, kv_heads, hd), out


def _llama2c_forward(path, tokens):
    """llama2.c's run.c forward in float64 numpy: interleaved-pair rotary from the stored freq_cis."""
    (layers, heads, kv_heads, hd), W = _read_bin(path)

    def rmsnorm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rope(x, T):  # x [T, h, hd], rotate pairs (2i, 2i+1)
        re_, im_ = W["fcr"][:T, None, :], W["fci"][:T, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * re_ - x1 * im_
        out[..., 1::2] = x0 * im_ + x1 * re_
        return out

    T = len(tokens)
    x = W["emb"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(layers):
        h = rmsnorm(x, W["rms_att"][l])
        q = rope((h @ W["wq"][l].T).reshape(T, heads, hd), T)
        k = rope((h @ W["wk"][l].T).reshape(T, kv_heads, hd), T)
        v = (h @ W["wv"][l].T).reshape(T, kv_heads, hd)
        rep = heads // kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, heads * hd)
        x = x + o @ W["wo"][l].T
        h = rmsnorm(x, W["rms_ffn"][l])
        a, b = h @ W["w1"][l].T, h @ W["w3"][l].T
        x = x + ((a / (1 + np.exp(-a))) * b) @ W["w2"][l].T
    return rmsnorm(x, W["rms_final"]) @ W["wcls"].T


def test_logits_match_independent_llama2c_forward(stories, converted):
    from transformers import AutoModelForCausalLM

    tokens = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315]
    ref = _llama2c_forward(os.path.join(stories, "stories260K.bin"), tokens)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():
        got = model(torch.tensor([tokens])).logits[0].double().numpy()
    assert got.shape == ref.shape == (len(tokens), 512)
    assert np.abs(got - ref).max() < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_converter_rejects_a_truncated_file(tmp_path, stories):
    from posttrain.convert.llama2c import convert

    bad = tmp_path / "bad.bin"
    bad.write_bytes(open(os.path.join(stories, "stories260K.bin"), "rb").read()[:5000])
    with pytest.raises(ValueError, match=r"bad.bin: holds 4972 bytes after the header.* implies 264128 fp32"):
        convert(bad, os.path.join(stories, "tok512.model"), tmp_path / "out")
    # Cut mid-value (a partial download): named the same way, not numpy's "buffer size must be a
    # multiple of element size".
    bad.write_bytes(open(os.path.join(stories, "stories260K.bin"), "rb").read()[:5001])
    with pytest.raises(ValueError, match=r"bad.bin: holds 4973 bytes after the header.* implies 264128 fp32"):
        convert(bad, os.path.join(stories, "tok512.model"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # export.py --version 1 (its header: magic, version, then the 7 ints): named, with the way out.
    versioned = tmp_path / "v1.bin"
    versioned.write_bytes(np.array([0x616B3432, 1, 64, 172, 5, 8, 4, 512, 512], dtype=np.uint32).tobytes()
                          + bytes(4096))
    with pytest.raises(ValueError, match=r"v1.bin: a llama2.c version-1 export .* export.py --version 0"):
        convert(versioned, os.path.join(stories, "tok512.model"), tmp_path / "out")
    # An odd head size has no rotary pairs to permute: refused with the header.
    odd = tmp_path / "odd.bin"
    _write_random_llama2c(odd, dim=12, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"odd.bin: implausible llama2.c header .*even head size"):
        convert(odd, os.path.join(stories, "tok512.model"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _write_random_llama2c(path, dim=16, hidden=40, layers=2, heads=4, kv_heads=2, vocab=512, seq_len=32):
    """A random llama2.c file with a separate classifier (negative vocab_size in the header)."""
    rng = np.random.default_rng(0)
    hd = dim // heads
    shapes = [(vocab, dim), (layers, dim), (layers, dim, dim), (layers, kv_heads * hd, dim),
              (layers, kv_heads * hd, dim), (layers, dim, dim), (layers, dim), (layers, hidden, dim),
              (layers, dim, hidden), (layers, hidden, dim), (dim,)]
    tensors = [rng.normal(0, 0.3, s).astype(np.float32) for s in shapes]
    freqs = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(seq_len), freqs)
    tensors += [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    tensors.append(rng.normal(0, 0.3, (vocab, dim)).astype(np.float32))  # wcls
    with open(path, "wb") as f:
        f.write(np.array([dim, hidden, layers, heads, kv_heads, -vocab, seq_len], dtype=np.int32).tobytes())
        for t in tensors:
            f.write(t.tobytes())


def test_untied_classifier_and_other_shapes_match_reference(stories, tmp_path):
    """Separate classifier (vocab_size < 0 in the header) and another head layout."""
    from transformers import AutoModelForCausalLM

    from posttrain.convert.llama2c import convert

    bin_path = tmp_path / "random.bin"
    _write_random_llama2c(bin_path)
    out = convert(bin_path, os.path.join(stories, "tok512.model"), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not model.config.tie_word_embeddings
    tokens = [1, 5, 300, 42, 7, 511, 2, 99]
    ref = _llama2c_forward(bin_path, tokens)
    with torch.no_grad():
        got = model(torch.tensor([tokens])).logits[0].double().numpy()
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
