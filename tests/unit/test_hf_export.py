"""The chat template an HF export writes: plain transformers renders the ids posttrain trained on."""

from transformers import AutoTokenizer

from posttrain.data.processors import tokenize_messages
from posttrain.embedded import resolve_model_path
from posttrain.policy.hf_io import exported_chat_template
from posttrain.rollouts import render_prompt

PROMPT = [{"role": "user", "content": "12+34="}]
CONVERSATION = [*PROMPT, {"role": "assistant", "content": "046"}]
PLAIN = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _tokenizer(template=None):
    tok = AutoTokenizer.from_pretrained(resolve_model_path("embedded:small"))
    if template is not None:
        tok.chat_template = template
    return tok


def _rendered(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)


def test_the_exported_template_writes_the_bos_and_eos_the_data_put_around_it():
    for template, eos in ((None, False), (PLAIN, True)):  # the embedded model's; a plain one of a reward model
        trained = _tokenizer(template)
        prompt = render_prompt(trained, PROMPT, True)
        row = tokenize_messages(CONVERSATION, trained, add_bos=True, add_eos=True)["input_ids"]
        assert _rendered(trained, PROMPT, add_generation_prompt=True) != prompt  # the template alone: no BOS
        exported = _tokenizer(exported_chat_template(trained, bos=True, eos=eos))
        assert _rendered(exported, PROMPT, add_generation_prompt=True) == prompt
        assert _rendered(exported, CONVERSATION) == row  # the embedded template ends turns with its EOS
        # posttrain reads the exported template back to the same ids, and exports it unchanged again
        assert render_prompt(exported, PROMPT, True) == prompt
        assert tokenize_messages(CONVERSATION, exported, add_bos=True, add_eos=True)["input_ids"] == row
        assert exported_chat_template(exported, bos=True, eos=eos) == exported.chat_template
        # The EOS ends a conversation, not a prompt rendered without a generation prompt: a reward
        # model environment reads conversations with add_generation_prompt=false by the prompt's
        # render extending the conversation's, and failed every sample.
        assert _rendered(exported, PROMPT)[-1] != trained.eos_token_id or template is None
        assert tokenize_messages(CONVERSATION, exported, add_bos=True, add_eos=True,
                                 add_generation_prompt=False)["input_ids"][-1] == trained.eos_token_id


def test_the_exported_template_is_unchanged_where_nothing_is_put_around_it():
    tok = _tokenizer(PLAIN)
    assert exported_chat_template(tok, bos=False, eos=False) == PLAIN
    with_bos = "{{ bos_token }}" + PLAIN  # stories260K's converter writes its BOS itself
    assert exported_chat_template(_tokenizer(with_bos), bos=True, eos=False) == with_bos
    tok.chat_template = {"default": PLAIN, "tool_use": with_bos}  # named templates, each adjusted
    assert exported_chat_template(tok, bos=True, eos=False) == {"default": with_bos, "tool_use": with_bos}


def test_a_sentencepiece_tokenizer_gets_its_bos_before_a_space(stories260k, caplog):
    # SentencePiece reads "<s>Once" as BOS + "Once" without its leading-space marker, not as the
    # ids posttrain trained on (BOS + those of "Once"): the template writes "<s> Once".
    rm_template = "{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n" \
                  "### Response:\n{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
    for template in (rm_template, PLAIN):
        trained = AutoTokenizer.from_pretrained(stories260k)
        trained.chat_template = template
        exported = AutoTokenizer.from_pretrained(stories260k)
        exported.chat_template = exported_chat_template(trained, bos=True, eos=True)
        assert exported.chat_template.startswith("{{ bos_token }} ")
        for messages in (PROMPT, [{"role": "user", "content": "Tim and Lily"}]):
            assert _rendered(exported, messages, add_generation_prompt=True) == render_prompt(trained, messages, True)
        conversation = _rendered(exported, CONVERSATION)
        assert conversation[0] == trained.bos_token_id and conversation[-1] == trained.eos_token_id
    assert "does not write" not in caplog.text
    # A template that no BOS in front can make tokenize as training did is left as it is, with a warning.
    odd = AutoTokenizer.from_pretrained(stories260k)
    odd.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    odd.bos_token = "Tim"  # a "BOS" whose text reads as other ids
    assert exported_chat_template(odd, bos=True, eos=False) == odd.chat_template
    assert "does not write the BOS that data.add_bos put in front" in caplog.text
    # One whose turns start otherwise (SQuAD's "Context: ..." and " Question: ..."): neither front
    # gives both prompts their training ids (the one of a user's prompt was taken, and the warning
    # named a missing BOS where a space was missing); the space goes where the text has none.
    caplog.clear()
    squad = AutoTokenizer.from_pretrained(stories260k)
    squad.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ 'Context: ' + m['content'] }}"
                           "{% elif m['role'] == 'user' %}{{ ' Question: ' + m['content'] + ' Answer:' }}{% endif %}"
                           "{% endfor %}")
    exported = AutoTokenizer.from_pretrained(stories260k)
    exported.chat_template = exported_chat_template(squad, bos=True, eos=False)
    assert _rendered(exported, PROMPT, add_generation_prompt=True) == render_prompt(squad, PROMPT, True)
    system = [{"role": "system", "content": "The sky is blue."}, *PROMPT]
    assert _rendered(exported, system, add_generation_prompt=True) == render_prompt(squad, system, True)
    assert "does not write" not in caplog.text
    assert exported_chat_template(exported, bos=True, eos=False) == exported.chat_template  # exported as it is


def test_an_export_of_a_tokenizer_without_a_pad_token_holds_the_eos_it_padded_with(tmp_path):
    # The run pads with EOS (load_tokenizer) and config.json says so; the exported tokenizer said
    # nothing, and transformers' padding=True then failed on the export (a reward model's, scoring batches).
    from types import SimpleNamespace

    from posttrain.policy.fsdp_worker import FSDPPolicyWorker

    tok = AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny"))
    tok.pad_token = None
    worker = SimpleNamespace(tokenizer=tok, _export_template=tok.chat_template)
    worker._exported_tokenizer = lambda: FSDPPolicyWorker._exported_tokenizer(worker)
    FSDPPolicyWorker._save_tokenizer(worker, tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token == tok.eos_token == "<|end|>"
    assert tok.pad_token is None  # the worker's own is left as loaded
