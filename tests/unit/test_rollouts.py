"""Prompt rendering of rollouts agrees token for token with how training rows are built."""

import pytest

from posttrain.data.processors import tokenize_messages
from posttrain.embedded import build_tokenizer
from posttrain.rollouts import _observation_tokens, render_prompt, run_rollouts


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("add_bos", [True, False])
def test_generation_prompt_is_the_prefix_of_the_training_row(tok, add_bos, add_generation_prompt):
    prompt = [{"role": "user", "content": "07+38="}]
    row = tokenize_messages(prompt + [{"role": "assistant", "content": "045"}], tok, add_bos=add_bos, add_eos=True,
                            add_generation_prompt=add_generation_prompt)
    ids = render_prompt(tok, prompt, add_bos, add_generation_prompt=add_generation_prompt)
    # The model is asked exactly what it was trained on; the loss starts right after it.
    assert row["input_ids"][: len(ids)] == ids
    assert row["loss_mask"][: len(ids)] == [0] * len(ids)
    assert row["loss_mask"][len(ids):] == [1] * (len(row["input_ids"]) - len(ids))
    # data.add_generation_prompt: the prompt ends with the <|assistant|> header, or the model writes it.
    header = "<|assistant|>" if not add_generation_prompt else ""
    assert tok.decode(row["input_ids"][len(ids):]) == header + "045<|end|>"
    assert tok.decode(ids).endswith("<|assistant|>") is add_generation_prompt
    assert (ids[0] == tok.bos_token_id) is add_bos


# Turns separated by newlines, which sentencepiece writes as byte tokens of their own: the whole
# conversation's tokens split at every turn.
NEWLINE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
)


def test_sentencepiece_rows_and_observations_are_the_conversations_tokens(stories260k):
    # A sentencepiece tokenizer writes a space before the start of every text it encodes: each
    # message encoded on its own got one ("\u2581assistant", "\u2581Lily"), so SFT rows were not the
    # prompt the model is asked in GRPO and eval followed by its answer, and trained it to open
    # every answer with a space; multi-turn observations got one too.
    from transformers import AutoTokenizer

    sp = AutoTokenizer.from_pretrained(stories260k)
    sp.chat_template = NEWLINE_TEMPLATE
    prompt = [{"role": "user", "content": "Once upon a time"}]
    convo = prompt + [{"role": "assistant", "content": "Lily said hi."}]
    row = tokenize_messages(convo, sp, add_bos=True, add_eos=True)
    whole = sp(sp.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == [sp.bos_token_id, *whole, sp.eos_token_id]
    ids = render_prompt(sp, prompt)
    assert row["input_ids"][: len(ids)] == ids and row["loss_mask"][: len(ids)] == [0] * len(ids)
    assert sp.convert_ids_to_tokens(row["input_ids"][len(ids)])[0] != "\u2581"  # "Lily", not " Lily"
    # The next turn of a rollout that stopped after the answer: the turn's closing newline, the
    # observation and the generation prompt continue the conversation's tokens.
    answer = row["input_ids"][len(ids):-2]  # without the template's closing newline and the EOS
    obs = [{"role": "user", "content": "And then?"}]
    next_turn = _observation_tokens(sp, convo, obs, last_token=answer[-1])
    assert ids + answer + next_turn == render_prompt(sp, convo + obs)


def test_observation_tokens_continue_the_conversation(tok):
    before = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "up"}]
    eos = tok.eos_token_id  # the model ended its turn itself
    obs = _observation_tokens(tok, before, [{"role": "environment", "content": "Board"}], last_token=eos)
    # An environment message is shown as a user turn, followed by the next generation prompt.
    assert tok.decode(obs) == "<|user|>Board<|end|><|assistant|>"
    # data.add_generation_prompt=false: without it (the model writes its header itself).
    obs = _observation_tokens(tok, before, [{"role": "environment", "content": "Board"}], add_generation_prompt=False,
                              last_token=eos)
    assert tok.decode(obs) == "<|user|>Board<|end|>"


def test_observation_tokens_close_a_turn_cut_by_a_stop_string(tok):
    before = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "<action>up</action>"}]
    obs = [{"role": "environment", "content": "Board"}]
    stopped = tok.convert_tokens_to_ids(">")  # generation stopped at "</action>": no <|end|> yet
    assert tok.decode(_observation_tokens(tok, before, obs, last_token=stopped)) == "<|end|><|user|>Board<|end|><|assistant|>"
    assert tok.decode(_observation_tokens(tok, before, obs, last_token=tok.eos_token_id)) == "<|user|>Board<|end|><|assistant|>"
    # A template whose turns end "<|end|>\n": after the model's own <|end|> only the newline is missing.
    from posttrain.embedded import build_tokenizer

    newline_tok = build_tokenizer()
    newline_tok.chat_template = newline_tok.chat_template.replace("'<|end|>'", "'<|end|>\n'")
    assert newline_tok.decode(_observation_tokens(newline_tok, before, obs, last_token=tok.eos_token_id)) == (
        "\n<|user|>Board<|end|>\n<|assistant|>")


def test_a_turn_the_model_ended_gets_no_second_eos_where_the_template_spaces_it(tok):
    # Llama 2's template writes " " + content + " " + eos: the closing " <|end|>" does not start
    # with the model's <|end|>, and the whole of it followed, two EOS tokens no render contains.
    import copy

    spaced = copy.copy(tok)
    spaced.chat_template = tok.chat_template.replace("'<|end|>'", "' <|end|>'")
    before = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "up"}]
    obs = [{"role": "environment", "content": "Board"}]
    assert spaced.decode(_observation_tokens(spaced, before, obs, last_token=tok.eos_token_id)) == (
        "<|user|>Board <|end|><|assistant|>")
    stopped = tok.convert_tokens_to_ids("p")  # cut by a stop string: the whole closing, space and all
    assert spaced.decode(_observation_tokens(spaced, before, obs, last_token=stopped)) == (
        " <|end|><|user|>Board <|end|><|assistant|>")


class _EchoGeneration:
    """Generates `replies[k]` (the last one from then on) then <|end|> (unless `eos` is False:
    as if a stop string ended it) for every prompt of its k-th call, and records the prompts it
    was given; with `keep`, it first cuts longer prompts to their last `keep` tokens, as an
    engine does with overlong_prompt=truncate."""

    def __init__(self, tok, replies=("1",), eos=True, keep=None, truncated=False):
        self.tok, self.prompts, self.replies, self.calls, self.eos = tok, [], list(replies), 0, eos
        self.truncated = truncated  # every answer reported as cut at the token limit
        self.keep, self.prompt_truncated = keep, []
        self.stop_strings = []  # the batch's per-row stop strings of each call

    def generate(self, batch, greedy=False):
        import torch

        from posttrain.data.batch import BatchedDataDict

        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        self.stop_strings.append(batch.get("stop_strings") if "stop_strings" in batch else None)
        new = self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id] * self.eos
        rows = []
        for i in range(batch["input_ids"].shape[0]):
            prompt = batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist()
            cut = self.keep is not None and len(prompt) > self.keep
            prompt = prompt[-self.keep :] if cut else prompt
            self.prompts.append(prompt)
            self.prompt_truncated.append(cut)
            rows.append(prompt + new)
        width = max(map(len, rows))
        return BatchedDataDict(
            output_ids=torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            logprobs=torch.zeros(len(rows), width),
            generation_lengths=torch.full((len(rows),), len(new)),
            unpadded_sequence_lengths=torch.tensor([len(r) for r in rows]),
            truncated=torch.full((len(rows),), self.truncated),
            prompt_truncated=torch.tensor(self.prompt_truncated[-len(rows):]),
        )


class _OneMoreTurnEnv:
    """Asks once more after each answer until the model has answered `turns` times."""

    def __init__(self, turns=2):
        self.turns = turns

    def step(self, message_logs, metadata):
        from posttrain.environments.interfaces import EnvironmentReturn

        done = [sum(m["role"] == "assistant" for m in log) >= self.turns for log in message_logs]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "again"} for _ in message_logs],
            metadata=[{} for _ in message_logs], next_stop_strings=[None for _ in message_logs],
            rewards=[0.0] * len(message_logs), terminateds=list(done),
            answers=[None for _ in message_logs],
        )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_run_rollouts_renders_every_prompt_by_add_generation_prompt(tok, add_generation_prompt):
    gen = _EchoGeneration(tok)
    rows = [{"messages": [{"role": "user", "content": "1+0="}], "task_name": "t"}]
    run_rollouts(gen, rows, {"t": _OneMoreTurnEnv()}, tok, max_turns=2, max_seq_len=100,
                 add_generation_prompt=add_generation_prompt)
    first, second = (tok.decode(p) for p in gen.prompts)
    header = "<|assistant|>" if add_generation_prompt else ""
    # The first prompt and the one after the environment's observation follow the key alike.
    assert first == f"<s><|user|>1+0=<|end|>{header}"
    assert second == f"{first}1<|end|><|user|>again<|end|>{header}"


def test_generate_s_counts_the_engines_calls_and_not_the_environments_scoring(tok, monkeypatch):
    # GRPO's generation_tokens_per_s divides by generate_s: it divided by the whole generation
    # phase, which holds the environments' scoring (and, colocated, the refit), and understated
    # the engine's speed by as much as the scoring took.
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr("posttrain.rollouts.time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Slow(_EchoGeneration):
        def generate(self, batch, greedy=False):
            now[0] += 2.0
            return super().generate(batch, greedy)

    class SlowScoring(_OneMoreTurnEnv):
        def step(self, message_logs, metadata):
            now[0] += 5.0
            return super().step(message_logs, metadata)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(Slow(tok), rows, {"t": SlowScoring(turns=3)}, tok, max_turns=3, max_seq_len=200)
    assert result.conversations[0].turns == 3 and now[0] == 3 * (2.0 + 5.0)
    assert result.generate_s == 3 * 2.0


@pytest.mark.parametrize("eos", [True, False])
def test_multi_turn_tokens_are_the_chat_template_of_the_conversation(tok, eos):
    # Whether a turn ended with the model's EOS or at a stop string, the next turn sees the
    # conversation as the chat template renders it (as the warm-up and SFT rows are built).
    gen = _EchoGeneration(tok, replies=["<action>up</action>", "<action>left</action>"], eos=eos)
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv()}, tok, max_turns=2, max_seq_len=200)
    (conv,) = result.conversations
    second = gen.prompts[1]
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "environment", "assistant"]
    shown = [*conv.messages[:2], {"role": "user", "content": "again"}]  # an environment turn is a user turn
    assert second == render_prompt(tok, shown, add_bos=True)
    tokens = result.batch["input_ids"][0, : int(result.batch["input_lengths"][0])].tolist()
    closing = [tok.eos_token_id] if eos else []
    assert tokens == second + tok.encode("<action>left</action>", add_special_tokens=False) + closing


@pytest.mark.parametrize("eos", [True, False])
def test_multi_turn_rollouts_train_the_reasoning_a_template_drops_from_earlier_turns(qwen3_like_tok, eos):
    # Qwen3's template writes an earlier turn without its <think> block once a user turn follows.
    # The next turn's prompt continues the generated tokens, so the turn is trained on the tokens
    # it was sampled as (its reasoning included) and the logprobs of generation and training are
    # those of one sequence; only the observation and the generation prompt come from the template.
    tok = qwen3_like_tok
    replies = ["<think>\nup is free\n</think>\n\nU", "<think>\nthen left\n</think>\n\nL"]
    gen = _EchoGeneration(tok, replies=replies, eos=eos)
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv()}, tok, max_turns=2, max_seq_len=400)
    (conv,) = result.conversations
    first = tok.encode(replies[0], add_special_tokens=False) + [tok.eos_token_id] * eos
    second = tok.encode(replies[1], add_special_tokens=False) + [tok.eos_token_id] * eos
    closing = [] if eos else [tok.eos_token_id]  # a turn cut by a stop string gets the template's <|end|>
    observation = tok.encode("<|user|>again<|end|><|assistant|>", add_special_tokens=False)
    assert gen.prompts[1] == gen.prompts[0] + first + closing + observation
    tokens = result.batch["input_ids"][0, : int(result.batch["input_lengths"][0])].tolist()
    assert tokens == gen.prompts[1] + second
    mask = result.batch["token_mask"][0, : len(tokens)].tolist()
    assert [t for t, m in zip(tokens, mask) if m] == first + second
    # Re-rendered through the template, the first turn would have lost its reasoning.
    shown = [*conv.messages[:2], {"role": "user", "content": "again"}]
    assert tok.decode(render_prompt(tok, shown)) == "<s><|user|>go<|end|><|assistant|>U<|end|><|user|>again<|end|><|assistant|>"
    assert "up is free" in tok.decode(tokens)


def test_a_prompt_the_engine_truncated_keeps_its_answer_and_aligned_tokens(tok):
    # overlong_prompt=truncate: the engine's output holds the cut prompt and then the answer. The
    # answer was read at the uncut prompt's length: eval scored an empty response, and GRPO's loss
    # mask (one 1 per generated token) no longer lined up with the tokens.
    gen = _EchoGeneration(tok, replies=["42"], keep=10)
    rows = [{"messages": [{"role": "user", "content": "a long question " * 4}], "task_name": "t"},
            {"messages": [{"role": "user", "content": "1+0="}], "task_name": "t"}]
    full = [render_prompt(tok, r["messages"]) for r in rows]
    assert len(full[0]) > 10 and len(full[1]) <= 10
    result = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv()}, tok, max_turns=1, max_seq_len=100)
    answer = tok.encode("42", add_special_tokens=False) + [tok.eos_token_id]
    cut, whole = result.conversations
    assert (cut.response, cut.prompt_truncated, cut.prompt_length) == ("42", True, 10)
    assert cut.tokens == full[0][-10:] + answer and cut.generated_mask == [0] * 10 + [1] * len(answer)
    assert (whole.response, whole.prompt_truncated, whole.tokens) == ("42", False, full[1] + answer)
    assert result.metrics["prompt_truncated"] == 1  # counted in the step's metrics, as eval counts it
    b = result.batch
    assert b["input_lengths"].tolist() == [10 + len(answer), len(full[1]) + len(answer)]
    assert b["token_mask"][0, : 10 + len(answer)].tolist() == cut.generated_mask


# Mistral's and Gemma's way: only user and assistant turns, alternating, else the template raises.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def test_a_template_of_alternating_turns_renders_every_observation_as_a_user_turn():
    # The second observation was rendered after the first kept as an "environment" message, which
    # such a template refuses: every rollout of three turns or more stopped with a TemplateError.
    from posttrain.embedded import build_tokenizer

    strict = build_tokenizer()
    strict.chat_template = STRICT_TEMPLATE
    gen = _EchoGeneration(strict, replies=["up", "left", "down"])
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    (conv,) = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv(turns=3)}, strict, max_turns=3,
                           max_seq_len=200).conversations
    assert [m["role"] for m in conv.exchange] == ["assistant", "environment", "assistant", "environment", "assistant"]
    assert strict.decode(gen.prompts[2]) == ("<s><|user|>go<|end|><|assistant|>up<|end|><|user|>again<|end|>"
                                             "<|assistant|>left<|end|><|user|>again<|end|><|assistant|>")
    assert conv.response == "up\nleft\ndown"


def test_conversation_separates_the_prompt_from_the_exchange(tok):
    # What samples.jsonl and the validation table show: the question (not the system prompt),
    # and every model turn after the prompt (not only the last message).
    gen = _EchoGeneration(tok, replies=["up", "left"])
    rows = [{"messages": [{"role": "system", "content": "Play."}, {"role": "user", "content": "go"}],
             "task_name": "t"}]
    (conv,) = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv()}, tok, max_turns=2, max_seq_len=200).conversations
    assert conv.question == "go"
    assert conv.response == "up\nleft"
    assert [m["content"] for m in conv.exchange] == ["up", "again", "left"]


@pytest.fixture
def calc(tmp_path):
    """The `calc` environment's config (exact answer, an `add` tool) and a built environment."""
    from posttrain.environments import resolve_env
    from posttrain.schemas import EnvConfig

    (tmp_path / "calc.py").write_text(
        "def exact(response, metadata):\n    return float(response == metadata['answer'])\n\n"
        "def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n        a: one\n        b: two\n    \"\"\"\n"
        "    return a + b\n")
    env_cfg = EnvConfig.model_validate({"calc": {"target": f"{tmp_path}/calc.py:exact",
                                                 "tools": [f"{tmp_path}/calc.py:add"]}})
    return env_cfg, resolve_env("calc", env_cfg.get_worker_cfg("calc"))(env_cfg.get_worker_cfg("calc"))


def test_rollouts_with_tools_render_their_schemas_and_tool_results(tok, calc):
    # A chat template that lists the tools' names; each call's answer comes back as a tool turn of
    # its own (as templates that group a turn's tool results, e.g. Qwen2.5's, expect them).
    from posttrain.embedded import CHAT_TEMPLATE, build_tokenizer
    from posttrain.environments import with_tool_schemas

    env_cfg, env = calc
    tools_tok = build_tokenizer()
    tools_tok.chat_template = ("{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }};"
                               "{% endfor %}<|end|>{% endif %}" + CHAT_TEMPLATE)
    call = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 0}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 0}}</tool_call>')
    gen = _EchoGeneration(tools_tok, replies=[call, "1"])
    rows = with_tool_schemas([{"messages": [{"role": "user", "content": "1+0="}], "task_name": "calc",
                               "answer": "1"}], env_cfg)
    result = run_rollouts(gen, rows, {"calc": env}, tools_tok, max_turns=3, max_seq_len=400)
    first, second = (tools_tok.decode(p) for p in gen.prompts)
    assert first == "<s><|system|>add;<|end|><|user|>1+0=<|end|><|assistant|>"
    assert second == f"{first}{call}<|end|><|tool|>1<|end|><|tool|>2<|end|><|assistant|>"
    (conv,) = result.conversations
    assert conv.reward == 1.0 and conv.turns == 2 and result.metrics["tool_calls_mean"] == 1.0
    assert [m["role"] for m in conv.exchange] == ["assistant", "tool", "tool", "assistant"]
    # The calling turn carries its calls structured, and each result names the call it answers.
    # This template writes `tool_calls` after the content: the tokens keep the model's own text
    # once (the closing above has no second copy of the calls).
    calls = conv.exchange[0]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"a": 1, "b": 0}, {"a": 2, "b": 0}]
    assert [m["tool_call_id"] for m in conv.exchange[1:3]] == [c["id"] for c in calls]
    assert "tool_calls" not in conv.exchange[3]
    # Its content is what the model wrote around the calls (nothing here): kept in it, the calls were
    # in every rendering of the conversation twice (samples.jsonl, a reward model's template).
    from posttrain.data.processors import render_chat

    assert conv.exchange[0]["content"] == "" and conv.response == 'add({"a": 1, "b": 0}) add({"a": 2, "b": 0})\n1'
    rendered = render_chat(tools_tok, conv.messages, add_generation_prompt=False, tools=conv.tools)
    assert tools_tok.decode(conv.tokens).replace(" ", "") == "<s>" + rendered.replace(" ", "")  # JSON spacing aside


def test_a_call_whose_results_do_not_fit_does_not_count(tok, calc):
    # Its results never reach the model (the conversation ends at the context): counted, tool_calls_mean
    # ran ahead of the turns that had a result, by about the truncation rate.
    from posttrain.environments import with_tool_schemas

    env_cfg, env = calc
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 0}}</tool_call>'
    rows = with_tool_schemas([{"messages": [{"role": "user", "content": "1+0="}], "task_name": "calc",
                               "answer": "1"}], env_cfg)
    (fits,) = run_rollouts(_EchoGeneration(tok, replies=[call, "1"]), rows, {"calc": env}, tok, max_turns=3,
                           max_seq_len=400).conversations
    assert fits.metadata["tool_calls"] == 1 and fits.stop_reason == "environment"
    first_turn_end = fits.generated_mask.index(0, fits.prompt_length)  # where the tool result starts
    result = run_rollouts(_EchoGeneration(tok, replies=[call, "1"]), rows, {"calc": env}, tok, max_turns=3,
                          max_seq_len=first_turn_end + 2)
    (cut,) = result.conversations
    assert (cut.stop_reason, cut.turns, cut.metadata["tool_calls"]) == ("context", 1, 0)
    assert result.metrics["tool_calls_mean"] == 0.0


def test_a_chat_template_without_the_tool_role_fails_at_setup_naming_the_task(tok, calc):
    from posttrain.config import InputError
    from posttrain.embedded import CHAT_TEMPLATE, build_tokenizer
    from posttrain.environments import with_tool_schemas
    from posttrain.rollouts import check_tool_turns

    env_cfg, _ = calc
    rows = with_tool_schemas([{"messages": [{"role": "user", "content": "1+0="}], "task_name": "calc"}], env_cfg)
    check_tool_turns(tok, rows)  # the embedded template shows tool results
    strict = build_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
                            "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% endfor %}"
                            + CHAT_TEMPLATE)
    with pytest.raises(InputError, match=r"^environment 'calc' has tools, but the tokenizer's chat template cannot "
                                         r"render a tool result after a tool call \(TemplateError: roles must alternate"):
        check_tool_turns(strict, rows)
    check_tool_turns(strict, [{**rows[0], "tools": None}])  # no tools: no tool turn to render


# Tool calls as Mistral's templates treat them, in a template of this test's own: a calling turn
# is rendered from its structured `tool_calls` (not its content), every call and result needs a
# 9-character id, and a result must answer a call of the turn before it.
_STRICT_TOOL_TEMPLATE = (
    "{%- set ns = namespace(ids='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|user|>{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] is defined -%}<|assistant|>[CALLS]"
    "{%- set ns.ids = '' -%}"
    "{%- for c in m['tool_calls'] -%}"
    "{%- if c['id'] is not defined or c['id'] | length != 9 -%}{{ raise_exception('call ids have 9 characters') }}"
    "{%- endif -%}{%- set ns.ids = ns.ids + c['id'] + ',' -%}"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments'], 'id': c['id']} | tojson }}"
    "{%- endfor -%}<|end|>"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|>{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if m['tool_call_id'] is not defined or (m['tool_call_id'] + ',') not in ns.ids -%}"
    "{{ raise_exception('a tool result must answer a call of the turn before') }}{%- endif -%}"
    "[RESULT]{{ m['tool_call_id'] }}={{ m['content'] }}[/RESULT]"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def test_rollouts_with_tools_under_a_template_that_needs_call_ids(calc):
    from posttrain.embedded import build_tokenizer
    from posttrain.environments import with_tool_schemas

    env_cfg, env = calc
    strict = build_tokenizer()
    strict.chat_template = _STRICT_TOOL_TEMPLATE
    # The model writes Mistral's bare JSON list, the first call with an id of its own.
    call = '[{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "Ab3dE6gH9"}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    gen = _EchoGeneration(strict, replies=[call, "3"])
    rows = with_tool_schemas([{"messages": [{"role": "user", "content": "1+2="}], "task_name": "calc",
                               "answer": "3"}], env_cfg)
    result = run_rollouts(gen, rows, {"calc": env}, strict, max_turns=3, max_seq_len=600)
    (conv,) = result.conversations
    ids = [c["id"] for c in conv.exchange[0]["tool_calls"]]
    assert ids[0] == "Ab3dE6gH9" and len(ids[1]) == 9 and ids[1].isalnum()
    first, second = (strict.decode(p) for p in gen.prompts)
    # The model's turn stays its own tokens; the results follow it as the template renders them.
    assert second == f"{first}{call}<|end|>[RESULT]{ids[0]}=3[/RESULT][RESULT]{ids[1]}=7[/RESULT]<|assistant|>"
    assert conv.reward == 1.0 and conv.turns == 2 and conv.env_errors == 0
    # Without the structured calls the template refuses the conversation.
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conv.messages]
    with pytest.raises(Exception, match="must answer a call"):
        strict.apply_chat_template(bare, tokenize=False)


def test_a_template_that_refuses_the_structured_calls_gets_the_turn_as_written(calc):
    # As Llama 3.1's template: one structured call per turn, else it raises.
    from posttrain.embedded import CHAT_TEMPLATE, build_tokenizer
    from posttrain.environments import with_tool_schemas

    env_cfg, env = calc
    one_call = build_tokenizer()
    one_call.chat_template = ("{%- for m in messages -%}{%- if m['tool_calls'] is defined and m['tool_calls'] | length"
                              " != 1 -%}{{ raise_exception('only single tool calls') }}{%- endif -%}{%- endfor -%}"
                              + CHAT_TEMPLATE)
    single = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    double = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "parameters": {"a": 0, "b": 3}}]'
    convs = []
    for reply in (single, double):
        gen = _EchoGeneration(one_call, replies=[reply, "3"])
        rows = with_tool_schemas([{"messages": [{"role": "user", "content": "1+2="}], "task_name": "calc",
                                   "answer": "3"}], env_cfg)
        (conv,) = run_rollouts(gen, rows, {"calc": env}, one_call, max_turns=3, max_seq_len=600).conversations
        first, second = (one_call.decode(p) for p in gen.prompts)
        results = "".join(f"<|tool|>{r}<|end|>" for r in (["3"] if reply == single else ["3", "3"]))
        assert second == f"{first}{reply}<|end|>{results}<|assistant|>"
        assert conv.reward == 1.0 and conv.turns == 2
        convs.append(conv)
    assert len(convs[0].exchange[0]["tool_calls"]) == 1
    assert "tool_calls" not in convs[1].exchange[0]  # the template refused two: the turn as written
    assert all("tool_call_id" in m for m in convs[1].exchange[1:3])


def test_environments_get_each_samples_tokens_and_the_runs_progress(tok):
    # What TRL reward functions read as completion_ids and trainer_state; none of it stays in
    # the conversation's metadata, while the metrics an environment reports are averaged.
    from posttrain.environments.interfaces import (
        ENV_METRICS_KEY,
        ROLLOUT_KEY,
        EnvironmentReturn,
    )

    seen = []

    class Recording:
        def step(self, message_logs, metadata):
            seen.append([m[ROLLOUT_KEY] for m in metadata])
            n = len(metadata)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "again"}] * n,
                metadata=[{**m, ENV_METRICS_KEY: {"turn": float(len(seen))}} for m in metadata],
                next_stop_strings=[None] * n, rewards=[0.0] * n,
                terminateds=[len(seen) == 2] * n, answers=[None] * n)

    gen = _EchoGeneration(tok, replies=["12", "3"])
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(gen, rows, {"t": Recording()}, tok, max_turns=2, max_seq_len=100, global_step=7, max_steps=9)
    first, second = (s[0] for s in seen)
    answer = tok.encode("12", add_special_tokens=False) + [tok.eos_token_id]
    assert first == {"completion_ids": answer, "global_step": 7, "max_steps": 9, "last_turn": False,
                     "tokens_left": 100 - len(render_prompt(tok, rows[0]["messages"])) - len(answer)}
    # The second turn's ids run from the end of the prompt: the first answer, the observation, the second answer.
    (conv,) = result.conversations
    assert second["completion_ids"] == conv.tokens[conv.prompt_length:] and len(second["completion_ids"]) > 6
    assert second["last_turn"] is True  # max_turns=2: the conversation ends after it whatever the environment says
    assert ROLLOUT_KEY not in conv.metadata and result.metrics["env/turn"] == 2.0


def test_an_observation_without_a_role_is_the_environments(tok):
    # The environment contract takes any message with a content; one without a role was kept
    # as it came, and the step stopped after its generation where the logs read the model's turns.
    class NoRole(_OneMoreTurnEnv):
        def step(self, message_logs, metadata):
            ret = super().step(message_logs, metadata)
            ret.observations = [{"content": "again"} for _ in message_logs]
            return ret

    gen = _EchoGeneration(tok, replies=["up", "left"])
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    (conv,) = run_rollouts(gen, rows, {"t": NoRole()}, tok, max_turns=2, max_seq_len=200).conversations
    assert conv.exchange[1] == {"role": "environment", "content": "again"} and conv.response == "up\nleft"
    assert tok.decode(gen.prompts[1]) == "<s><|user|>go<|end|><|assistant|>up<|end|><|user|>again<|end|><|assistant|>"


def test_an_answer_cut_at_the_token_limit_is_the_environments_last_turn(tok):
    # The conversation ends after a truncated answer whatever the environment says; told it was
    # not the last turn, the code environment (reward: fraction, max_attempts: 2) held back the
    # attempt's score for a retry that never came, and the sample scored 0 for 1 of 2 tests passed.
    from posttrain.environments.code import CodeEnvironment
    from posttrain.schemas import EnvWorkerConfig

    env = CodeEnvironment(EnvWorkerConfig(cfg={"reward": "fraction", "max_attempts": 2}))
    gen = _EchoGeneration(tok, replies=["x = 1"], truncated=True)
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "code",
             "metadata": {"tests": ["assert x == 1", "assert x == 2"]}}]
    result = run_rollouts(gen, rows, {"code": env}, tok, max_turns=2, max_seq_len=200)
    (conv,) = result.conversations
    assert (conv.turns, conv.truncated, conv.metadata["code_attempt"]) == (1, True, 1)
    assert conv.reward == 0.5 and result.batch["rewards"].tolist() == [0.5]
    # The code environment now scores every attempt (its turns add up to the last one's score),
    # so it passes without last_turn too: an environment that scores only on its last turn, as
    # docs/environments.md has it, is what still needs last_turn for a truncated answer.
    from posttrain.environments import PerSampleEnvironment, StepResult
    from posttrain.environments.interfaces import ROLLOUT_KEY

    class ScoresOnItsLastTurn(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            last = metadata[ROLLOUT_KEY]["last_turn"]
            return StepResult(observation="again", reward=0.5 if last else 0.0, terminated=last, metadata=metadata)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "held"}]
    result = run_rollouts(_EchoGeneration(tok, replies=["x"], truncated=True), rows,
                          {"held": ScoresOnItsLastTurn()}, tok, max_turns=2, max_seq_len=200)
    (conv,) = result.conversations
    assert (conv.turns, conv.truncated, conv.reward) == (1, True, 0.5)


def test_each_conversation_says_why_it_ended_and_environments_see_the_context_left(tok):
    from posttrain.environments import PerSampleEnvironment, StepResult
    from posttrain.environments.interfaces import ROLLOUT_KEY

    seen = []

    class Game(PerSampleEnvironment):  # ends at "stop"; otherwise a long observation
        def step_one(self, messages, metadata):
            seen.append(metadata[ROLLOUT_KEY]["tokens_left"])
            done = messages[-1]["content"] == "stop"
            return StepResult(observation="board " * metadata["obs_words"], reward=0.0, terminated=done,
                              metadata=metadata)

    def ended(reply, max_seq_len, obs_words=2, truncated=False):
        rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "g", "metadata": {"obs_words": obs_words}}]
        seen.clear()
        conv, = run_rollouts(_EchoGeneration(tok, replies=[reply], truncated=truncated), rows, {"g": Game()}, tok,
                             max_turns=3, max_seq_len=max_seq_len).conversations
        return conv.stop_reason, conv.turns, conv.truncated

    assert ended("stop", 200) == ("environment", 1, False)
    assert ended("go on", 200) == ("max_turns", 3, False)
    assert ended("go on", 200, truncated=True) == ("max_new_tokens", 1, True)
    # Cut, and ended by the environment (as a single-turn one ends every conversation): the cut says why.
    assert ended("stop", 200, truncated=True) == ("max_new_tokens", 1, True)
    # The next observation does not fit: the environment was not told it was the last turn (it
    # cannot be, before it answers), but it saw how much room was left.
    reason, turns, truncated = ended("go on", 60, obs_words=30)
    assert (reason, turns, truncated) == ("context", 1, True)
    prompt = len(render_prompt(tok, [{"role": "user", "content": "go"}]))
    assert seen == [60 - prompt - len(tok.encode("go on", add_special_tokens=False)) - 1]


def test_the_context_ends_a_conversation_that_fills_it_exactly(tok):
    go = [{"role": "user", "content": "go"}]
    rows = [{"messages": go, "task_name": "t"}]

    def run(max_seq_len, **kw):
        gen = _EchoGeneration(tok, **kw)
        result = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv(turns=3)}, tok, max_turns=3, max_seq_len=max_seq_len)
        return gen, result.conversations[0]

    gen, _ = run(500)
    first_turn = len(gen.prompts[0]) + len(tok.encode("1", add_special_tokens=False)) + 1  # and <|end|>
    # An observation that fills the context leaves no room to answer: the conversation ends there
    # (it went on to a turn of no tokens).
    _, conv = run(len(gen.prompts[1]))
    assert (conv.turns, conv.stop_reason, conv.truncated, len(conv.tokens)) == (1, "context", True, first_turn)
    # An answer cut where it reaches the context was cut by the context, not by max_new_tokens.
    _, conv = run(first_turn, truncated=True)
    assert (conv.turns, conv.stop_reason, len(conv.tokens)) == (1, "context", first_turn)


def test_a_multi_turn_samples_response_length_counts_every_turn(tok):
    # DAPO's overlong shaping reads it: counting the last turn alone, a long conversation of short
    # last answers was never penalised.
    gen = _EchoGeneration(tok, replies=["1", "2 3 4"])
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    batch = run_rollouts(gen, rows, {"t": _OneMoreTurnEnv(turns=2)}, tok, max_turns=2, max_seq_len=200).batch
    enc = lambda text: len(tok.encode(text, add_special_tokens=False)) + 1  # noqa: E731 - and <|end|>
    assert batch["response_lengths"].tolist() == [enc("1") + enc("2 3 4")] == [batch["token_mask"].sum().item()]


def test_an_answer_ended_with_eos_leaves_the_templates_closing_text_out_of_its_message():
    # The model writes "{{ content }}\n\n" and EOS, as trained; kept in the message, the "\n\n" was
    # written twice by every render of the conversation: a reward model scored text laid out
    # unlike its training data.
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n\nA: "
                         "{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "hi"}], "task_name": "t"}]
    for reply, eos, content in (("Hi there.\n\n", True, "Hi there."), ("Hi there.\n\n", False, "Hi there.\n\n"),
                                ("Hi there.", True, "Hi there.")):
        conv, = run_rollouts(_EchoGeneration(tok, replies=[reply], eos=eos), rows, {"t": _OneMoreTurnEnv(1)}, tok,
                             max_turns=1, max_seq_len=200).conversations
        assert conv.messages[-1] == {"role": "assistant", "content": content}  # a stop string's cut: as written
        assert tok.decode(conv.tokens[conv.prompt_length:], skip_special_tokens=True) == reply  # trained as generated
    # The next turn follows its EOS: the model wrote the closing "\n\n" before it (a second one followed
    # the EOS, in no render); one that did not gets it after the EOS, as before.
    for reply, between in (("Hi there.\n\n", "Hi there.\n\n<|end|>Q: "), ("Hi there.", "Hi there.<|end|>\n\nQ: ")):
        conv, = run_rollouts(_EchoGeneration(tok, replies=[reply]), rows, {"t": _OneMoreTurnEnv(2)}, tok,
                             max_turns=2, max_seq_len=200).conversations
        assert tok.decode(conv.tokens) == f"<s>Q: hi\n\nA: {between}again\n\nA: {reply}<|end|>"
    # The embedded template's turn ends with its EOS itself: nothing to leave out.
    conv, = run_rollouts(_EchoGeneration(build_tokenizer(), replies=["4\n"]), rows, {"t": _OneMoreTurnEnv(1)},
                         build_tokenizer(), max_turns=1, max_seq_len=200).conversations
    assert conv.messages[-1]["content"] == "4\n"


def test_a_rows_stop_strings_hold_for_every_turn_unless_the_environment_sets_others(tok):
    from posttrain.environments.interfaces import EnvironmentReturn

    class SetsStopsForB:
        def step(self, message_logs, metadata):
            n = len(metadata)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "again"}] * n, metadata=metadata,
                next_stop_strings=[["</b>"] if m["name"] == "b" else None for m in metadata],
                rewards=[0.0] * n, terminateds=[False] * n, answers=[None] * n)

    gen = _EchoGeneration(tok)
    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t", "stop_strings": ["</a>"],
             "metadata": {"name": name}} for name in ("a", "b")]
    run_rollouts(gen, rows, {"t": SetsStopsForB()}, tok, max_turns=3, max_seq_len=200)
    assert gen.stop_strings == [[["</a>"], ["</a>"]], [["</a>"], ["</b>"]], [["</a>"], ["</b>"]]]


@pytest.mark.parametrize("echo", [True, False])
def test_an_error_of_one_turn_is_counted_once_and_kept_in_the_samples_metadata(tok, echo):
    from posttrain.environments.interfaces import ENV_ERROR_KEY, EnvironmentReturn

    class FailsOnTurnOne:
        """Turn 1: an error for every sample (the conversation goes on); later turns: the metadata
        as it came (`echo`) or None."""

        turn = 0

        def step(self, message_logs, metadata):
            self.turn += 1
            n = len(metadata)
            assert all(ENV_ERROR_KEY not in m for m in metadata)
            meta = ([{**m, ENV_ERROR_KEY: "verifier crashed"} for m in metadata] if self.turn == 1
                    else list(metadata) if echo else [None] * n)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "again"}] * n, metadata=meta,
                next_stop_strings=[None] * n, rewards=[0.0] * n,
                terminateds=[False] * n, answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(_EchoGeneration(tok), rows, {"t": FailsOnTurnOne()}, tok, max_turns=3, max_seq_len=200)
    (conv,) = result.conversations
    assert conv.env_errors == 1 and result.metrics["env_errors"] == 1
    assert conv.metadata[ENV_ERROR_KEY] == "verifier crashed" == conv.env_error  # samples.jsonl's


def test_a_failed_verification_scores_the_sample_0_whatever_its_earlier_turns_earned(tok):
    from posttrain.environments.interfaces import ENV_ERROR_KEY, EnvironmentReturn

    class HalfThenCrash:
        """Turn 1: reward 0.5, the conversation goes on; turn 2: the verifier fails."""

        turn = 0

        def step(self, message_logs, metadata):
            self.turn += 1
            n = len(metadata)
            meta = [dict(m) for m in metadata] if self.turn == 1 else [{**m, ENV_ERROR_KEY: "boom"} for m in metadata]
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "again"}] * n, metadata=meta,
                next_stop_strings=[None] * n, rewards=[0.5 if self.turn == 1 else 0.0] * n,
                terminateds=[self.turn > 1] * n, answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    result = run_rollouts(_EchoGeneration(tok), rows, {"t": HalfThenCrash()}, tok, max_turns=3, max_seq_len=200)
    assert result.batch["rewards"].tolist() == [0.0] and result.batch["env_errors"].tolist() == [True]


@pytest.mark.parametrize("content", [[{"type": "text", "text": "again"}], None])
def test_an_observation_the_chat_template_cannot_write_scores_0_and_the_rollout_goes_on(tok, content):
    from posttrain.environments.interfaces import ENV_ERROR_KEY, EnvironmentReturn

    class OddContent:
        def step(self, message_logs, metadata):
            n = len(metadata)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": content if m["i"] == 0 else "again"} for m in metadata],
                metadata=[dict(m) for m in metadata], next_stop_strings=[None] * n, rewards=[1.0] * n,
                terminateds=[False] * n, answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t", "metadata": {"i": i}} for i in range(2)]
    result = run_rollouts(_EchoGeneration(tok), rows, {"t": OddContent()}, tok, max_turns=2, max_seq_len=200)
    bad, good = result.conversations
    assert result.batch["rewards"].tolist() == [0.0, 2.0] and result.batch["env_errors"].tolist() == [True, False]
    assert bad.turns == 1 and good.turns == 2
    assert "cannot render its observation" in bad.metadata[ENV_ERROR_KEY]


def test_an_observation_with_a_lone_surrogate_reaches_the_model_escaped(tok):
    # The model's own text echoed back (a program's exception, a tool's error naming the argument
    # it wrote) held "\ud800", which no tokenizer encodes: the sample became an environment error.
    from posttrain.environments.interfaces import EnvironmentReturn

    class Echo:
        def step(self, message_logs, metadata):
            n = len(metadata)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "ValueError: \ud800 bad"}] * n,
                metadata=[dict(m) for m in metadata], next_stop_strings=[None] * n, rewards=[0.0] * n,
                terminateds=[False] * n, answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t"}]
    (conv,) = run_rollouts(_EchoGeneration(tok), rows, {"t": Echo()}, tok, max_turns=2, max_seq_len=200).conversations
    assert conv.env_errors == 0 and conv.turns == 2
    assert conv.messages[2]["content"] == "ValueError: \\ud800 bad"


def test_grpo_prompts_longer_than_the_input_cap_follow_data_truncation(tok):
    # data.max_input_seq_length (NeMo RL's prompt limit) was ignored by GRPO: prompts up to the
    # context were generated from. Below the context it bounds the prompts, as truncation says.
    from posttrain.algorithms.grpo import _fit_prompts
    from posttrain.config import InputError, load_config
    from posttrain.rollouts import PROMPT_IDS_KEY

    rows = [{"messages": [{"role": "user", "content": "1" * k + "="}], "task_name": "t"} for k in (2, 8, 20)]
    lengths = [len(render_prompt(tok, r["messages"], True, add_generation_prompt=True)) for r in rows]
    cap = lengths[1]  # the second prompt fits exactly, the third does not
    assert lengths[0] < cap < lengths[2] < 63
    cfg = load_config("grpo", None, ["policy.max_total_sequence_length=64", "data.truncation=drop",
                                     f"data.max_input_seq_length={cap}"])
    kept, dropped = _fit_prompts(rows, tok, cfg, "train")
    assert dropped == 1 and [len(r[PROMPT_IDS_KEY]) for r in kept] == lengths[:2]
    with pytest.raises(InputError, match=rf"^train row 3: the prompt is {lengths[2]} tokens, more than "
                                         rf"data.max_input_seq_length={cap} allows; set data.truncation=drop"):
        _fit_prompts(rows, tok, cfg.model_copy(update={"data": cfg.data.model_copy(update={"truncation": "error"})}),
                     "train")
    with pytest.raises(InputError, match=rf"no train rows left: all 1 prompts are more tokens than "
                                         rf"data.max_input_seq_length={cap} allows"):
        _fit_prompts(rows[2:], tok, cfg, "train")
    # At or above the context the context bounds the prompts, as without the cap.
    wide = load_config("grpo", None, ["policy.max_total_sequence_length=64", "data.max_input_seq_length=64"])
    assert _fit_prompts(rows, tok, wide, "train")[1] == 0


def test_prompts_rendered_at_setup_are_reused_by_every_step(tok):
    from posttrain.algorithms.grpo import _fit_prompts
    from posttrain.config import InputError, load_config
    from posttrain.rollouts import PROMPT_IDS_KEY

    cfg = load_config("grpo", None, ["policy.max_total_sequence_length=12", "data.truncation=drop"])
    rows = [{"messages": [{"role": "user", "content": "1+0="}], "task_name": "t"},
            {"messages": [{"role": "user", "content": "1234567890+1234567890="}], "task_name": "t"}]
    kept, dropped = _fit_prompts(rows, tok, cfg, "train")
    # Kept rows carry the tokens the chat template gives; the over-long prompt is dropped.
    assert dropped == 1 and len(kept) == 1
    # A prompt the chat template refuses is named (1-based, with its roles), not a bare TemplateError.
    refusing = build_tokenizer()
    refusing.chat_template = "{{ raise_exception('no system role') if messages[0]['role'] == 'system' else 'x' }}"
    system = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "task_name": "t"}
    with pytest.raises(InputError, match=r"^train row 2 \(roles system, user\): the chat template rejects it: no system"):
        _fit_prompts([rows[0], system], refusing, cfg, "train")
    assert list(kept[0][PROMPT_IDS_KEY]) == render_prompt(tok, rows[0]["messages"], cfg.data.add_bos,
                                                          add_generation_prompt=cfg.data.add_generation_prompt)
    # A step starts its conversations from the stored tokens, not from a new rendering.
    stored = [tok.bos_token_id, *tok.encode("9+9=", add_special_tokens=False)]
    gen = _EchoGeneration(tok)
    result = run_rollouts(gen, [{**kept[0], PROMPT_IDS_KEY: stored}], {"t": _OneMoreTurnEnv()}, tok, max_turns=1,
                          max_seq_len=100)
    assert gen.prompts == [stored]
    assert result.conversations[0].tokens[: len(stored)] == stored


def test_step_accuracy_is_over_the_same_conversations_as_the_reward():
    # With dynamic sampling a step's conversations come from several generation rounds. The
    # accuracy was the share over the rows kept for training, without the groups dropped for
    # equal rewards, beside a reward over all of them (0.4375 and 0.375 for 0/1 rewards).
    from posttrain.rollouts import Conversation, summarize_rollouts

    rewards = [1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0, -1.0]  # a first round's all-correct group, then a mixed one
    verdicts = [True, True, True, True, False, False, False, False]  # 0.5: partial credit, not correct
    convs = [Conversation(messages=[], metadata={}, task_name="t", tokens=[], prompt_length=0, reward=r, correct=v)
             for r, v in zip(rewards, verdicts)]
    metrics = summarize_rollouts(convs)
    assert metrics["accuracy"] == 4 / 8 and metrics["reward"] == 3.5 / 8


def test_rollouts_of_several_environments_are_summarised_per_environment_too():
    from posttrain.rollouts import Conversation, summarize_rollouts

    rows = [("math", 1.0, True), ("math", 0.0, False), ("math", 1.0, True), ("story", 0.25, None), ("story", 0.75, None)]
    convs = [Conversation(messages=[], metadata={}, task_name=t, tokens=[], prompt_length=0, reward=r, correct=v)
             for t, r, v in rows]
    metrics = summarize_rollouts(convs)
    assert metrics["task_reward/math"] == pytest.approx(2 / 3) and metrics["task_accuracy/math"] == pytest.approx(2 / 3)
    assert metrics["task_reward/story"] == 0.5 and "task_accuracy/story" not in metrics  # nothing judged
    assert metrics["reward"] == pytest.approx(3 / 5) and metrics["accuracy"] == pytest.approx(2 / 3)
    # One environment: its numbers are the step's own, not repeated.
    assert not any(k.startswith("task_") for k in summarize_rollouts(convs[:3]))


def test_env_metrics_average_the_samples_that_report_a_number():
    # A sample's None ("not measured here") or text stopped the driver with a TypeError in the sum.
    import numpy as np
    import torch

    from posttrain.rollouts import Conversation, summarize_rollouts

    values = [2, np.float32(4.0), torch.tensor(6.0), None, "n/a"]
    convs = [Conversation(messages=[], metadata={"env_metrics": {"moves": v}}, task_name="t", tokens=[],
                          prompt_length=0, reward=0.0) for v in values]
    metrics = summarize_rollouts(convs)
    assert metrics["env/moves"] == 4.0 and type(metrics["env/moves"]) is float
    # The same for reward components and tool-call counts a custom environment class writes
    # (text there, or a list of its calls, stopped the driver too); a mapping key holding no
    # mapping counts nothing.
    meta = [{"reward_components": {"fmt": 1.0}, "tool_calls": 2}, {"reward_components": {"fmt": "ok"}},
            {"reward_components": ["fmt"], "tool_calls": [{"name": "add"}]}, {"env_metrics": 3}]
    convs = [Conversation(messages=[], metadata=m, task_name="t", tokens=[], prompt_length=0, reward=0.0,
                          tools=[{"name": "add"}]) for m in meta]
    metrics = summarize_rollouts(convs)
    assert metrics["reward/fmt"] == 1.0 and metrics["tool_calls_mean"] == 0.5
    assert not any(k.startswith("env/") for k in metrics)


@pytest.mark.parametrize("mask", [True, False])
def test_a_sample_whose_environment_failed_leaves_the_loss_and_the_baseline(tok, mask):
    # It scores 0 and is counted; by default its 0 is no evidence against the answer, so it
    # leaves the loss and its group's baseline (grpo.mask_env_error_samples=false: a wrong answer).
    import torch

    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.config import load_config
    from posttrain.environments.interfaces import ENV_ERROR_KEY, EnvironmentReturn

    class FailsOnSecond:
        def step(self, message_logs, metadata):
            n = len(metadata)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": ""}] * n,
                metadata=[{**m, **({ENV_ERROR_KEY: "verifier crashed"} if m["i"] == 1 else {})} for m in metadata],
                next_stop_strings=[None] * n, rewards=[1.0, 0.0, 0.0, 1.0],
                terminateds=[True] * n, answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "go"}], "task_name": "t", "metadata": {"i": i}} for i in range(4)]
    result = run_rollouts(_EchoGeneration(tok), rows, {"t": FailsOnSecond()}, tok, max_turns=1, max_seq_len=100)
    batch = result.batch
    assert batch["env_errors"].tolist() == [False, True, False, False] and result.metrics["env_errors"] == 1
    batch["group_ids"] = torch.zeros(4, dtype=torch.long)
    g = load_config("grpo", None, [f"grpo.mask_env_error_samples={str(mask).lower()}", "grpo.normalize_rewards=false",
                                   "grpo.use_leave_one_out_baseline=false"]).grpo
    _rewards_to_advantages(g, batch, max_new_tokens=8)
    assert batch["sample_mask"].tolist() == ([1.0, 0.0, 1.0, 1.0] if mask else [1.0] * 4)
    # Baseline 2/3 over the three scored samples; 0.5 over all four with the failed sample's 0.
    expected = 1 - 2 / 3 if mask else 0.5
    assert batch["advantages"].max(dim=1).values.tolist()[::3] == pytest.approx([expected, expected])


# Correctness is the environment's verdict, not reward > 0: each case's first row earns partial
# credit (a positive reward), its second full credit; only the second is correct.
_PROGRAM = "```python\ndef f(x):\n    return x\n```"


def _code_case(tmp_path):
    from posttrain.environments.code import CodeEnvironment
    from posttrain.schemas import EnvWorkerConfig

    env = CodeEnvironment(EnvWorkerConfig(cfg={"reward": "fraction"}))
    half = {"tests": ["assert f(1) == 1", "assert f(2) == 3"]}  # 1 of 2 tests pass: reward 0.5
    return env, _PROGRAM, [half, {"tests": ["assert f(1) == 1", "assert f(2) == 2"]}], [0.5, 1.0]


def _story_case(tmp_path):
    from posttrain.environments.story import StoryEnvironment
    from posttrain.schemas import EnvWorkerConfig

    env = StoryEnvironment(EnvWorkerConfig(cfg={"min_mentions": 3}))
    # One mention of the cat (reward 1/3), three of the dog (1).
    return env, "The dog saw a dog, a dog and a cat.", [{"answer": "cat"}, {"answer": "dog"}], [1 / 3, 1.0]


def _weighted_functions_case(tmp_path):
    from posttrain.environments import resolve_env
    from posttrain.schemas import EnvWorkerConfig

    path = tmp_path / "weighted_rewards.py"
    path.write_text("def exact(response, metadata):\n    return float(response.strip() == metadata['answer'])\n\n"
                    "def digits_only(response, metadata):\n    return float(response.strip().isdigit())\n")
    cfg = EnvWorkerConfig(target=[f"{path}:exact", f"{path}:digits_only"], reward_weights=[1.0, 0.2],
                          correct_at_least={"exact": 1.0})
    # "42" for 41: the format bonus alone (0.2); for 42: both (1.2).
    return resolve_env("weighted", cfg)(cfg), "42", [{"answer": "41"}, {"answer": "42"}], [0.2, 1.2]


@pytest.mark.parametrize("case", [_code_case, _story_case, _weighted_functions_case])
def test_partial_credit_is_not_correct_in_accuracy_and_pass_at_k(tok, tmp_path, case):
    from posttrain.algorithms.eval import _AnswerRecorder, _sample_record
    from posttrain.evals import aggregate, mean_pass_at_k
    from posttrain.rollouts import summarize_rollouts

    env, reply, metadata, rewards = case(tmp_path)
    rows = [{"messages": [{"role": "user", "content": "q"}], "task_name": "t", "metadata": m} for m in metadata]
    # As eval runs it: the recorder keeps each answer for cons@k's vote.
    out = run_rollouts(_EchoGeneration(tok, replies=(reply,)), rows, {"t": _AnswerRecorder(env)}, tok, max_turns=1,
                       max_seq_len=512)
    assert out.batch["rewards"].tolist() == pytest.approx(rewards)  # the partial one has a positive reward
    assert [c.correct for c in out.conversations] == [False, True]
    assert out.metrics["accuracy"] == 0.5  # was 1.0: every reward is > 0
    assert summarize_rollouts(out.conversations)["accuracy"] == 0.5
    records = [_sample_record(p, 0, row, c) for p, (row, c) in enumerate(zip(rows, out.conversations))]
    assert [r["correct"] for r in records] == [False, True]
    m = aggregate([[r["extracted_answer"]] for r in records], [[r["correct"]] for r in records])
    assert m["accuracy"] == m["pass@1"] == m["cons@1"] == 0.5 and m["num_judged"] == 2
    # GRPO's validation: 2 samples of one prompt, one partial: pass@1 0.5, pass@2 1.
    both = [[c.correct for c in out.conversations]]
    assert mean_pass_at_k(both, 1) == 0.5 and mean_pass_at_k(both, 2) == 1.0
    assert mean_pass_at_k([[out.conversations[0].correct] * 2], 2) == 0.0  # two partial samples pass nothing


def test_a_reward_models_score_is_no_verdict(tok, tiny_model_path, tmp_path):
    # A positive RM score counted as correct; now RM samples have no verdict and stay out of
    # accuracy and pass@k, which count the judged samples of other environments only.
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.environments.arithmetic import ArithmeticEnvironment
    from posttrain.environments.reward_model import RewardModelEnvironment
    from posttrain.evals import aggregate
    from posttrain.schemas import EnvWorkerConfig

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    rm = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path)}))
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}]
    if float(rm.step([conversation], [{}]).rewards[0]) <= 0:
        with torch.no_grad():
            rm.model.score.weight.neg_()  # a positive score: the case the old rule counted correct
    envs = {"rm": rm, "arithmetic": ArithmeticEnvironment(EnvWorkerConfig())}
    rows = [{"messages": [{"role": "user", "content": "q"}], "task_name": "rm"},
            {"messages": [{"role": "user", "content": "3+4="}], "task_name": "arithmetic", "answer": "8"}]
    out = run_rollouts(_EchoGeneration(tok, replies=("7",)), rows, envs, tok, max_turns=1, max_seq_len=512)
    rm_conv, wrong = out.conversations
    assert rm_conv.reward > 0 and rm_conv.correct is None and wrong.correct is False
    assert out.metrics["accuracy"] == 0.0  # the arithmetic sample alone; was 0.5
    only_rm = run_rollouts(_EchoGeneration(tok, replies=("7",)), rows[:1], envs, tok, max_turns=1, max_seq_len=512)
    assert "accuracy" not in only_rm.metrics  # nothing judged: no accuracy rather than 1.0
    m = aggregate([["7"]], [[rm_conv.correct]])
    assert m["accuracy"] is None and m["pass@1"] is None and m["cons@1"] is None and m["num_judged"] == 0


def test_the_verdict_of_a_conversation_is_its_last_steps(tok):
    # An environment that judged the first turn correct and gives no verdict on the second
    # leaves the conversation unjudged; one that echoes the metadata it got does not resurrect
    # the first turn's verdict (the rollout never passes it on).
    from posttrain.environments.interfaces import CORRECT_KEY, EnvironmentReturn

    seen = []

    class JudgesOnlyTheFirstTurn:
        def step(self, message_logs, metadata):
            seen.extend(metadata)
            first = [sum(m["role"] == "assistant" for m in log) == 1 for log in message_logs]
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": "again"} for _ in message_logs],
                metadata=[{**m, CORRECT_KEY: True} if f else dict(m) for m, f in zip(metadata, first)],
                next_stop_strings=[None] * len(message_logs), rewards=[1.0] * len(message_logs),
                terminateds=[not f for f in first], answers=[None] * len(message_logs))

    rows = [{"messages": [{"role": "user", "content": "q"}], "task_name": "t"}]
    out = run_rollouts(_EchoGeneration(tok), rows, {"t": JudgesOnlyTheFirstTurn()}, tok, max_turns=2, max_seq_len=512)
    (c,) = out.conversations
    assert c.turns == 2 and c.correct is None and CORRECT_KEY not in seen[1] and "accuracy" not in out.metrics
    # A row's own key of that name is no verdict either: the environment never sees it to echo it.
    seen.clear()
    row = {**rows[0], "metadata": {CORRECT_KEY: True}}
    out = run_rollouts(_EchoGeneration(tok), [row], {"t": JudgesOnlyTheFirstTurn()}, tok, max_turns=2, max_seq_len=512)
    assert out.conversations[0].correct is None and CORRECT_KEY not in seen[0]
    out = run_rollouts(_EchoGeneration(tok), rows, {"t": JudgesOnlyTheFirstTurn()}, tok, max_turns=1, max_seq_len=512)
    assert out.conversations[0].correct is True and out.metrics["accuracy"] == 1.0


def test_a_sample_whose_environment_failed_has_no_verdict(tok):
    # A NaN reward (the environment group's error, scored 0) with env_correct=True counted as correct
    # in accuracy and pass@k, though the sample was dropped from the loss as an environment error.
    from posttrain.environments.interfaces import CORRECT_KEY, ENV_ERROR_KEY, EnvironmentReturn

    class FailsTheFirst:
        def step(self, message_logs, metadata):
            n = len(message_logs)
            return EnvironmentReturn(
                observations=[None] * n, next_stop_strings=[None] * n, rewards=[0.0, 1.0], terminateds=[True] * n,
                metadata=[{CORRECT_KEY: True, ENV_ERROR_KEY: "environment 't' returned reward nan"},
                          {CORRECT_KEY: False}], answers=[None] * n)

    rows = [{"messages": [{"role": "user", "content": "q"}], "task_name": "t"}] * 2
    out = run_rollouts(_EchoGeneration(tok), rows, {"t": FailsTheFirst()}, tok, max_turns=1, max_seq_len=512)
    assert [(c.correct, c.env_errors) for c in out.conversations] == [(None, 1), (False, 0)]
    assert out.metrics["accuracy"] == 0.0


def test_tool_results_under_a_template_that_wants_a_user_message(qwen3_template, qwen3_2507_like_template):
    # Qwen3's template re-renders the calling turn once its result follows, so the result was rendered
    # on its own: a conversation without a user message, which the templates of Qwen3-2507 and
    # Qwen3.5 refuse ("No user query found in messages."). Every tool-calling rollout with them
    # failed at its first call, and setup's check named the template as one without a tool role.
    # The result is now rendered after the conversation's opening: the tokens Qwen3's template gives.
    from posttrain.rollouts import check_tool_turns

    plain, guarded = build_tokenizer(), build_tokenizer()
    plain.chat_template, guarded.chat_template = qwen3_template, qwen3_2507_like_template
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    check_tool_turns(guarded, [{"messages": prompt, "tools": tools, "task_name": "calc"}])
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    results = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "four"}]
    shown = [_observation_tokens(t, [*prompt, call], results, last_token=t.eos_token_id, tools=tools)
             for t in (plain, guarded)]
    assert shown[1] == shown[0]
    assert guarded.decode(shown[1]) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
                                        "<tool_response>\nfour\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_whose_opening_changes_with_what_follows_is_refused_naming_the_change():
    # A tool result is cut from a render after the conversation's opening when the render after the
    # whole conversation does not extend it (Qwen3's). A template whose opening itself changes
    # (here it counts the messages) gave text at an offset into a different render: tokens no
    # render of the conversation holds. Now an error that shows the change, at setup.
    from posttrain.config import InputError
    from posttrain.rollouts import check_tool_turns

    counting = build_tokenizer()
    counting.chat_template = (
        "{{- 'n=' ~ (messages | length) ~ '\\n' -}}"
        "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    prompt = [{"role": "user", "content": "2+2?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                                   "arguments": {}}}]}
    with pytest.raises(InputError, match=r"renders the conversation differently once the observation follows.*"
                                         r"\('n=1\\n<\|user\|>2\+2\?.*' became 'n=2\\n<\|user\|>"):
        _observation_tokens(counting, [*prompt, call], [{"role": "tool", "content": "4"}],
                            last_token=counting.eos_token_id, tools=tools)
    with pytest.raises(InputError, match=r"^environment 'calc' has tools, and the chat template renders the "
                                         r"conversation differently"):
        check_tool_turns(counting, [{"messages": prompt, "tools": tools, "task_name": "calc"}])
    # The same template without the count renders the result as the conversation's continuation.
    plain = build_tokenizer()
    plain.chat_template = counting.chat_template.replace("{{- 'n=' ~ (messages | length) ~ '\\n' -}}", "")
    shown = _observation_tokens(plain, [*prompt, call], [{"role": "tool", "content": "4"}],
                                last_token=plain.eos_token_id, tools=tools)
    assert plain.decode(shown) == "<|tool|>4<|end|><|assistant|>"  # the turn's <|end|> is its EOS, already generated


def test_pad_right_pads_ragged_rows_and_rounds_floats_as_torch_does():
    import torch

    from posttrain.rollouts import _pad

    ids = _pad([[5, 6, 7], [8], [9, 10]], -1, torch.long)
    assert ids.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7], [8, -1, -1], [9, 10, -1]]
    values = [[0.1, -1 / 3], [2.5e-8, 1e30, 7.0]]
    lps = _pad(values, 0.0, torch.float32)
    # float32 from the Python floats (doubles) directly: the same rounding as torch.tensor's
    assert torch.equal(lps, torch.tensor([[0.1, -1 / 3, 0.0], [2.5e-8, 1e30, 7.0]], dtype=torch.float32))
    assert _pad([[1, 0, 1], [0]], 0, torch.bool).tolist() == [[True, False, True], [False, False, False]]
