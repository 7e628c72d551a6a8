"""Tokenization: assistant-only loss masks, chat-template override, truncation, batches."""

import json
import logging
from pathlib import Path

import pytest
import torch

from posttrain.config import InputError
from posttrain.data.datasets import load_rows
from posttrain.data.processors import (
    collate,
    collate_pairs,
    decode_all,
    encode_text,
    load_tokenizer,
    process_preference_rows,
    process_sft_rows,
    tokenize_messages,
)
from posttrain.rollouts import render_prompt
from posttrain.schemas import DataConfig, TokenizerConfig

# NeMo RL's SQuAD SFT template (examples/configs/sft.yaml there): plain text, no header tokens.
SQUAD_TEMPLATE = (
    "{% for message in messages %}{%- if message['role'] == 'system' %}{{'Context: ' + message['content'].strip()}}"
    "{%- elif message['role'] == 'user' %}{{' Question: ' + message['content'].strip() + ' Answer:'}}"
    "{%- elif message['role'] == 'assistant' %}{{' ' + message['content'].strip()}}{%- endif %}{% endfor %}"
)
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return load_tokenizer(TokenizerConfig(name=tiny_model_path))


def _gpt2_bpe(shared_data, **tokens):
    """GPT-2's byte-level BPE (vocab.json and merges.txt of the shared data) with `tokens` (bos_token=...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = f"{shared_data}/tokenizers/gpt2"
    core = Tokenizer(models.BPE.from_file(f"{d}/vocab.json", f"{d}/merges.txt"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, **tokens)


@pytest.fixture(scope="module")
def gpt2(shared_data):
    t = _gpt2_bpe(shared_data, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    t.chat_template = SQUAD_TEMPLATE
    return t


# Qwen3's chat template (Qwen/Qwen3-*'s tokenizer_config.json, as huggingface/trl keeps it in
# trl/chat_templates/qwen3.jinja; both Apache-2.0), kept as test data.
QWEN3_TEMPLATE = (Path(__file__).parents[1] / "data" / "qwen3_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def qwen3_tok(shared_data):
    """A stand-in for Qwen3's tokenizer: byte-level BPE with its ChatML tokens (<|im_end|> its EOS, no
    BOS) and <think>/</think> as single tokens, with Qwen3's own chat template."""
    t = _gpt2_bpe(shared_data, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  additional_special_tokens=["<|im_start|>"])
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = QWEN3_TEMPLATE
    return t



@pytest.fixture(scope="module")
def qwen3_2507_tok(shared_data, qwen3_2507_like_template):
    """`qwen3_tok` with the template of Qwen3's later releases, which refuses a conversation without a
    user message (`qwen3_2507_like_template`)."""
    t = _gpt2_bpe(shared_data, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  additional_special_tokens=["<|im_start|>"])
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = qwen3_2507_like_template
    return t


@pytest.mark.parametrize("which", ["embedded", "qwen3_like", "cleanup"])
def test_decode_all_is_batch_decode_without_special_tokens(which, tok, qwen3_tok, shared_data):
    """The rollouts' decoding of completions (the Rust tokenizer's own when transformers adds
    nothing to it) gives batch_decode's texts: special and added tokens dropped, none kept."""
    t = {"embedded": tok, "qwen3_like": qwen3_tok,
         "cleanup": _gpt2_bpe(shared_data, eos_token="<|endoftext|>", clean_up_tokenization_spaces=True)}[which]
    texts = ["12+34=046", "Hello , world ! <think>why</think> do n't", "  two  spaces\nand a line"]
    rows = [t.encode(x, add_special_tokens=False) + [t.eos_token_id] for x in texts] + [[], [t.eos_token_id]]
    want = t.batch_decode(rows, skip_special_tokens=True)
    assert decode_all(t, rows) == want
    assert want[-2:] == ["", ""] and not any(t.eos_token in w for w in want)


@pytest.mark.parametrize("which", ["embedded", "qwen3_like", "split_special", "truncating", "stories260k"])
def test_encode_text_is_encode_without_special_tokens(which, tok, qwen3_tok, shared_data, stories260k):
    """Rows and prompts are tokenized through the Rust tokenizer where transformers adds nothing:
    the ids are `encode(text, add_special_tokens=False)`'s, added and special tokens in the text
    included; a tokenizer that splits special tokens keeps its behaviour, and a backend set to
    truncate goes through transformers, which encodes the whole text."""
    from transformers import AutoTokenizer

    if which == "split_special":
        t = _gpt2_bpe(shared_data, eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
        t.split_special_tokens = True  # set after loading: the backend learns it at transformers' next encode
    elif which == "truncating":
        t = _gpt2_bpe(shared_data, eos_token="<|endoftext|>")
        t.backend_tokenizer.enable_truncation(max_length=4)
    else:
        t = {"embedded": tok, "qwen3_like": qwen3_tok}.get(which) or AutoTokenizer.from_pretrained(stories260k)
    texts = ["12+34=046", "<|im_start|>user\nHi<|im_end|> <think>why</think>", "  two  spaces\nand a line", "\n",
             "Once upon a time, Lily said: caf\u00e9 \u2603", ""]
    if which == "split_special":  # the special token's text is encoded as text, in pieces
        assert len(encode_text(t, "<|im_start|>")) > 1
    for x in texts:
        got = encode_text(t, x)  # first: transformers' encode turns a backend's truncation off
        assert got == t.encode(x, add_special_tokens=False), x


def _loss_text(tok, ex):
    return tok.decode([i for i, m in zip(ex["input_ids"], ex["loss_mask"]) if m])


def test_assistant_only_mask_embedded_template(tok):
    ex = tokenize_messages(CONVO, tok)
    assert tok.decode(ex["input_ids"]) == (
        "<s><|system|>Be brief.<|end|><|user|>1+1?<|end|><|assistant|>2<|end|><|user|>2+2?<|end|><|assistant|>4<|end|>"
    )
    # Content and end-of-turn of both assistant turns, not the <|assistant|> header.
    assert _loss_text(tok, ex) == "2<|end|>4<|end|>"
    assert len(ex["input_ids"]) == len(ex["loss_mask"])
    # The template ends with EOS (<|end|>) already: add_eos adds nothing.
    assert ex["input_ids"][-2:] != [tok.eos_token_id] * 2
    # loss_start: only assistant turns from that message on (a preference prompt's turns are context).
    assert _loss_text(tok, tokenize_messages(CONVO, tok, loss_start=3)) == "4<|end|>"
    no_bos = tokenize_messages(CONVO, tok, add_bos=False)
    assert no_bos["input_ids"] == ex["input_ids"][1:]


def test_assistant_turns_of_weight_0_and_of_a_prompt_get_no_loss(tok):
    # OpenAI fine-tuning's per-message weight was dropped (the turn trained), and a prompt/completion
    # row trained the assistant turns inside its prompt (TRL trains the completion alone).
    from posttrain.data.formats import DataFormatError, normalize_row

    weighed = normalize_row({"messages": [*CONVO[:2], {**CONVO[2], "weight": 0}, *CONVO[3:]]}, "messages", "row 1")
    split = normalize_row({"prompt": CONVO[:4], "completion": [CONVO[4]]}, "prompt_completion", "row 1")
    for row in (weighed, split):
        assert _loss_text(tok, tokenize_messages(row["messages"], tok)) == "4<|end|>"
    assert _loss_text(tok, tokenize_messages(normalize_row({"messages": [*CONVO[:4], {**CONVO[4], "weight": 1}]},
                                                           "messages", "row 1")["messages"], tok)) == "2<|end|>4<|end|>"
    with pytest.raises(DataFormatError, match=r"row 1: `messages\[2\].weight` must be 0 \(no loss\) or 1 on an "
                                              r"assistant message, got 0.5"):
        normalize_row({"messages": [*CONVO[:2], {**CONVO[2], "weight": 0.5}]}, "messages", "row 1")
    with pytest.raises(DataFormatError, match=r"row 1: `messages` has no assistant message without weight 0, so "
                                              r"nothing to train on"):
        normalize_row({"messages": [*CONVO[:2], {**CONVO[2], "weight": 0}]}, "messages", "row 1")


def test_template_ending_turns_with_eos_and_a_newline_gets_no_second_eos():
    # ChatML ("<|im_end|>\n" after every turn, <|im_end|> the EOS of Qwen's chat models): the
    # EOS appended after the newline trained "<|im_end|>\n<|im_end|>".
    from posttrain.embedded import build_tokenizer

    chatml = build_tokenizer()
    chatml.chat_template = chatml.chat_template.replace("'<|end|>'", "'<|end|>\\n'")
    ex = tokenize_messages(CONVO[1:3], chatml)
    assert chatml.decode(ex["input_ids"]) == "<s><|user|>1+1?<|end|>\n<|assistant|>2<|end|>\n"
    assert _loss_text(chatml, ex) == "2<|end|>\n"
    # A template that ends without EOS still gets one, trained with the last turn.
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] + '\\n' }}{% endfor %}"
    assert _loss_text(plain, tokenize_messages(CONVO[1:3], plain)) == "2\n<|end|>"


def test_embedded_tokenizer_has_a_token_for_each_newline_of_a_run():
    # A run of newlines (Alpaca's instruction "\n\n" input, a paragraph break) was one <unk>.
    from posttrain.embedded import build_tokenizer

    t = build_tokenizer()
    ids = t.encode("a\n\n\nb", add_special_tokens=False)
    assert ids == t.convert_tokens_to_ids(["a", "\n", "\n", "\n", "b"]) and t.decode(ids) == "a\n\n\nb"


def test_add_generation_prompt_false_trains_the_assistant_header(tok):
    # data.add_generation_prompt=false (NeMo RL's SFT meaning): the prompt ends without the
    # template's generation prompt, so the <|assistant|> header is trained with the turn.
    rows = [{"messages": CONVO}]
    (on,), _ = process_sft_rows(rows, tok, DataConfig(), max_len=100)
    (off,), _ = process_sft_rows(rows, tok, DataConfig(add_generation_prompt=False), max_len=100)
    assert on["input_ids"] == off["input_ids"]  # the same tokens, another loss mask
    assert _loss_text(tok, on) == "2<|end|>4<|end|>"
    assert _loss_text(tok, off) == "<|assistant|>2<|end|><|assistant|>4<|end|>"
    # Preference rows follow the same key (only the responses' turns train).
    pair = [{"prompt_messages": CONVO[:2], "chosen": [{"role": "assistant", "content": "2"}],
             "rejected": [{"role": "assistant", "content": "3"}]}]
    ((chosen, rejected),), _ = process_preference_rows(pair, tok, DataConfig(add_generation_prompt=False), 100)
    assert (_loss_text(tok, chosen), _loss_text(tok, rejected)) == ("<|assistant|>2<|end|>", "<|assistant|>3<|end|>")
    # A conversation that opens with the assistant's turn (ShareGPT rows starting with "gpt"): its
    # header is prompt as every other turn's is (it was trained).
    opens = [{"messages": [{"role": "assistant", "content": "Hi"}, *CONVO]}]
    (on,), _ = process_sft_rows(opens, tok, DataConfig(), max_len=100)
    assert _loss_text(tok, on) == "Hi<|end|>2<|end|>4<|end|>" and tok.decode(on["input_ids"][:2]) == "<s><|assistant|>"


def test_non_preference_rows_name_the_dataset(tok):
    # `posttrain dpo` without a config read the embedded arithmetic task and said only which keys
    # its rows had; the error names the key to set.
    rows = [{"messages": CONVO[:1], "answer": "2", "task_name": "arithmetic"}]
    with pytest.raises(InputError, match=r"data.dataset_name='arithmetic' gives rows with keys "
                                         r"\['answer', 'messages', 'task_name'\].*preference pairs"):
        process_preference_rows(rows, tok, DataConfig(dataset_name="arithmetic"), max_len=100)


def test_chat_template_override_and_eos(gpt2, shared_data):
    cfg = DataConfig(dataset_name="squad")
    examples, stats = process_sft_rows(load_rows(cfg, "train"), gpt2, cfg, max_len=1024)
    assert stats == {"rows": 7, "kept": 7, "truncated": 0, "dropped": 0, "no_loss": 0}
    text = gpt2.decode(examples[0]["input_ids"])
    assert text.startswith("<|endoftext|>Context: The Normans")  # BOS (GPT-2's is <|endoftext|>)
    loss_texts = {_loss_text(gpt2, ex) for ex in examples}
    assert " France<|endoftext|>" in loss_texts  # the answer and the appended EOS train
    assert all(t.endswith("<|endoftext|>") and "Question" not in t for t in loss_texts)


def test_load_tokenizer_applies_config_template(tiny_model_path, caplog, monkeypatch, tmp_path):
    from posttrain.data import processors

    monkeypatch.setattr(processors, "_TEMPLATE_REPLACED", set())  # another test's run warned already
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    with caplog.at_level(logging.WARNING):
        t = load_tokenizer(TokenizerConfig(name=tiny_model_path, chat_template=template), key="policy.model_name")
        load_tokenizer(TokenizerConfig(name=tiny_model_path, chat_template=template))
    assert t.apply_chat_template(CONVO[1:3], tokenize=False) == "1+1?|2|"
    # The model's own template, replaced, is said once: an SFT export's, which the run no longer trains on.
    assert caplog.text.count("policy.tokenizer.chat_template replaces the chat template of") == 1
    # This config's own export (its template with the BOS and EOS an export writes): the same template.
    from posttrain.policy.hf_io import _EOS_AFTER

    t.chat_template = "{{ bos_token }} " + template + _EOS_AFTER
    t.save_pretrained(tmp_path / "export")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_tokenizer(TokenizerConfig(name=str(tmp_path / "export"), chat_template=template), key="policy.model_name")
    assert "replaces the chat template" not in caplog.text


def test_gpt2_vocab_and_merges_folder_says_what_it_lacks(shared_data, tmp_path):
    # The shared GPT-2 folder (vocab.json, merges.txt) failed with transformers' first line,
    # "Couldn't instantiate the backend tokenizer from one of:", and nothing after it.
    import shutil

    for f in ("vocab.json", "merges.txt"):
        shutil.copy(f"{shared_data}/tokenizers/gpt2/{f}", tmp_path / f)
    with pytest.raises(InputError, match=r"it holds merges.txt, vocab.json but no tokenizer_config.json or "
                                         r"tokenizer.json or config.json.*\{\"tokenizer_class\": \"GPT2Tokenizer\"\}"):
        load_tokenizer(TokenizerConfig(name=str(tmp_path)))
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    t = load_tokenizer(TokenizerConfig(name=str(tmp_path), chat_template=SQUAD_TEMPLATE))
    assert t.encode("hello world") == [31373, 995] and t.pad_token == t.eos_token == "<|endoftext|>"


def test_no_chat_template_is_a_clear_error(gpt2):
    bare = gpt2.__class__(tokenizer_object=gpt2.backend_tokenizer, eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match="no chat template: set policy.tokenizer.chat_template"):
        tokenize_messages(CONVO, bare)
    # Plain text needs none (a base model's tokenizer, as TRL trains it on language-modeling data).
    (ex,), _ = process_sft_rows([{"text": "hello world"}], bare, DataConfig(add_bos=False), max_len=16)
    assert ex == {"input_ids": [31373, 995, 50256], "loss_mask": [1, 1, 1]}


def test_truncation_drop_and_truncate_counts(tok):
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "a" * n}]}
            for q, n in (("q", 5), ("q", 40), ("q", 60), ("q" * 40, 1))]
    # <s><|user|>q<|end|><|assistant|> = 5 prompt tokens; then the answer and <|end|>.
    kept, stats = process_sft_rows(rows, tok, DataConfig(truncation="drop"), max_len=30)
    assert stats == {"rows": 4, "kept": 1, "truncated": 0, "dropped": 3, "no_loss": 0}
    assert [len(e["input_ids"]) for e in kept] == [11]
    # Truncate: cut at 30 tokens; the long-prompt row keeps no loss token, so it goes (counted).
    kept, stats = process_sft_rows(rows, tok, DataConfig(truncation="truncate"), max_len=30)
    assert stats == {"rows": 4, "kept": 3, "truncated": 2, "dropped": 0, "no_loss": 1}
    assert [len(e["input_ids"]) for e in kept] == [11, 30, 30]
    assert [sum(e["loss_mask"]) for e in kept] == [6, 25, 25]


def test_a_row_of_exactly_the_context_length_is_kept_whole():
    from posttrain.data.processors import _fit

    row = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}
    for policy in ("drop", "truncate"):
        assert _fit(row, 4, policy) == (row, "ok")
    assert _fit(row, 3, "drop") == (None, "dropped")
    assert _fit(row, 3, "truncate") == ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}, "truncated")


def test_kto_mismatched_pairs_take_the_next_example_whose_prompt_differs():
    from posttrain.data.processors import collate_kto

    # Prompts [1, 1] and [2, 2], each with a desirable and an undesirable response side by side:
    # the plain next example was the same prompt's other response, a matched pair.
    examples = [{"input_ids": [p, p, r, r], "loss_mask": [0, 0, 1, 1], "label": [label]}
                for p, r, label in ((1, 10, 1), (1, 11, 0), (2, 20, 1), (2, 21, 0))]
    batch = collate_kto(examples, pad_id=0, max_len=8)
    assert batch["kl_input_ids"].tolist() == [[1, 1, 20, 20], [1, 1, 20, 20], [2, 2, 10, 10], [2, 2, 10, 10]]
    assert batch["kl_token_mask"].tolist() == [[0.0, 0.0, 1.0, 1.0]] * 4
    assert batch["kto_label"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_sft_on_rl_rows_trains_their_reference_answers(tok):
    # `posttrain sft` on the embedded arithmetic task (or a math file): each prompt with its
    # demonstration (else its answer) as the assistant turn, as GRPO's warm-up SFT trains.
    prompt = [{"role": "user", "content": "07+38="}]
    rows = [{"messages": prompt, "answer": "45", "demonstration": "035", "task_name": "arithmetic"},
            {"messages": prompt, "answer": "45", "task_name": "arithmetic"}]
    kept, stats = process_sft_rows(rows, tok, DataConfig(), max_len=64)
    assert stats["kept"] == 2 and [_loss_text(tok, e) for e in kept] == ["035<|end|>", "45<|end|>"]
    with pytest.raises(ValueError, match=r"row 2: an RL/eval prompt \(task_name 'arithmetic'\) without an `answer`"):
        process_sft_rows([rows[0], {"messages": prompt, "task_name": "arithmetic"}], tok, DataConfig(), max_len=64)


def test_no_rows_left_after_truncation_is_an_error(tok):
    rows = [{"messages": [{"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "a"}]}] * 3
    with pytest.raises(ValueError, match=r"no rows left after applying data.truncation='drop' at 20 tokens .*'dropped': 3"):
        process_sft_rows(rows, tok, DataConfig(truncation="drop"), max_len=20)
    with pytest.raises(ValueError, match=r"no rows left .*'no_loss': 3") as e:
        process_sft_rows(rows, tok, DataConfig(truncation="truncate"), max_len=20)
    assert str(e.value).endswith("data.max_input_seq_length")  # it also suggested the truncate already set
    pairs = [{"prompt_messages": [{"role": "user", "content": "q" * 50}], "chosen": [{"role": "assistant", "content": "a"}],
              "rejected": [{"role": "assistant", "content": "b"}]}]
    with pytest.raises(ValueError, match="no preference pairs left"):
        process_preference_rows(pairs, tok, DataConfig(), max_len=20)


# Mistral's and Gemma's templates refuse a conversation whose roles do not alternate.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def test_row_the_chat_template_rejects_is_named():
    # It used to stop with the template's bare TemplateError, naming no row.
    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = ALTERNATING_TEMPLATE
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    two_users = [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match=r"^row 3 \(roles user, user, assistant\): the chat template rejects it: "
                                         "Conversation roles must alternate"):
        process_sft_rows([{"messages": good}] * 2 + [{"messages": two_users}], tok, DataConfig(), max_len=100)
    pair = {"prompt_messages": two_users[:2], "chosen": good[1:], "rejected": good[1:]}
    with pytest.raises(ValueError, match=r"^row 1 \(roles user, user, assistant\): the chat template rejects it"):
        process_preference_rows([pair], tok, DataConfig(), max_len=100)


def test_rejected_or_overlong_row_is_named_by_its_file_and_line(tmp_path):
    # Errors raised after the rows left their file named the row's place in its split, which is not
    # its line once rows were held out for validation (or a blank line skipped): the user could
    # not find it. Rows read from a file keep their place through the split, data.task_name,
    # the prompt files and GRPO's prompt rendering.
    import json

    from posttrain.algorithms.grpo import _fit_prompts
    from posttrain.config import load_config
    from posttrain.embedded import build_tokenizer

    def chat(i: int) -> list[dict]:
        users = [{"role": "user", "content": f"q{i}"}] * (2 if i == 6 else 1)
        return [*users, {"role": "assistant", "content": "a"}]

    path = tmp_path / "chat.jsonl"
    path.write_text("\n" + "".join(json.dumps({"messages": chat(i)}) + "\n" for i in range(10)))  # row i: line i + 2
    (tmp_path / "prompt.txt").write_text("Q: {}")
    cfg = DataConfig(dataset_name=str(path), val_split_fraction=0.3, prompt_file=str(tmp_path / "prompt.txt"))

    def bad_at(rows: list[dict]) -> int | None:
        return next((n for n, r in enumerate(rows, start=1) if len(r["messages"]) == 3), None)

    loaded = next(rows for rows in (load_rows(cfg, s) for s in ("train", "val")) if bad_at(rows))
    assert bad_at(loaded) != 8  # its place in the split is not its line
    tok = build_tokenizer()
    tok.chat_template = ALTERNATING_TEMPLATE
    with pytest.raises(InputError, match=rf"^{path} row 8 \(roles user, user, assistant\): the chat template rejects"):
        process_sft_rows(loaded, tok, cfg, max_len=100)

    # An RL prompt too long for the context, in a math file with data.task_name set.
    math_rows = [{"question": "1+1=" if i != 2 else "9" * 40 + "+1=", "answer": "2"} for i in range(4)]
    math = tmp_path / "math.jsonl"
    math.write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    grpo = load_config("grpo", None, ["policy.max_total_sequence_length=24", f"data.dataset_name={math}",
                                      "data.val_data_path=" + str(math), "data.task_name=math",
                                      "data.truncation=truncate"])
    with pytest.raises(InputError, match=rf"^{math} row 3: the prompt is \d+ tokens, more than"):
        _fit_prompts(load_rows(grpo.data, "val"), build_tokenizer(), grpo, "val")
    # Generated rows come from no file: their place in the split names them.
    with pytest.raises(InputError, match=r"^train row 1: the prompt is"):
        _fit_prompts([{"messages": [{"role": "user", "content": "9" * 40}], "task_name": "t"}], build_tokenizer(),
                     grpo, "train")


def test_preference_pairs_mask_responses_only(tok, shared_data):
    cfg = DataConfig(dataset_name=f"{shared_data}/llamafactory_demo/dpo_en_demo.json", truncation="truncate")
    rows = load_rows(cfg, "train")
    multi = next(r for r in rows if len(r["prompt_messages"]) >= 3)
    (chosen, rejected), = process_preference_rows([multi], tok, cfg, max_len=100_000)[0]
    # (compared through the tokenizer: the char vocabulary maps non-ASCII characters to <unk>)
    for ex, side in ((chosen, "chosen"), (rejected, "rejected")):
        expected = tok.encode(multi[side][0]["content"] + "<|end|>", add_special_tokens=False)
        assert [i for i, m in zip(ex["input_ids"], ex["loss_mask"]) if m] == expected
    pairs, stats = process_preference_rows(rows[:20], tok, cfg, max_len=512)
    assert stats["rows"] == 20 and stats["truncated"] + stats["no_loss"] > 0
    assert stats["kept"] == len(pairs) == 20 - stats["no_loss"]
    assert all(len(ex["input_ids"]) <= 512 for pair in pairs for ex in pair)


# An Alpaca-style plain-text template: "\n\n###" after a turn, which GPT-2's BPE cuts as "\n\n" "###"
# when a turn's text ends there and as "\n" "\n###" inside one text.
ALPACA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n### Response:\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n\n{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
)


def test_the_prompt_is_trained_as_the_tokens_the_model_is_sampled_on(gpt2, shared_data):
    """The untrained turns before the first trained one are tokenized as `render_prompt` tokenizes
    them for generation (DPO, KTO and RM read multi-turn prompts; SFT's first turn)."""
    tok = _gpt2_bpe(shared_data, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = ALPACA_TEMPLATE
    cfg = DataConfig(dataset_name=f"{shared_data}/llamafactory_demo/dpo_en_demo.json", truncation="truncate")
    rows = [r for r in load_rows(cfg, "train") if len(r["prompt_messages"]) >= 3][:10]
    pairs, _ = process_preference_rows(rows, tok, cfg, max_len=100_000)
    assert len(pairs) == 10
    for row, (chosen, rejected) in zip(rows, pairs):
        for ex in (chosen, rejected):
            assert ex["input_ids"][: ex["loss_mask"].index(1)] == render_prompt(tok, row["prompt_messages"])
    # Tokenized message by message, the same text is other tokens: what this test tells apart.
    assert tok.encode("en\n\n") + tok.encode("### Instruction") != tok.encode("en\n\n### Instruction")
    # Multi-turn SFT: the first prompt reads as sampled, the later turns follow the tokens before them.
    convo = [{"role": "system", "content": "Be brief."}, *CONVO[1:]]
    ex, = process_sft_rows([{"messages": convo}], tok, DataConfig(), max_len=1000)[0]
    assert ex["input_ids"][: ex["loss_mask"].index(1)] == render_prompt(tok, convo[:2])
    trained = tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    assert trained == "2\n\n4\n\n<|endoftext|>"


def test_collate_contract(tok):
    a = tokenize_messages(CONVO[1:3], tok)
    b = tokenize_messages(CONVO, tok)
    batch = collate([a, b], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(b["input_ids"]))
    assert batch["input_lengths"].tolist() == [len(a["input_ids"]), len(b["input_ids"])]
    assert batch["input_ids"][0, len(a["input_ids"]):].eq(tok.pad_token_id).all()
    assert batch["token_mask"][0].tolist() == a["loss_mask"] + [0] * (len(b["input_ids"]) - len(a["input_ids"]))
    assert batch["token_mask"][:, 0].eq(0).all() and batch["sample_mask"].tolist() == [1.0, 1.0]
    # Plain text without a BOS trains its first token, which has no logprob: not a loss token
    # (NLL's num_valid_tokens counted it, one per row).
    assert collate([{"input_ids": [5, 6], "loss_mask": [1, 1]}], pad_id=0)["token_mask"].tolist() == [[0.0, 1.0]]
    pairs = collate_pairs([(a, b), (b, a)], pad_id=tok.pad_token_id)
    assert torch.equal(pairs["input_ids"][1], batch["input_ids"][1]) and pairs.size == 4


TOOL_CONVO = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": "21 °C"}', "tool_call_id": "call0", "name": "get_weather"},
    {"role": "assistant", "content": "It is 21 °C."},
]


def test_template_that_leaves_out_tool_turns_is_an_error():
    # A plain template knowing only system/user/assistant rendered the call as an empty assistant
    # turn and the result not at all, without an error: SFT trained on "\n\n" and "It is 21 °C.".
    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    ex = tokenize_messages(TOOL_CONVO, tok)  # the embedded template renders calls and results
    assert '"get_weather"' in tok.decode(ex["input_ids"]) and "It is 21 " in _loss_text(tok, ex)
    plain = build_tokenizer()
    plain.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ '<|' + m['role'] + '|>' + "
                           "m['content'] + '<|end|>' }}{% endif %}{% endfor %}")
    with pytest.raises(InputError, match=r"^row 1 \(roles user, assistant, tool, assistant\): the chat template does "
                                         r"not render its call of 'get_weather' \(message 1, role 'assistant'\)"):
        process_sft_rows([{"messages": TOOL_CONVO}], plain, DataConfig(), max_len=1000)
    # A template that writes the calls but drops the results.
    plain.chat_template = plain.chat_template.replace("m['content']", "m['content'] + (m['tool_calls'] | tojson "
                                                      "if m['tool_calls'] is defined else '')")
    with pytest.raises(InputError, match=r"does not render the tool result \(message 2, role 'tool'\)"):
        tokenize_messages(TOOL_CONVO, plain)
    # One that writes results JSON-escaped (tojson) shows them.
    plain.chat_template = plain.chat_template.replace("{% if m['role'] != 'tool' %}", "{% if true %}").replace(
        "m['content'] +", "(m['content'] | tojson if m['role'] == 'tool' else m['content']) +", 1)
    assert '\\"temp\\"' in plain.decode(tokenize_messages(TOOL_CONVO, plain)["input_ids"])


def test_pair_whose_sides_are_the_same_tokens_is_left_out_and_counted(tok):
    # Responses that differ only past the cut at the context became one sequence twice: the pair
    # had no gradient, yet filled a place in its batch and counted as a miss in the accuracy.
    prompt = [{"role": "user", "content": "q"}]
    pair = {"prompt_messages": prompt, "chosen": [{"role": "assistant", "content": "a" * 40 + "good"}],
            "rejected": [{"role": "assistant", "content": "a" * 40 + "bad"}]}
    short = {"prompt_messages": prompt, "chosen": [{"role": "assistant", "content": "good"}],
             "rejected": [{"role": "assistant", "content": "bad"}]}
    pairs, stats = process_preference_rows([pair, short, pair], tok, DataConfig(truncation="truncate"), max_len=30)
    assert stats == {"rows": 3, "kept": 1, "truncated": 0, "dropped": 0, "no_loss": 0, "identical": 2}
    assert [_loss_text(tok, ex) for ex in pairs[0]] == ["good<|end|>", "bad<|end|>"]
    # Past the cut they differ: both kept (and truncated).
    pairs, stats = process_preference_rows([pair], tok, DataConfig(truncation="truncate"), max_len=60)
    assert stats["kept"] == 1 and stats["identical"] == 0
    with pytest.raises(ValueError, match=r"no preference pairs left .*'identical': 1"):
        process_preference_rows([pair], tok, DataConfig(truncation="truncate"), max_len=30)
    # KTO unpairs them into one sequence labelled desirable and undesirable at once: dropped too.
    from posttrain.data.processors import process_kto_rows

    examples, stats = process_kto_rows([pair, short], tok, DataConfig(truncation="truncate"), max_len=30)
    assert stats == {"rows": 4, "kept": 2, "truncated": 0, "dropped": 0, "no_loss": 0, "identical": 2}
    assert [(_loss_text(tok, ex), ex["label"]) for ex in examples] == [("good<|end|>", [1]), ("bad<|end|>", [0])]


# DeepSeek-R1's rule: every assistant turn is written as its text after </think>; the generation
# prompt opens the block the model then writes.
R1_LIKE_TEMPLATE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}{{ '<|' + m['role'] + '|>' + content + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}"
)
THOUGHT = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "<think>\nadd one\n</think>\n\n2"}]


def test_a_template_that_drops_the_reasoning_of_a_trained_turn_is_an_error():
    # R1's template wrote the turn as "\n\n2": SFT trained the answer without its reasoning, and a
    # DPO pair differing in its reasoning became one sequence twice (counted as `identical`), silently.
    from posttrain.embedded import build_tokenizer

    r1 = build_tokenizer()
    r1.chat_template = R1_LIKE_TEMPLATE
    with pytest.raises(InputError, match=r"^row 1 \(roles user, assistant\): the chat template drops the <think> "
                                         r"reasoning of assistant message 1, which gets loss.*policy\.tokenizer\."
                                         r"chat_template"):
        process_sft_rows([{"messages": THOUGHT}], r1, DataConfig(), max_len=1000)
    pair = {"prompt_messages": THOUGHT[:1], "chosen": [{"role": "assistant", "content": "<think>\nadd one\n</think>2"}],
            "rejected": [{"role": "assistant", "content": "<think>\nguess\n</think>2"}]}
    with pytest.raises(InputError, match=r"^row 1 .*drops the <think> reasoning of assistant message 1"):
        process_preference_rows([pair], r1, DataConfig(), max_len=1000)
    # Answers without reasoning are trained as before; read without loss (a reward model), the
    # conversation is what the template shows.
    plain = [THOUGHT[0], {"role": "assistant", "content": "2"}]
    assert r1.decode(tokenize_messages(plain, r1)["input_ids"]) == "<s><|user|>1+1?<|end|><|assistant|>2<|end|>"
    assert r1.decode(tokenize_messages(THOUGHT, r1, check_reasoning=False)["input_ids"]).endswith("\n\n2<|end|>")
    # The way out the error names: a template that writes the content as it is trains the reasoning,
    # after the generation prompt that opens it.
    r1.chat_template = R1_LIKE_TEMPLATE.replace("'</think>' in content", "false")
    ex = tokenize_messages(THOUGHT, r1)
    assert r1.decode(ex["input_ids"]) == "<s><|user|>1+1?<|end|><|assistant|><think>\nadd one\n</think>\n\n2<|end|>"
    assert _loss_text(r1, ex) == "add one\n</think>\n\n2<|end|>"


def test_a_template_that_drops_earlier_reasoning_names_the_turn_where_one_sequence_is_needed(qwen3_like_tok):
    # Qwen3's template keeps the reasoning of the turns after the last user message only: the last
    # turn of a row trains with it; where a trained turn followed by a user turn must be one sequence
    # with the next one (a preference pair's response, `tokenize_messages`), the error names that
    # turn and why, not "earlier messages render differently". SFT trains each turn in an example
    # of its own (test_multi_turn_sft_with_qwen3s_template_trains_each_turn_as_generated).
    tok = qwen3_like_tok
    ex = tokenize_messages(THOUGHT, tok)
    assert _loss_text(tok, ex) == "<think>\nadd one\n</think>\n\n2<|end|>"
    two = [*THOUGHT, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd two\n</think>4"}]
    with pytest.raises(InputError, match=r"^the chat template drops the <think> reasoning of message 1 \(role "
                                         r"'assistant'\) once message 2 \(role 'user'\) follows.*so the turns that get "
                                         r"loss \(from message 0 on\) are not one sequence.*policy\.tokenizer\."
                                         r"chat_template"):
        tokenize_messages(two, tok)
    examples, _ = process_sft_rows([{"messages": two}], tok, DataConfig(), max_len=1000)
    assert [_loss_text(tok, e) for e in examples] == ["<think>\nadd one\n</think>\n\n2<|end|>",
                                                      "<think>\nadd two\n</think>\n\n4<|end|>"]
    # Without reasoning, the empty block the last turn alone gets is named.
    bare = [{**m, "content": m["content"].split("</think>")[-1].strip()} for m in two]
    with pytest.raises(InputError, match=r"renders message 1 \(role 'assistant'\) differently once message 2 "
                                         r"\(role 'user'\) follows \('<\|assistant\|><think>\\n\\n</think>\\n\\n2<\|end\|>' "
                                         r"became '<\|assistant\|>2<\|end\|><\|user\|>2\+2\?<\|end\|>'; Qwen3's "
                                         r"template, for one, writes an empty <think></think>"):
        tokenize_messages(bare, tok)


def _fielded(field="reasoning_content", reasoning="add one"):
    """THOUGHT loaded from a row that carries the reasoning in a message field, as the loader keeps it."""
    from posttrain.data.formats import normalize_row

    row = {"messages": [THOUGHT[0], {"role": "assistant", "content": "2", field: reasoning}]}
    return normalize_row(row, "messages", "r.jsonl row 1")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_a_reasoning_field_is_trained_where_the_template_renders_it(qwen3_like_tok, field):
    # The loader kept role and content alone: a row whose reasoning sat in `reasoning_content`
    # (Qwen3's, DeepSeek's API) or `reasoning`/`thinking` trained the bare answer, after an empty block.
    tok = qwen3_like_tok
    ex = tokenize_messages(_fielded(field)["messages"], tok)
    assert _loss_text(tok, ex) == "<think>\nadd one\n</think>\n\n2<|end|>"
    # A template that reads the field under another name gets it under that name (`reasoning`:
    # recent transformers add `thinking`, gpt-oss's name, themselves, but not this one).
    tok.chat_template = tok.chat_template.replace("m.reasoning_content", "m.reasoning")
    assert _loss_text(tok, tokenize_messages(_fielded(field)["messages"], tok)) == "<think>\nadd one\n</think>\n\n2<|end|>"


def test_a_template_that_ignores_the_reasoning_field_is_an_error(tok, qwen3_like_tok):
    # The embedded tokenizer's template (like Llama's) writes content alone: the row trained "2"
    # without a word, and a DPO pair differing in its reasoning was one sequence twice.
    fix = (r"a template that renders it.*<think>\.\.\.</think>.*drop the field \(`reasoning_content`, `reasoning` "
           r"or `thinking`\)")
    with pytest.raises(InputError, match=r"^row 1 \(roles user, assistant\): the chat template drops the reasoning "
                                         rf"field of assistant message 1, which gets loss.*policy\.tokenizer\."
                                         rf"chat_template.*{fix}"):
        process_sft_rows([_fielded()], tok, DataConfig(), max_len=1000)
    from posttrain.data.formats import normalize_row

    pair = normalize_row({"prompt": "1+1?", "chosen": {"role": "assistant", "content": "2", "reasoning": "add one"},
                          "rejected": {"role": "assistant", "content": "2", "reasoning": "guess"}}, "preference", "p row 1")
    with pytest.raises(InputError, match=r"^row 1 .*drops the reasoning field of assistant message 1"):
        process_preference_rows([pair], tok, DataConfig(), max_len=1000)
    # Read without loss (a reward model), the conversation is what the template shows.
    assert tok.decode(tokenize_messages(_fielded()["messages"], tok, check_reasoning=False)["input_ids"]).endswith(
        "<|assistant|>2<|end|>")
    # Qwen3's writes the field of the turns after the last user message only: a trained turn followed
    # by a user turn is named, with the ways out for a field.
    two = [*_fielded()["messages"], {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4", "reasoning_content": "add two"}]
    with pytest.raises(InputError, match=r"drops the reasoning field of message 1 \(role 'assistant'\) once "
                                         rf"message 2 \(role 'user'\) follows.*{fix}"):
        tokenize_messages(two, qwen3_like_tok)


def _qwen3_convo(reasoning: bool) -> list[dict]:
    """Two turns, with reasoning in the first turn's content and in the second's reasoning field."""
    first = "<think>\nadd one\n</think>\n\n2" if reasoning else "2"
    second = {"role": "assistant", "content": "4", **({"reasoning_content": "add two"} if reasoning else {})}
    return [CONVO[0], CONVO[1], {"role": "assistant", "content": first}, CONVO[3], second]


@pytest.mark.parametrize("reasoning", [False, True])
def test_multi_turn_sft_with_qwen3s_template_trains_each_turn_as_generated(qwen3_tok, reasoning):
    # Qwen3's template writes an empty <think></think> block into the last assistant turn alone and
    # drops the reasoning of the turns before the last user message, so every multi-turn row was
    # refused. Each turn is now an example of its own: the conversation up to it as the model is
    # prompted for it (earlier turns as the template shows them then), then the turn as the model
    # generates it, its <think> block included.
    tok, convo = qwen3_tok, _qwen3_convo(reasoning)
    think1, think2 = ("add one", "add two") if reasoning else ("", "")
    prompts = ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
               "2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"]
    turns = [f"<think>\n{think1}\n</think>\n\n2<|im_end|>\n", f"<think>\n{think2}\n</think>\n\n4<|im_end|>\n"]
    examples, stats = process_sft_rows([{"messages": convo}], tok, DataConfig(), max_len=1000)
    assert stats == {"rows": 1, "kept": 1, "truncated": 0, "dropped": 0, "no_loss": 0, "examples": 2}
    for ex, prompt, turn, k in zip(examples, prompts, turns, (2, 4)):
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        # Token for token: the prompt rollouts give the model for turn k, then the turn, the loss on it alone.
        assert prompt_ids == render_prompt(tok, convo[:k])
        assert ex["input_ids"] == prompt_ids + tok.encode(turn, add_special_tokens=False)
        assert ex["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(ex["input_ids"]) - len(prompt_ids))
        assert tok.decode(ex["input_ids"]) == prompt + turn and _loss_text(tok, ex) == turn
    # A row longer than the context goes whole under "drop"; "truncate" keeps the turns that fit.
    fits_one = len(examples[0]["input_ids"]) + 1
    assert process_sft_rows([{"messages": convo}, {"messages": CONVO[1:3]}], tok, DataConfig(), max_len=fits_one)[1][
        "dropped"] == 1
    kept, stats = process_sft_rows([{"messages": convo}], tok, DataConfig(truncation="truncate"), max_len=fits_one)
    assert kept == examples[:1] and stats == {"rows": 1, "kept": 1, "truncated": 1, "dropped": 0, "no_loss": 0}



def test_tool_calling_sft_with_qwen3s_template_trains_the_call_as_generated(qwen3_tok):
    # A call without reasoning loses its empty block once its result follows: the call is trained
    # with it, and the answer after the result as the template then shows the call.
    examples, _ = process_sft_rows([{"messages": TOOL_CONVO}], qwen3_tok, DataConfig(), max_len=1000)
    assert [qwen3_tok.decode(e["input_ids"]) for e in examples] == [
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": "21 °C"}\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 21 °C.<|im_end|>\n"]
    assert [_loss_text(qwen3_tok, e) for e in examples] == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "<think>\n\n</think>\n\nIt is 21 °C.<|im_end|>\n"]

def test_dpo_with_earlier_assistant_turns_in_the_context_under_qwen3s_template(qwen3_tok):
    # The context's assistant turn lost its empty block (and reasoning) once the next user turn
    # followed, so every DPO/RM pair with one was refused; the context is now the prompt as the model
    # reads it before the response, without loss.
    tok, convo = qwen3_tok, _qwen3_convo(reasoning=True)
    pair = {"prompt_messages": convo[:4], "chosen": [{"role": "assistant", "content": "<think>\nadd two\n</think>4"}],
            "rejected": [{"role": "assistant", "content": "<think>\nguess\n</think>5"}]}
    ((chosen, rejected),), stats = process_preference_rows([pair], tok, DataConfig(), max_len=1000)
    assert stats["kept"] == 1
    prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
              "2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    for ex, turn in ((chosen, "<think>\nadd two\n</think>\n\n4<|im_end|>\n"),
                     (rejected, "<think>\nguess\n</think>\n\n5<|im_end|>\n")):
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        assert prompt_ids == render_prompt(tok, convo[:4])
        assert ex["input_ids"] == prompt_ids + tok.encode(turn, add_special_tokens=False)
        assert ex["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(ex["input_ids"]) - len(prompt_ids))
    # A response whose first turn the template re-renders once its second follows (a tool call
    # without reasoning loses its empty block) is not one sequence: named, not trained as another.
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    tools = {**pair, "chosen": [call, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}
    with pytest.raises(InputError, match=r"^row 1 \(roles system, user, assistant, user, assistant, tool, assistant\): "
                                         r"the chat template renders message 4 \(role 'assistant'\) differently once "
                                         r"message 5 \(role 'tool'\) follows .*so the turns that get loss \(from "
                                         r"message 4 on\) are not one sequence"):
        process_preference_rows([tools], tok, DataConfig(), max_len=1000)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rows_with_a_system_prompt_under_a_template_that_wants_a_user_message(qwen3_tok, qwen3_2507_tok,
                                                                                add_generation_prompt):
    # The templates of Qwen3-2507 and Qwen3.5 refuse a conversation without a user message ("No user
    # query found in messages."). A row was tokenized by rendering each of its prefixes, the system
    # message alone first: every SFT, DPO and RM row with a system prompt was refused. The messages
    # before the first user message are now rendered with it: the same tokens as under Qwen3's template.
    from jinja2 import TemplateError

    from posttrain.data.processors import render_chat

    with pytest.raises(TemplateError, match="No user query found in messages"):
        render_chat(qwen3_2507_tok, CONVO[:1], add_generation_prompt=False)
    cfg, convo = DataConfig(add_generation_prompt=add_generation_prompt), _qwen3_convo(reasoning=True)
    sft = [process_sft_rows([{"messages": convo}], t, cfg, max_len=1000) for t in (qwen3_tok, qwen3_2507_tok)]
    assert sft[1] == sft[0] and sft[1][1]["examples"] == 2
    assert qwen3_tok.decode(sft[1][0][0]["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    pair = {"prompt_messages": convo[:4], "chosen": [{"role": "assistant", "content": "<think>\nadd two\n</think>4"}],
            "rejected": [{"role": "assistant", "content": "<think>\nguess\n</think>5"}]}
    pairs = [process_preference_rows([pair], t, cfg, max_len=1000) for t in (qwen3_tok, qwen3_2507_tok)]
    assert pairs[1] == pairs[0] and pairs[1][1]["kept"] == 1


def test_parallel_tool_results_under_qwen3s_template_are_one_sequence(qwen3_tok):
    # Qwen3's template writes a turn's tool results as one user turn: the first result's <|im_end|>
    # moves behind the second once it follows. Nothing trained is re-rendered, yet the row was split
    # there (an extra example repeating the call) and a DPO/RM pair with such a response was refused,
    # its error blaming Qwen3's empty <think></think> block.
    call = {"role": "assistant", "content": "", "reasoning_content": "two calls", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in ("Paris", "Rome")]}
    convo = [{"role": "user", "content": "Weather in Paris and Rome?"}, call, {"role": "tool", "content": "21"},
             {"role": "tool", "content": "25"}, {"role": "assistant", "content": "21 and 25.", "reasoning_content": "both"}]
    text = ("<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<think>\ntwo calls\n</think>"
            '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
            "<tool_response>\n21\n</tool_response>\n<tool_response>\n25\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\nboth\n</think>\n\n21 and 25.<|im_end|>\n")
    (ex,), stats = process_sft_rows([{"messages": convo}], qwen3_tok, DataConfig(), max_len=1000)
    assert "examples" not in stats
    assert ex["input_ids"] == qwen3_tok.encode(text, add_special_tokens=False)
    call_text = text.split("<|im_start|>assistant\n")[1].split("<|im_start|>user")[0]
    assert _loss_text(qwen3_tok, ex) == call_text + "<think>\nboth\n</think>\n\n21 and 25.<|im_end|>\n"
    pair = {"prompt_messages": convo[:1], "chosen": convo[1:], "rejected": [{"role": "assistant", "content": "No idea."}]}
    ((chosen, _),), stats = process_preference_rows([pair], qwen3_tok, DataConfig(), max_len=1000)
    assert chosen == ex and stats["kept"] == 1


def test_a_chat_template_is_scanned_for_the_reasoning_field_it_reads_once(monkeypatch):
    # render_chat looked for the field a template reads at every render: a regex scan of the whole
    # template per field name, for a template reading none (Llama's) as slow as the render itself
    # (a 4 KB one: 109 -> 207 us a render, measured).
    import posttrain.data.processors as processors
    from posttrain.embedded import build_tokenizer

    t = build_tokenizer()
    t.chat_template += "{# a template this process has not seen #}"
    scans, search = [], processors.re.search
    monkeypatch.setattr(processors.re, "search", lambda p, s, *a: (s == t.chat_template and scans.append(p))
                        or search(p, s, *a))
    for _ in range(5):
        process_sft_rows([{"messages": CONVO}], t, DataConfig(), max_len=1000)
    assert len(scans) == 3  # once for each of reasoning_content, reasoning, thinking: it reads none


def test_kto_rows_keep_their_label_and_train_the_last_message(tok, shared_data, tmp_path):
    from posttrain.data.formats import labelled_rows
    from posttrain.data.processors import collate_kto, process_kto_rows

    # LLaMA-Factory's KTO data (messages + label) read for KTO keeps the label SFT refuses.
    cfg = DataConfig(dataset_name=f"{shared_data}/llamafactory_demo/kto_en_demo.json", truncation="truncate")
    with labelled_rows():
        rows = load_rows(cfg, "train")
    assert {r["label"] for r in rows} == {True, False}
    multi = next(r for r in rows if len(r["messages"]) >= 4)
    (ex,), stats = process_kto_rows([multi], tok, cfg, max_len=100_000)
    expected = tok.encode(multi["messages"][-1]["content"] + "<|end|>", add_special_tokens=False)
    assert [i for i, m in zip(ex["input_ids"], ex["loss_mask"]) if m] == expected  # earlier answers get no loss
    assert ex["label"] == [int(multi["label"])] and stats["kept"] == 1
    # TRL's unpaired format, and a preference pair unpaired into its two sides.
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": True}) + "\n"
                    + json.dumps({"prompt": "1+2=", "completion": "4", "label": False}) + "\n")
    with labelled_rows():
        rows = load_rows(DataConfig(dataset_name=str(path), val_split_fraction=0.4), "train")
    pair = {"prompt_messages": [{"role": "user", "content": "2+2="}],
            "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}
    examples, stats = process_kto_rows(rows + [pair], tok, cfg, max_len=64)
    assert [ex["label"] for ex in examples] == [[int(rows[0]["label"])], [1], [0]]
    assert (stats["rows"], stats["kept"]) == (3, 3)  # the pair's two sides are two examples
    # The mismatched pairs of the KL estimate: each prompt with the response of the next example
    # whose prompt differs. The pair's chosen side (1) is not paired with its own rejected side
    # (2), the next example: that would be a matched pair.
    batch = collate_kto(examples, tok.pad_token_id, max_len=64)
    assert batch["kto_label"].tolist() == [float(rows[0]["label"]), 1.0, 0.0]
    starts = [ex["loss_mask"].index(1) for ex in examples]
    for i, j in enumerate([1, 0, 0]):
        want = examples[i]["input_ids"][: starts[i]] + examples[j]["input_ids"][starts[j]:]
        n = int(batch["kl_input_lengths"][i])
        assert batch["kl_input_ids"][i, :n].tolist() == want
        assert batch["kl_token_mask"][i, :n].tolist() == [0.0] * starts[i] + [float(m) for m in examples[j]["loss_mask"][starts[j]:]]
    # Cut at the context like any row.
    assert collate_kto(examples, tok.pad_token_id, max_len=5)["kl_input_lengths"].max() <= 5
    # Every prompt the same: the next example's response (a batch of one, its own).
    same = collate_kto(examples[1:], tok.pad_token_id, max_len=64)
    assert same["kl_input_ids"][0].tolist()[: int(same["kl_input_lengths"][0])] == examples[2]["input_ids"]
    one = collate_kto(examples[:1], tok.pad_token_id, max_len=64)
    assert one["kl_input_ids"][0].tolist() == examples[0]["input_ids"]


def test_kto_rows_without_a_label_are_named_or_skipped(tok, tmp_path):
    from posttrain.data.formats import labelled_rows
    from posttrain.data.processors import process_kto_rows

    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": True}) + "\n"
                    + json.dumps({"prompt": "1+2=", "completion": "3"}) + "\n"
                    + json.dumps({"prompt": "1+3=", "completion": "4", "label": "yes"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "completion": "5", "label": False}) + "\n")
    cfg = DataConfig(dataset_name=str(path), val_data_path=str(path))
    with labelled_rows(), pytest.raises(InputError, match=r"kto.jsonl row 2: KTO trains on responses labelled "
                                                          r"desirable \(`label: true`\) or not \(`label: false`\); "
                                                          r"this row has no `label`.*data.on_malformed_row=skip"):
        load_rows(cfg, "train")
    # Skipped and counted like any malformed row.
    skip = cfg.model_copy(update={"on_malformed_row": "skip"})
    with labelled_rows():
        rows = load_rows(skip, "train")
    assert [(r["messages"][-1]["content"], r["label"]) for r in rows] == [("2", True), ("5", False)]
    examples, stats = process_kto_rows(rows, tok, skip, max_len=64)
    assert [ex["label"] for ex in examples] == [[1], [0]] and stats["rows"] == 2
    # 1 and 0, as CSV and parquet exports write labels, are true and false; 2 is no label.
    path.write_text("".join(json.dumps({"prompt": "1+1=", "completion": c, "label": label}) + "\n"
                            for c, label in (("2", 1), ("3", 0), ("4", 0.0), ("5", 2))))
    with labelled_rows():
        rows = load_rows(skip, "train")
    assert [(r["messages"][-1]["content"], r["label"]) for r in rows] == [("2", True), ("3", False), ("4", False)]
    # A conversation whose last message is not the response.
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                                             {"role": "user", "content": "sure?"}], "label": True}) + "\n")
    with labelled_rows(), pytest.raises(InputError, match="kto.jsonl row 1: KTO's response is the row's last message"):
        load_rows(cfg, "train")
    # Read for anything else, a false label is still refused (SFT would imitate the answer).
    path.write_text(json.dumps({"prompt": "1+2=", "completion": "4", "label": False}) + "\n")
    with pytest.raises(InputError, match="`label` is false"):
        load_rows(cfg, "train")


def test_kto_on_rows_that_are_neither_labelled_nor_pairs_names_the_dataset(tok):
    from posttrain.data.processors import process_kto_rows

    cfg = DataConfig()  # the embedded arithmetic task: prompts for RL
    with pytest.raises(InputError, match=r"data.dataset_name='arithmetic' gives rows with keys \[.*'task_name'.*\]; "
                                         r"KTO trains on labelled conversations .* \(e.g. examples/configs/kto.yaml's\)"):
        process_kto_rows(load_rows(cfg, "val")[:2], tok, cfg, max_len=64)


def test_rows_with_tools_for_a_template_that_never_reads_them_are_warned_about(caplog):
    # The tool schemas of a row (glaive's) were dropped by such a template without a word: the
    # model trained on calls of functions it was never shown.
    from posttrain.data.processors import _note_if_tools_unread, render_chat

    _note_if_tools_unread.cache_clear()
    tok = load_tokenizer(TokenizerConfig(name="embedded:tiny"))
    tools = [{"type": "function", "function": {"name": "search_recipes", "description": "d", "parameters": {}}}]
    with caplog.at_level(logging.WARNING, logger="posttrain.data.processors"):
        render_chat(tok, [{"role": "user", "content": "x"}], add_generation_prompt=True, tools=tools)
        render_chat(tok, [{"role": "user", "content": "y"}], add_generation_prompt=True, tools=tools)
        render_chat(tok, [{"role": "user", "content": "z"}], add_generation_prompt=True)
    warned = [r for r in caplog.records if "does not render the rows' `tools`" in r.getMessage()]
    assert len(warned) == 1  # once per template
    _note_if_tools_unread.cache_clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.data.processors"):
        _note_if_tools_unread("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert len([r for r in caplog.records if "does not render" in r.getMessage()]) == 1  # no new one


def test_chat_template_file_is_read_and_a_template_without_content_is_refused(tiny_model_path, tmp_path, monkeypatch,
                                                                               caplog):
    from pydantic import ValidationError

    from posttrain.data import processors

    monkeypatch.setattr(processors, "_TEMPLATE_REPLACED", {tiny_model_path})  # its warning is another test's
    # A path was taken as the template itself: every prompt rendered as the path, and the run went on.
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    t = load_tokenizer(TokenizerConfig(name=tiny_model_path, chat_template=str(tmp_path / "t.jinja")))
    assert t.apply_chat_template(CONVO[1:3], tokenize=False) == "<user>1+1?<assistant>2"
    with pytest.raises(ValidationError, match=r"'.*missing.jinja' is neither a Jinja template .* nor a file "
                                              r"\(no such file\)"):
        TokenizerConfig(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "notes.txt").write_text("my template\n")
    with pytest.raises(ValidationError, match=r"the file '.*notes.txt' holds no Jinja template"):
        TokenizerConfig(chat_template=str(tmp_path / "notes.txt"))
    # Jinja that writes no message's content: every conversation the same text.
    with pytest.raises(InputError, match=r"policy.tokenizer.chat_template: the chat template does not write the user "
                                         r"message's content .*'Q: A: '"):
        load_tokenizer(TokenizerConfig(name=tiny_model_path, chat_template="Q: {{ '' }}A: "))
    # A prompt-only template serves single-turn GRPO: said, not refused; SFT then names it.
    with caplog.at_level(logging.WARNING):
        prompt_only = load_tokenizer(TokenizerConfig(name=tiny_model_path, chat_template=(
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}")))
    assert "does not write an assistant message's content" in caplog.text
    with pytest.raises(InputError, match=r"no rows left: none has a token to train .*a chat template that does not "
                                         r"write the assistant's content"):
        process_sft_rows([{"messages": CONVO[1:3]}], prompt_only, DataConfig(add_eos=False), max_len=64)


def test_system_messages_a_template_leaves_out_are_said(tiny_model_path, caplog):
    from posttrain.data.processors import note_dropped_system

    tok = load_tokenizer(TokenizerConfig(name=tiny_model_path))  # its own: the template changes below
    rows = [{"messages": [{"role": "system", "content": "Be terse."}, *CONVO[1:3]]}, {"messages": CONVO[1:3]}]
    with caplog.at_level(logging.WARNING):
        note_dropped_system(tok, rows)  # the embedded template writes system messages
        assert caplog.text == ""
        tok.chat_template = "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
        note_dropped_system(tok, rows[1:])  # no row has one
        assert caplog.text == ""
        note_dropped_system(tok, rows)
    assert "1 of 2 rows start with a system message" in caplog.text and "does not write" in caplog.text


def test_a_model_folder_without_its_tokenizer_says_so(tiny_model_path, tmp_path):
    import shutil

    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_path) / f, tmp_path / f)
    # transformers' message stopped at "Couldn't instantiate the backend tokenizer from one of:".
    with pytest.raises(InputError, match=r"it holds config.json, model.safetensors but no tokenizer files .*a model "
                                         r"saved without its tokenizer; set policy.tokenizer.name to the folder"):
        load_tokenizer(TokenizerConfig(name=str(tmp_path)), key="policy.model_name")


def test_plain_text_rows_train_every_token_without_a_chat_template(tok, tmp_path):
    # TRL SFTTrainer's language-modeling data ({"text": ...}) was refused: no format took plain text.
    data = tmp_path / "lm.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["12+3=15", "7+7=14"] * 10)))
    cfg = DataConfig(dataset_name=str(data))
    rows = load_rows(cfg, "train")
    assert rows[0] == {"text": rows[0]["text"]} and rows[0]["text"] in ("12+3=15", "7+7=14")
    examples, stats = process_sft_rows(rows, tok, cfg, max_len=64)
    assert stats == {"rows": len(rows), "kept": len(rows), "truncated": 0, "dropped": 0, "no_loss": 0}
    ex = examples[0]
    body = tok.encode(rows[0]["text"], add_special_tokens=False)
    assert ex["input_ids"] == [tok.bos_token_id, *body, tok.eos_token_id]
    assert ex["loss_mask"] == [0] + [1] * (len(body) + 1)  # the BOS is context; the text and its end train
    bare, _ = process_sft_rows(rows[:1], tok, DataConfig(dataset_name=str(data), add_bos=False, add_eos=False), 64)
    assert bare[0] == {"input_ids": body, "loss_mask": [1] * len(body)}
    cut, stats = process_sft_rows(rows, tok, DataConfig(dataset_name=str(data), truncation="truncate"), max_len=4)
    assert stats["truncated"] == len(rows) and all(len(e["input_ids"]) == 4 for e in cut)
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    with pytest.raises(InputError, match=rf"{len(rows)} of {len(rows)} rows are plain text \(`text`; first: .*lm.jsonl "
                                         r"row \d+\), which SFT trains on as written"):
        resolve_task_envs(rows, EnvConfig())  # GRPO's and eval's check: no environment scores them
    (tmp_path / "sys.txt").write_text("Be brief.")
    with pytest.raises(InputError, match=r"data.system_prompt_file: .*lm.jsonl row \d+ is plain text"):
        load_rows(DataConfig(dataset_name=str(data), system_prompt_file=str(tmp_path / "sys.txt")), "train")


def test_shown_example_marks_the_tokens_with_loss(tok):
    from posttrain.data.processors import shown_example

    ex = tokenize_messages(CONVO[1:3], tok)
    assert shown_example(tok, ex) == repr("<s><|user|>1+1?<|end|><|assistant|>«2<|end|>»")
    # A long one keeps its start and its end, where the trained answer is.
    n = len(ex["input_ids"])
    long = shown_example(tok, {"input_ids": ex["input_ids"] * 40, "loss_mask": ex["loss_mask"] * 40}, limit=30)
    assert long == f"'<s><|user|' ... 'ssistant|>«2<|end|>»' ({n * 40} tokens)"
