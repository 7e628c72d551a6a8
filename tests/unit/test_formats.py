"""Dataset formats and loading: real samples of each format, malformed rows, splits, prompts."""

import json
import logging
import re
from pathlib import Path

import pytest

from posttrain.config import InputError
from posttrain.data.datasets import load_rows
from posttrain.data.formats import DataFormatError, detect_format, normalize_row, row_name
from posttrain.schemas import DataConfig


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(name, **kw):
    return DataConfig(dataset_name=name, **kw)


# --------------------------------------------------------------------------- real samples


def test_sharegpt_preference_sample(shared_data):
    cfg = _cfg(f"{shared_data}/llamafactory_demo/dpo_en_demo.json")
    train, val = load_rows(cfg, "train"), load_rows(cfg, "val")
    assert len(train) + len(val) == 300 and len(val) == 15  # 5% held out
    assert not {json.dumps(r) for r in train} & {json.dumps(r) for r in val}
    # Registered by LLaMA-Factory's name, from $POSTTRAIN_SHARED_DATA wherever the run starts.
    assert load_rows(_cfg("dpo_en_demo"), "train") == train
    raw = json.load(open(f"{shared_data}/llamafactory_demo/dpo_en_demo.json"))
    row = train[0]
    assert set(row) == {"prompt_messages", "chosen", "rejected"}
    assert row["prompt_messages"][0] == {"role": "user", "content": raw[0]["conversations"][0]["value"]}
    assert row["chosen"] == [{"role": "assistant", "content": raw[0]["chosen"]["value"]}]
    assert row["rejected"] == [{"role": "assistant", "content": raw[0]["rejected"]["value"]}]
    # Multi-turn contexts keep their assistant turns in the prompt.
    longest = max(train, key=lambda r: len(r["prompt_messages"]))
    assert [m["role"] for m in longest["prompt_messages"][:2]] == ["user", "assistant"]


def test_alpaca_sample(shared_data):
    rows = load_rows(_cfg("alpaca"), "train")
    raw = json.load(open(f"{shared_data}/llamafactory_demo/alpaca_en_demo.json"))
    assert len(rows) == 947  # 999, less 50 held out and 2 copies of held-out rows
    with_input = next(r for r in raw if r["input"])
    expected_user = f"{with_input['instruction']}\n\n{with_input['input']}"
    all_rows = rows + load_rows(_cfg("alpaca"), "val")
    match = [r for r in all_rows if r["messages"][0]["content"] == expected_user]
    assert match and match[0]["messages"][1] == {"role": "assistant", "content": with_input["output"]}


def test_sharegpt_system_column_beside_a_system_turn():
    # Both became system messages, the column's first.
    row = {"system": "Column.", "conversations": [{"from": "system", "value": "Own."}, {"from": "human", "value": "hi"},
                                                  {"from": "gpt", "value": "yo"}]}
    assert [m["content"] for m in normalize_row(row, "sharegpt", "x row 1")["messages"]] == ["Own.", "hi", "yo"]
    row["conversations"] = row["conversations"][1:]
    assert [m["content"] for m in normalize_row(row, "sharegpt", "x row 1")["messages"]] == ["Column.", "hi", "yo"]


@pytest.mark.parametrize("fmt", ["sharegpt", "messages", "preference"])
def test_a_system_column_is_the_conversations_system_message_in_every_layout(fmt):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    row = {"sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
           "messages": {"messages": turns, "label": True},  # KTO's layout, too
           "preference": {"messages": turns[:1], "chosen": turns[1:], "rejected": [{"role": "assistant", "content": "no"}]},
           }[fmt]
    key = "prompt_messages" if fmt == "preference" else "messages"
    assert normalize_row(row, fmt, "x row 1")[key][0]["role"] == "user"
    got = normalize_row({**row, "system": "Be a pirate."}, fmt, "x row 1")[key]
    assert got[0] == {"role": "system", "content": "Be a pirate."} and got[1]["content"] == "hi"
    own = {"messages": [{"role": "system", "content": "Own."}, *turns], "system": "Column."}
    assert [m["content"] for m in normalize_row(own, "messages", "x row 1")["messages"]] == ["Own.", "hi", "yo"]


def test_preference_rows_keep_their_tools():
    tools = [{"name": "search", "description": "Look it up.", "parameters": {"type": "object", "properties": {}}}]
    row = {"prompt": "find x", "chosen": "found", "rejected": "lost", "tools": json.dumps(tools)}
    assert normalize_row(row, "preference", "x row 1")["tools"] == [{"type": "function", "function": tools[0]}]
    assert "tools" not in normalize_row({**row, "tools": None}, "preference", "x row 1")


def test_sharegpt_toolcall_sample(shared_data):
    # LLaMA-Factory's layout: `tools` a JSON string of bare function schemas, each call a
    # `function_call` turn of JSON text, each result an `observation`.
    from posttrain.data.processors import tokenize_messages
    from posttrain.embedded import build_tokenizer

    path = f"{shared_data}/llamafactory_demo/glaive_toolcall_en_demo.json"
    rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")  # every row
    raw = json.loads(Path(f"{shared_data}/llamafactory_demo/glaive_toolcall_en_demo.json").read_text())
    assert {m["role"] for r in rows for m in r["messages"]} == {"user", "assistant", "tool"}
    # The schemas as templates take them, in OpenAI's form.
    assert sum(len(r["tools"]) for r in rows) == sum(len(json.loads(r["tools"])) for r in raw)
    assert all(t["type"] == "function" and t["function"]["name"] for r in rows for t in r["tools"])
    # Every function_call is an assistant turn with the call structured; every result names it.
    calls = [m for r in rows for m in r["messages"] if m.get("tool_calls")]
    assert len(calls) == sum(m["from"] == "function_call" for r in raw for m in r["conversations"]) == 211
    for r in rows:
        for before, m in zip(r["messages"], r["messages"][1:]):
            if m["role"] == "tool":
                (call,) = before["tool_calls"]
                assert m["tool_call_id"] == call["id"] and m["name"] == call["function"]["name"]
    # Rows with a tools list tokenize (they used to fail in the chat template), the calls trained.
    tok = build_tokenizer()
    row = next(r for r in rows if any(m.get("tool_calls") for m in r["messages"]))
    ex = tokenize_messages(row["messages"], tok, tools=row["tools"])
    assert "<tool_call>{\"name\": " in tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])


def test_column_map_renames_the_datas_columns_before_the_format_is_told(tmp_path):
    from pydantic import ValidationError

    rows = [{"query": f"{a}+1=", "solution": str(a + 1), "source": "x"} for a in range(40)]
    path = _write_jsonl(tmp_path / "trl.jsonl", rows)
    with pytest.raises(DataFormatError, match=r"cannot tell the format from the keys \['query', 'solution', 'source'\]"):
        load_rows(_cfg(path), "train")
    train = load_rows(_cfg(path, column_map={"query": "question", "solution": "answer"}), "train")
    assert train[0]["messages"] == [{"role": "user", "content": "0+1="}] and train[0]["answer"] == "1"
    # A name no row has (a typo) would leave the rows as they were: refused, listing the columns.
    with pytest.raises(InputError, match=r"trl.jsonl: data.column_map renames 'querry', which no row has \(its "
                                         r"columns: query, solution, source\)"):
        load_rows(_cfg(path, column_map={"querry": "question"}), "train")
    # A new name the data uses for a column it keeps would lose that column.
    with pytest.raises(InputError, match=r"renames 'query' -> 'source', a column the data already has"):
        load_rows(_cfg(path, column_map={"query": "source"}), "train")
    assert load_rows(_cfg(path, column_map={"query": "question", "solution": "answer", "source": "origin"}), "val")
    # A file with the new names already (a validation file beside the training file) is read as it is.
    named = _write_jsonl(tmp_path / "named.jsonl", [{"question": "2+2=", "answer": "4"}] * 3)
    val = load_rows(_cfg(path, column_map={"query": "question", "solution": "answer"}, val_data_path=str(named)), "val")
    assert val[0]["messages"] == [{"role": "user", "content": "2+2="}] and val[0]["answer"] == "4"
    with pytest.raises(ValidationError, match=r"renames several columns to 'answer'"):
        _cfg(path, column_map={"query": "answer", "solution": "answer"})
    with pytest.raises(InputError, match=r"data.column_map: data.dataset_name='arithmetic' is made from its settings"):
        load_rows(_cfg("arithmetic", column_map={"a": "b"}), "train")


def test_openai_content_parts_are_read_as_their_text():
    # OpenAI's (and multimodal chat sets') list of content parts: text parts joined, others refused.
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "1+1?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "2"}]}]}
    assert normalize_row(row, "messages", "x row 1")["messages"] == [
        {"role": "user", "content": "What is\n1+1?"}, {"role": "assistant", "content": "2"}]
    row["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x.png"}})
    with pytest.raises(DataFormatError, match=r"x row 1: `messages\[0\].content\[2\]` is a content part of type "
                                              r"'image_url'; only text parts"):
        normalize_row(row, "messages", "x row 1")


def test_openai_tool_calling_rows_keep_their_calls_and_train_on_them(tmp_path):
    # OpenAI's function-calling layout: a calling turn with `content: null` and structured
    # `tool_calls` (arguments as an object or as a JSON string), results naming their call.
    from posttrain.data.processors import tokenize_messages
    from posttrain.embedded import build_tokenizer

    call = {"id": "abc123def", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    row = {"messages": [{"role": "user", "content": "1+2="},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": "3", "tool_call_id": "abc123def", "name": "add"},
                        {"role": "assistant", "content": "3"}]}
    flat = {"messages": [{"role": "user", "content": "2+2="},
                         {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]},
                         {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}
    path = _write_jsonl(tmp_path / "t.jsonl", [row, flat])
    got, got_flat = load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    assert got["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123def", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert got["messages"][2] == {"role": "tool", "content": "3", "tool_call_id": "abc123def", "name": "add"}
    # Calls without an id get one, and a result naming no call answers the call before it.
    (flat_call,) = got_flat["messages"][1]["tool_calls"]
    assert flat_call == {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}},
                         "id": flat_call["id"]} and len(flat_call["id"]) == 9
    assert got_flat["messages"][2] == {"role": "tool", "content": "4", "tool_call_id": flat_call["id"], "name": "add"}
    # The calling turn is trained as the template writes it (the embedded one: Hermes tags); the result is not.
    tok = build_tokenizer()
    ex = tokenize_messages(got["messages"], tok, add_bos=False)
    trained = tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    assert trained == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|end|>3<|end|>'
    # Malformed calls and tool schemas name the row and the key.
    bad = [({"tool_calls": [None]}, "`messages[1].tool_calls[0]` must be"),
           ({"tool_calls": [{"name": "add", "arguments": "{oops"}]}, "is not JSON"),
           ({"tool_calls": [{"function": {"name": "add", "arguments": [1]}}]}, "must be an object"),
           ({"tools": "[{oops"}, "`tools` is a string but not JSON"),
           ({"tools": [{"description": "no name"}]}, "`tools[0]` must be a function schema")]
    for i, (change, message) in enumerate(bad):
        broken = json.loads(json.dumps(row))
        if "tools" in change:
            broken["tools"] = change["tools"]
        else:
            broken["messages"][1]["tool_calls"] = change["tool_calls"]
        path = _write_jsonl(tmp_path / f"bad{i}.jsonl", [row, broken])
        with pytest.raises(DataFormatError, match="row 2") as e:
            load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
        assert message in str(e.value)


def test_reasoning_fields_of_assistant_messages_are_kept(tmp_path):
    # The loader kept role, content and tool fields alone: reasoning in a field of its own
    # (`reasoning_content`: Qwen3's template, DeepSeek's API; `reasoning`: vLLM's and
    # OpenRouter's; `thinking`: gpt-oss's template and its data) was gone before any template ran.
    user = {"role": "user", "content": "1+1?", "reasoning_content": None, "thinking": ""}
    rows = [{"messages": [user, {"role": "assistant", "content": "2", field: "add one"}]}
            for field in ("reasoning_content", "reasoning", "thinking")]
    sharegpt = [{"conversations": [{"from": "human", "value": "1+1?"},
                                   {"from": "gpt", "value": "2", "reasoning_content": "add one"}]}]
    got = []
    for name, file_rows in (("r.jsonl", rows), ("s.jsonl", sharegpt)):
        path = _write_jsonl(tmp_path / name, file_rows)
        got += load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    assert len(got) == 4
    for row in got:
        assert row["messages"] == [{"role": "user", "content": "1+1?"},
                                   {"role": "assistant", "content": "2", "reasoning_content": "add one"}]
    # Empty or null is no reasoning; the same text under two names is one.
    for same in ({"reasoning": None, "thinking": "  "}, {"reasoning": "add one", "reasoning_content": "add one"}):
        got = normalize_row({"messages": [user, {"role": "assistant", "content": "2", **same}]}, "messages", "x row 1")
        assert got["messages"][1] == ({"role": "assistant", "content": "2", **({"reasoning_content": "add one"}
                                      if "reasoning_content" in same else {})})
    # A preference pair's responses keep theirs.
    pair = normalize_row({"prompt": "1+1?", "chosen": {"role": "assistant", "content": "2", "thinking": "add one"},
                          "rejected": {"role": "assistant", "content": "2", "thinking": "guess"}}, "preference", "p")
    assert [pair["chosen"][0]["reasoning_content"], pair["rejected"][0]["reasoning_content"]] == ["add one", "guess"]
    bad = [({"role": "user", "content": "1+1?", "reasoning_content": "hm"},
            r"`messages\[0\]\.reasoning_content` is reasoning on a user message"),
           ({"role": "assistant", "content": "2", "reasoning": ["add", "one"]},
            r"`messages\[0\]\.reasoning` must be a string, got list"),
           ({"role": "assistant", "content": "<think>add one</think>2", "reasoning_content": "add one"},
            r"`messages\[0\]` has its reasoning both in `reasoning_content` and as a <think> block in `content`"),
           ({"role": "assistant", "content": "2", "reasoning_content": "add one", "reasoning": "guess"},
            r"`messages\[0\]` gives different reasoning in `reasoning_content` and `reasoning`")]
    for message, error in bad:
        with pytest.raises(DataFormatError, match=rf"^x row 7: {error}"):
            normalize_row({"messages": [message]}, "messages", "x row 7")


def test_reasoning_in_a_prompt_is_shown_as_the_template_shows_it(qwen3_like_tok):
    # A GRPO/eval prompt whose assistant turns carry reasoning fields is rendered by the template's
    # own rule, as at inference: Qwen3's shows the reasoning of turns after the last user message
    # (a tool-calling turn the model continues), not of earlier ones (a few-shot example).
    from posttrain.rollouts import render_prompt

    tok = qwen3_like_tok
    call = {"role": "assistant", "content": "", "reasoning_content": "use the tool",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    row = normalize_row({"messages": [{"role": "user", "content": "1+2="}, call, {"role": "tool", "content": "3"}],
                         "task_name": "math", "answer": "3"}, "messages", "x row 1")
    assert tok.decode(render_prompt(tok, row["messages"], add_bos=False)) == (
        "<|user|>1+2=<|end|><|assistant|><think>\nuse the tool\n</think>\n\n<|end|><|tool|>3<|end|><|assistant|>")
    shot = normalize_row({"messages": [{"role": "user", "content": "1+1="},
                                       {"role": "assistant", "content": "2", "reasoning_content": "add one"},
                                       {"role": "user", "content": "1+2="}], "task_name": "math", "answer": "3"},
                         "messages", "x row 2")
    assert shot["messages"][1]["reasoning_content"] == "add one"
    assert tok.decode(render_prompt(tok, shot["messages"], add_bos=False)) == (
        "<|user|>1+1=<|end|><|assistant|>2<|end|><|user|>1+2=<|end|><|assistant|>")
    # A conversation's final assistant turn is the reference `answer` (its content) and, with its
    # reasoning, the `demonstration` SFT warm-up trains.
    ref = normalize_row({"messages": [{"role": "user", "content": "1+1="},
                                      {"role": "assistant", "content": "2", "reasoning": "add one"}]},
                        "messages", "x row 3", task_name="math")
    assert ref["answer"] == "2"
    assert ref["demonstration"] == [{"role": "assistant", "content": "2", "reasoning_content": "add one"}]


def test_sharegpt_function_call_that_is_no_call_names_the_row(tmp_path):
    good = {"conversations": [{"from": "human", "value": "1+2="},
                              {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 1, "b": 2}}'},
                              {"from": "observation", "value": "3"}, {"from": "gpt", "value": "3"}]}
    bad = json.loads(json.dumps(good))
    bad["conversations"][1]["value"] = "I will add them."
    path = _write_jsonl(tmp_path / "calls.jsonl", [good, bad])
    with pytest.raises(DataFormatError, match=r"row 2: conversations\[1\] is a function_call but not"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")


def test_messages_sample_of_kto_data_refuses_the_answers_not_to_give(shared_data, tmp_path):
    # KTO rows with `label: false` are answers not to give: SFT used to train on them silently.
    path = f"{shared_data}/llamafactory_demo/kto_en_demo.json"
    raw = json.load(open(path))
    first_bad = next(n for n, r in enumerate(raw, start=1) if r["label"] is False)
    # The same error serves `posttrain dpo`/`rm`/`eval`, whose users it told only what SFT would do and
    # to skip such rows, which left rows those commands cannot use either.
    with pytest.raises(DataFormatError, match=rf"{path} row {first_bad}: `label` is false: KTO data \(responses "
                                              r"labelled desirable or not\), which `posttrain kto` trains on; .* DPO "
                                              r"and RM need `chosen`/`rejected` pairs and eval prompts to answer, which "
                                              r"KTO data has not. For SFT on its desirable rows, set "
                                              r"data.on_malformed_row=skip"):
        load_rows(_cfg(path), "train")
    kept = [r for r in raw if r["label"]]
    rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, on_malformed_row="skip"), "train")
    assert [r["messages"] for r in rows] == [r["messages"] for r in kept] and len(rows) == 150
    # TRL's unpaired layout (prompt/completion/label) likewise; a true label is no matter.
    trl = _write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "q", "completion": "a", "label": True},
                                                 {"prompt": "q", "completion": "b", "label": False}])
    with pytest.raises(DataFormatError, match=r"kto.jsonl row 2: `label` is false"):
        load_rows(_cfg("local", train_data_path=trl, val_data_path=trl), "train")


def test_squad_sample(shared_data):
    rows = load_rows(_cfg("squad"), "train") + load_rows(_cfg("squad"), "val")
    assert len(rows) == 8
    first = next(r for r in rows if r["messages"][1]["content"] == "In what country is Normandy located?")
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert first["messages"][2]["content"] == "France"
    assert first["messages"][0]["content"].startswith("The Normans")


def test_squad_official_nested_layout(tmp_path, caplog):
    nested = {"version": "v2.0", "data": [{"title": "T", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}]},
        {"id": "2", "question": "Unanswerable?", "answers": [], "is_impossible": True},
    ]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(nested))
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        rows = load_rows(_cfg("local", train_data_path=str(path), val_data_path=str(path)), "train")
    # The unanswerable question is skipped, and counted (it went uncounted).
    assert f"{path}: skipped 1 unanswerable SQuAD questions (is_impossible) of 2" in caplog.text
    assert rows == [{"messages": [{"role": "system", "content": "Paris is in France."},
                                  {"role": "user", "content": "Where is Paris?"},
                                  {"role": "assistant", "content": "France"}]}]


def test_gsm8k_and_math500_rl_rows(shared_data):
    train = load_rows(_cfg("gsm8k"), "train")
    val = load_rows(_cfg("gsm8k", max_val_samples=20), "val")
    assert len(train) == 7473 and len(val) == 20
    assert train[0]["answer"] == "72" and train[0]["task_name"] == "math"
    assert train[0]["messages"] == [{"role": "user", "content": train[0]["messages"][0]["content"]}]
    math = load_rows(_cfg("math500"), "val")
    assert len(math) == 500 and math[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math[0]["metadata"]["level"] == 2
    # The worked solutions are the demonstrations SFT and GRPO's warm-up train: GSM8K's answer as
    # written (it kept only the final number, so they trained bare numbers), MATH's `solution`.
    raw = json.loads(Path(f"{shared_data}/gsm8k/train.jsonl").read_text().split("\n", 1)[0])
    assert train[0]["demonstration"] == raw["answer"] and raw["answer"].endswith("#### 72")
    assert math[0]["demonstration"].endswith("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$")


def test_parquet_file(shared_data):
    rows = load_rows(_cfg("local", train_data_path=f"{shared_data}/math500/math500_RL.parquet",
                          val_data_path=f"{shared_data}/math500/math500_RL.parquet"), "val")
    assert len(rows) == 500 and rows[0]["task_name"] == "math"


def test_prompt_completion_and_implicit_prompt_pairs(tmp_path):
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"2+2= ({i})", "completion": "4"} for i in range(4)])
    rows = load_rows(_cfg(path, val_split_fraction=0.25), "train")
    assert len(rows) == 3 and rows[0]["messages"][1] == {"role": "assistant", "content": "4"}
    hh = {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
          "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]}
    row = normalize_row(hh, detect_format(hh), "x row 1")
    assert row["prompt_messages"] == [{"role": "user", "content": "hi"}]
    assert row["rejected"] == [{"role": "assistant", "content": "go away"}]


def test_anthropic_hh_transcripts_are_read_as_conversations(tmp_path):
    # Anthropic/hh-rlhf rows are two transcript strings; they failed with "no shared context".
    hh = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?\n\nHuman: A joke\n\nAssistant: Knock knock.",
          "rejected": "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?\n\nHuman: A joke\n\nAssistant: No."}
    row = normalize_row(hh, detect_format(hh), "x row 1")
    assert row["prompt_messages"] == [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello! How can I help?"},
                                      {"role": "user", "content": "A joke"}]
    assert row["chosen"] == [{"role": "assistant", "content": "Knock knock."}]
    assert row["rejected"] == [{"role": "assistant", "content": "No."}]
    # An answer left empty (some HH rows end with "Assistant:") is a malformed row, named.
    with pytest.raises(DataFormatError, match="x row 2"):
        normalize_row({**hh, "rejected": "\n\nHuman: Hi\n\nAssistant:"}, "preference", "x row 2")
    # Text that merely mentions a speaker stays one answer.
    plain = normalize_row({"prompt": "q", "chosen": "Human: yes", "rejected": "no"}, "preference", "x row 3")
    assert plain["chosen"] == [{"role": "assistant", "content": "Human: yes"}]


def test_capped_held_out_validation_is_a_sample_of_the_file(tmp_path):
    # The held-out rows came back in file order, so a cap (data.max_val_samples, GRPO's default
    # grpo.max_val_samples=256) kept those nearest the top of the file: of a file sorted by
    # subject or difficulty, the first subject or the easiest.
    path = _write_jsonl(tmp_path / "sorted.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(400)])
    whole = load_rows(_cfg(path, val_split_fraction=0.25), "val")
    capped = load_rows(_cfg(path, val_split_fraction=0.25, max_val_samples=20), "val")
    assert capped == whole[:20] and len(whole) == 100
    assert max(int(r["answer"]) for r in capped) > 200  # the capped rows are spread over the file
    train = load_rows(_cfg(path, val_split_fraction=0.25), "train")
    assert [int(r["answer"]) for r in train] == sorted(int(r["answer"]) for r in train)  # in file order
    assert not {r["answer"] for r in train} & {r["answer"] for r in whole}


def test_held_out_rows_have_no_copy_in_training(tmp_path, caplog):
    # A row the file repeats landed on both sides (4 of the 15 rows held out of the shared
    # glaive_toolcall demo were training rows too): validation scored rows already trained on.
    rows = [{"question": f"q{i % 10}", "answer": str(i % 10)} for i in range(40)]  # each row 4 times
    path = _write_jsonl(tmp_path / "copies.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        train, val = (load_rows(_cfg(path, val_split_fraction=0.1), s) for s in ("train", "val"))
    assert len(val) == 4 and train and not {r["answer"] for r in train} & {r["answer"] for r in val}
    assert f"left out {36 - len(train)} training rows that are copies of validation rows" in caplog.text
    path = _write_jsonl(tmp_path / "one.jsonl", rows[:1] * 4)
    with pytest.raises(InputError, match="every training row is a copy of a row held out for validation"):
        load_rows(_cfg(path, val_split_fraction=0.25), "train")


def test_prompt_and_system_prompt_files(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 1+1?", "completion": "2"}] * 3)
    (tmp_path / "p.txt").write_text("Answer inside \\boxed{{}}: {}")
    (tmp_path / "s.txt").write_text("You are terse.\n")
    rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, prompt_file=str(tmp_path / "p.txt"),
                          system_prompt_file=str(tmp_path / "s.txt")), "train")
    assert rows[0]["messages"][:2] == [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Answer inside \\boxed{}: What is 1+1?"}]
    # Saved with a byte-order mark (Windows editors): it went into every prompt; not UTF-8: a traceback.
    (tmp_path / "p.txt").write_bytes("Q:\r\n{}".encode("utf-8-sig"))  # and Windows line ends, read as "\n"
    (tmp_path / "s.txt").write_text("Sois bref.", encoding="utf-8-sig")
    cfg = _cfg("local", train_data_path=path, val_data_path=path, prompt_file=str(tmp_path / "p.txt"),
               system_prompt_file=str(tmp_path / "s.txt"))
    assert [m["content"] for m in load_rows(cfg, "train")[0]["messages"][:2]] == ["Sois bref.", "Q:\nWhat is 1+1?"]
    (tmp_path / "s.txt").write_bytes("Sois très bref.".encode("latin-1"))
    with pytest.raises(DataFormatError, match=rf"{tmp_path / 's.txt'} line 1: not UTF-8 text"):
        load_rows(cfg, "train")
    # A template without its `{}` (or with a named or second field) replaced every question with
    # its own text: the model never saw the questions.
    for bad, found in [("Put the answer in \\boxed{{}}.", "found 0 fields"), ("{} and {}", "found 2 fields"),
                       ("Q: {question}", "found 1 fields ['question']"), ("{", "Single '{'")]:
        (tmp_path / "p.txt").write_text(bad)
        with pytest.raises(InputError, match=rf"data.prompt_file {tmp_path / 'p.txt'}: must hold exactly one "
                                             rf"`{{}}`.*{re.escape(found)}"):
            load_rows(_cfg("local", train_data_path=path, val_data_path=path, prompt_file=str(tmp_path / "p.txt")),
                      "train")
    # A folder is there, just not a file: it was "file not found".
    with pytest.raises(InputError, match=rf"^data.prompt_file: {tmp_path} is a folder, not a file$"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path, prompt_file=str(tmp_path)), "train")


def test_data_task_name_makes_prompt_only_messages_rows_rl_rows(tmp_path):
    # A GRPO prompt file in the messages format: a user turn and an answer, no assistant turn.
    prompts = [{"messages": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1), "metadata": {"k": a}}
               for a in range(4)]
    path = _write_jsonl(tmp_path / "rl.jsonl", prompts + [{**prompts[0], "task_name": "math"}])
    rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, task_name="exact"), "train")
    assert [r["task_name"] for r in rows] == ["exact"] * 5  # every row, its own task_name replaced
    assert rows[1] == {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "metadata": {"k": 1},
                       "task_name": "exact"}
    # Without data.task_name the same rows are SFT rows with nothing to train on; the error says what to set.
    with pytest.raises(DataFormatError, match=rf"{path} row 1: `messages` has no assistant message.*data.task_name"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")


def test_rl_row_stop_strings_must_be_a_list_of_non_empty_strings():
    # A bare string was iterated as its characters: "xyz" stopped the row at its first "z".
    row = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "task_name": "math"}
    assert normalize_row({**row, "stop_strings": ["\n", "xyz"]}, "messages", "f row 3")["stop_strings"] == ["\n", "xyz"]
    for bad in ("xyz", [""], ["a", 3]):
        with pytest.raises(DataFormatError, match=r"f row 3: `stop_strings` must be a list of non-empty strings"):
            normalize_row({**row, "stop_strings": bad}, "messages", "f row 3")


def test_data_task_name_makes_every_conversation_format_rl_rows(tmp_path):
    # data.task_name sends every row to its environment: Alpaca, ShareGPT and prompt/completion
    # conversations too, not only `messages` ones. They stayed SFT rows, which GRPO sent to `math`
    # with their answer in the prompt, and every sample scored 0 as an environment error.
    user = {"role": "user", "content": "1+1="}
    for row in ({"instruction": "1+1=", "output": "2"},
                {"conversations": [{"from": "human", "value": "1+1="}, {"from": "gpt", "value": "2"}]},
                {"prompt": "1+1=", "completion": "2"}):
        path = _write_jsonl(tmp_path / "conv.jsonl", [row])
        (got,) = load_rows(_cfg("local", train_data_path=path, val_data_path=path, task_name="exact"), "train")
        assert got == {"messages": [user], "answer": "2", "task_name": "exact"}, row


def test_rl_row_ending_with_an_assistant_message_takes_it_as_the_answer(tmp_path):
    # An SFT conversation read as RL/eval rows (data.task_name) used to keep its assistant answer
    # in the prompt: GRPO rewarded copying it and eval scored it as the model's. Without an
    # `answer` it is the reference (NeMo RL's [user, assistant] math rows); beside one, an error.
    user = {"role": "user", "content": "1+1="}
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"messages": [user, {"role": "assistant", "content": "#### 2"}]}])
    (got,) = load_rows(_cfg("local", train_data_path=path, val_data_path=path, task_name="math"), "train")
    assert got["messages"] == [user] and got["answer"] == "#### 2"
    rows = [{"messages": [user, {"role": "assistant", "content": "2"}], "answer": "2"}]
    path = _write_jsonl(tmp_path / "both.jsonl", rows)
    with pytest.raises(DataFormatError, match=rf"{path} row 1: an RL/eval row's prompt ends with an assistant message"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path, task_name="math"), "train")
    # Earlier assistant turns (few-shot, tool calls) stay part of the prompt.
    few_shot = [{"messages": [*rows[0]["messages"], {"role": "user", "content": "2+2="}], "answer": "4"}]
    path = _write_jsonl(tmp_path / "few_shot.jsonl", few_shot)
    (got,) = load_rows(_cfg("local", train_data_path=path, val_data_path=path, task_name="math"), "train")
    assert got["messages"] == few_shot[0]["messages"]


def test_data_task_name_is_refused_where_no_environment_scores_rows():
    from posttrain.config import ConfigError, load_config

    for algo in ("sft", "dpo", "rm"):
        with pytest.raises(ConfigError, match=rf"data.task_name='math' .*`posttrain {algo}` has no environments"):
            load_config(algo, None, ["data.task_name=math"])
    assert load_config("eval", None, ["data.task_name=math"]).data.task_name == "math"


# --------------------------------------------------------------------------- malformed rows

GOOD = {
    "messages": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    "alpaca": {"instruction": "q", "input": "", "output": "a"},
    "prompt_completion": {"prompt": "q", "completion": "a"},
    "squad": {"context": "c", "question": "q", "answers": {"text": ["a"], "answer_start": [0]}},
    "preference": {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"},
                   "rejected": {"from": "gpt", "value": "b"}},
    "math": {"question": "1+1?", "answer": "2"},
    "code": {"text": "Write f.", "test_list": ["assert f() == 1"]},
}
BAD = {
    "messages": ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}, "unknown role"),
    "sharegpt": ({"conversations": [{"from": "human", "value": "q"}, {"from": "alien", "value": "a"}]}, "alien"),
    "alpaca": ({"instruction": "q", "input": "", "output": 7}, "`output` must be a string"),
    "prompt_completion": ({"prompt": "q", "completion": ""}, "`completion` is empty"),
    "squad": ({"context": "c", "question": "q", "answers": {"text": [], "answer_start": []}}, "no answer text"),
    "preference": ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"},
                    "rejected": None}, "missing `rejected`"),
    "math": ({"question": "", "answer": "2"}, "`question` is empty"),
    "code": ({"text": "Write f.", "test_list": []}, "`test_list` must be a non-empty list"),
}


@pytest.mark.parametrize("fmt", sorted(BAD))
def test_malformed_row_names_file_and_row(tmp_path, fmt):
    bad, message = BAD[fmt]
    path = _write_jsonl(tmp_path / f"{fmt}.jsonl", [GOOD[fmt], GOOD[fmt], bad, GOOD[fmt]])
    with pytest.raises(DataFormatError) as e:
        load_rows(_cfg("local", train_data_path=path, val_data_path=path, format=fmt), "train")
    assert f"{path} row 3" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("fmt", sorted(BAD))
def test_malformed_row_skipped_and_counted(tmp_path, fmt, caplog):
    bad, _ = BAD[fmt]
    path = _write_jsonl(tmp_path / f"{fmt}.jsonl", [GOOD[fmt], bad, GOOD[fmt], bad])
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, on_malformed_row="skip"), "train")
    assert len(rows) == 2
    assert "skipped 2 malformed" in caplog.text and "row 2" in caplog.text


def test_malformed_first_row_is_skipped_too(tmp_path, caplog):
    # The format was told from the first row alone: one without its answer (or of no format)
    # stopped the run although data.on_malformed_row=skip.
    for first in ({"question": "1+1?"}, {"foo": 1}):
        path = _write_jsonl(tmp_path / "d.jsonl", [first] + [{"question": "2+2?", "answer": "4"}] * 3)
        with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
            rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, on_malformed_row="skip"), "train")
        assert len(rows) == 3 and rows[0]["answer"] == "4"
        assert "skipped 1 malformed math rows of 4 (first: " + f"{path} row 1: math row is missing" in caplog.text
    with pytest.raises(DataFormatError, match=rf"{path} row 1: cannot tell the format"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")


def test_preference_row_missing_rejected_key(tmp_path, shared_data):
    raw = json.load(open(f"{shared_data}/llamafactory_demo/dpo_en_demo.json"))[:10]
    del raw[6]["rejected"]
    path = tmp_path / "dpo.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(DataFormatError, match=rf"{path} row 7: preference row is missing `rejected`"):
        load_rows(_cfg(str(path)), "train")


def test_an_empty_rejected_answer_is_a_pair_and_an_empty_chosen_one_is_not():
    # Preferring any answer to none is data (TRL takes it); it was refused as an answer that "would
    # train the model to answer with nothing", which the rejected side never does.
    for rejected in ("", "  ", [{"role": "assistant", "content": ""}], {"from": "gpt", "value": None}):
        row = normalize_row({"prompt": "Hi", "chosen": "Hello", "rejected": rejected}, "preference", "f row 1", None)
        assert row["rejected"] == [{"role": "assistant", "content": ""}]
    with pytest.raises(DataFormatError, match=r"f row 1: `chosen` is empty"):
        normalize_row({"prompt": "Hi", "chosen": " ", "rejected": "x"}, "preference", "f row 1", None)


def test_preference_pair_with_the_same_response_on_both_sides_is_malformed(tmp_path, caplog):
    # It used to load and count as a pair (and as a miss of the reward accuracy), teaching nothing.
    same = {"prompt": "q", "chosen": "a", "rejected": "a"}
    path = _write_jsonl(tmp_path / "pairs.jsonl", [GOOD["preference"], same, GOOD["preference"]])
    with pytest.raises(DataFormatError, match=rf"{path} row 2: `chosen` and `rejected` are the same response"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        rows = load_rows(_cfg("local", train_data_path=path, val_data_path=path, on_malformed_row="skip"), "train")
    assert len(rows) == 2 and "skipped 1 malformed preference rows of 3" in caplog.text


def test_invalid_json_line_names_the_line(tmp_path, capfd):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD["alpaca"]) + "\n" + '{"instruction": "q", "output": \n')
    with pytest.raises(DataFormatError, match=rf"{path} row 2: invalid JSON: Expecting value at column 32$"):
        load_rows(_cfg(str(path)), "train")
    # json's "Unterminated string starting at" names its position itself (the message ended at "at").
    path.write_text(json.dumps(GOOD["alpaca"]) + "\n" + '{"instruction": "q", "output": "a\n')
    with pytest.raises(DataFormatError, match=rf"{path} row 2: invalid JSON: Unterminated string starting at "
                                              r"column 32$"):
        load_rows(_cfg(str(path)), "train")
    # One error: datasets' JSON reader logged its own first ("in row 1", counting from 0).
    assert "Failed to load JSON" not in capfd.readouterr().err


def test_invalid_json_lines_are_skipped_and_counted_under_skip(tmp_path, caplog):
    # They stopped the run whatever data.on_malformed_row said; the rows after them keep their line numbers.
    good = json.dumps(GOOD["alpaca"])
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join([good, '{"instruction": "q", "output": "a"', "", good, "[1,", '{"instruction": 3}']) + "\n")
    cfg = _cfg("local", train_data_path=str(path), val_data_path=str(path), on_malformed_row="skip")
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        rows = load_rows(cfg, "train")
    assert len(rows) == 2
    assert [row_name(r, "") for r in rows] == [f"{path} row 1", f"{path} row 4"]
    assert (f"skipped 3 malformed alpaca rows of 5 (first: {path} row 2: invalid JSON: Expecting ',' delimiter "
            "at column 35)") in caplog.text
    # Read again for the validation split: said once.
    load_rows(cfg, "val")
    assert caplog.text.count("skipped 3 malformed") == 1


def test_non_utf8_file_names_the_line_and_a_byte_order_mark_is_read(tmp_path, shared_data):
    # Latin-1 text used to stop with a bare UnicodeDecodeError naming no file.
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD["alpaca"]).encode() + b"\n" + '{"instruction": "caf\u00e9", "output": "a"}\n'
                     .encode("latin-1"))
    with pytest.raises(DataFormatError, match=rf"{path} line 2: not UTF-8 text \(byte 0xe9"):
        load_rows(_cfg(str(path)), "train")
    # A BOM (as Windows editors write) before SQuAD's official layout: it used to hide the
    # `data` list, so the file read as one row of unknown format.
    squad = tmp_path / "squad_bom.json"
    squad.write_bytes(b"\xef\xbb\xbf" + Path(f"{shared_data}/squad/sample_v2_transformers_fixture.json").read_bytes())
    assert load_rows(_cfg(str(squad)), "train") == load_rows(_cfg("squad"), "train")


def test_jsonl_errors_name_the_line_past_blank_lines(tmp_path):
    # Blank lines are no rows: errors used to give the row's position, not its line.
    bad, message = BAD["alpaca"]
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n".join([json.dumps(GOOD["alpaca"]), "", json.dumps(GOOD["alpaca"]), "  ", "", json.dumps(bad)]))
    with pytest.raises(DataFormatError, match=rf"{path} row 6: {message}"):
        load_rows(_cfg(str(path)), "train")
    # The same through the plain parse (mixed types), where a U+2028 inside a string is no line break.
    mixed = {"instruction": ["not", "a", "string"], "output": "a"}
    path.write_text("\n".join([json.dumps({**GOOD["alpaca"], "output": "a\u2028b"}, ensure_ascii=False), "",
                               json.dumps(mixed)]))
    with pytest.raises(DataFormatError, match=rf"{path} row 3: `instruction` must be a string"):
        load_rows(_cfg(str(path)), "train")


def test_mixed_types_fall_back_and_name_row(tmp_path):
    # Arrow cannot give these rows one schema; the row normaliser still names the bad one.
    rows = [GOOD["alpaca"], {"instruction": ["not", "a", "string"], "output": "a"}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataFormatError, match=rf"{path} row 2: `instruction` must be a string"):
        load_rows(_cfg(path), "train")


def test_a_column_of_mixed_types_keeps_its_values_as_written(tmp_path):
    # `datasets` reads a column that is a number in one row and a string in another as `Json`, and
    # decoded its strings as JSON: the reference "025" became 25 (an exact-match task then scores
    # every right answer 0), "true" became True.
    rows = [{"question": "a?", "answer": 26}, {"question": "b?", "answer": "025"}, {"question": "c?", "answer": "true"}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    whole = load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    assert [r["answer"] for r in whole] == ["26", "025", "true"]
    # Integers beside a decimal: `datasets` types the column float, so 26 read as "26.0" and an
    # integer past 2**53 lost its last digits.
    rows = [{"question": "a?", "answer": 26}, {"question": "b?", "answer": 2.5},
            {"question": "c?", "answer": 10**16 + 1}]
    path = _write_jsonl(tmp_path / "numbers.jsonl", rows)
    whole = load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    assert [r["answer"] for r in whole] == ["26", "2.5", "10000000000000001"]
    # Strings that are all dates: typed timestamps, the answer came back a datetime (an error).
    path = _write_jsonl(tmp_path / "dates.jsonl", [{"question": "a?", "answer": "2024-01-01"},
                                                    {"question": "b?", "answer": "2024-01-02 10:00:00"}])
    whole = load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
    assert [r["answer"] for r in whole] == ["2024-01-01", "2024-01-02 10:00:00"]


def test_row_of_another_format_is_the_one_named(tmp_path):
    # Arrow gives every row every key of the file (None where a row has none): the first row's
    # format is told by its own keys, and the odd row is the one the error names.
    rows = [GOOD["prompt_completion"], GOOD["prompt_completion"], GOOD["messages"]]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataFormatError, match=rf"{path} row 3: prompt_completion row is missing `prompt` "
                                              r"\(.*; keys with a value: \['messages'\]\)"):
        load_rows(_cfg(path), "train")


def test_unknown_dataset_and_undetectable_format(tmp_path):
    with pytest.raises(ValueError, match="not a registered dataset .*hub"):
        load_rows(_cfg("no_such_org/no_such_dataset"), "train")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(_cfg(str(tmp_path / "missing.jsonl")), "train")
    # A folder is there: it was reported as "file not found".
    with pytest.raises(InputError, match=rf"data.train_data_path: {tmp_path} is a folder, not a .jsonl/.json/.parquet/.csv "
                                         r"file: .*as data.dataset_name"):
        load_rows(_cfg("local", train_data_path=str(tmp_path)), "train")
    path = _write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1}, {"foo": 2}])
    with pytest.raises(DataFormatError, match=rf"{path} row 1: cannot tell the format"):
        load_rows(_cfg(path), "train")
    # Rows under a top-level key other than `data`: the whole file was "row 1" of no format.
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"train": [{"question": "1+1?", "answer": "2"}] * 3, "version": 1}))
    with pytest.raises(DataFormatError, match=rf"{path}: the file is one JSON object whose `train` holds rows, not "
                                              "a list of rows"):
        load_rows(_cfg(str(path)), "train")
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    assert load_rows(_cfg("local", train_data_path=str(path), val_data_path=str(path)), "train")[0]["messages"]


def test_folder_without_a_validation_split_holds_rows_out_of_train(tmp_path):
    # A folder of data files (or a hub set) read by `datasets.load_dataset` with only a train split:
    # validation held out a fraction of its rows, but training still read all of them, so every
    # validation row was also trained on.
    folder = tmp_path / "shards"
    folder.mkdir()
    for part in range(2):
        _write_jsonl(folder / f"part{part}.jsonl", [{"question": f"q{part}-{i}", "answer": str(i)} for i in range(10)])
    cfg = _cfg(str(folder), val_split_fraction=0.25, dataset_kwargs={"cache_dir": str(tmp_path / "cache")})
    train, val = ({r["messages"][0]["content"] for r in load_rows(cfg, s)} for s in ("train", "val"))
    assert (len(train), len(val)) == (15, 5) and not train & val
    # A test split is the validation rows; training keeps all of its own.
    _write_jsonl(folder / "test.jsonl", [{"question": "t", "answer": "1"}])
    for part in range(2):
        (folder / f"part{part}.jsonl").rename(folder / f"train-{part}.jsonl")
    assert len(load_rows(cfg, "train")) == 20 and len(load_rows(cfg, "val")) == 1


def test_a_folder_of_json_files_keeps_values_as_written(tmp_path):
    # As a file read alone does: the folder's features, inferred by datasets, made 26 "26.0",
    # 10000000000000001 "1e+16" and the string "025" 25.0.
    folder = tmp_path / "fold"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [{"question": "a", "answer": 26}, {"question": "b", "answer": 1.5},
                                          {"question": "c", "answer": 10000000000000001}])
    _write_jsonl(folder / "test.jsonl", [{"question": "e", "answer": "025"}, {"question": "f", "answer": 7}])
    cfg = _cfg(str(folder), dataset_kwargs={"cache_dir": str(tmp_path / "cache")})
    assert [r["answer"] for r in load_rows(cfg, "train")] == ["26", "1.5", "10000000000000001"]
    assert [r["answer"] for r in load_rows(cfg, "val")] == ["025", "7"]


def test_an_empty_parquet_file_is_an_empty_dataset_and_odd_inputs_are_named(tmp_path):
    import pandas as pd

    path = tmp_path / "empty.parquet"
    pd.DataFrame({"question": [], "answer": []}).astype(str).to_parquet(path)
    with pytest.raises(DataFormatError, match=r"empty.parquet: the dataset is empty"):  # "BatchSize must be > 0"
        load_rows(_cfg("local", train_data_path=str(path)), "train")
    # A boolean answer is no text (a list was refused; True became "True").
    bad = tmp_path / "bool.jsonl"
    _write_jsonl(bad, [{"question": "q", "answer": True}])
    with pytest.raises(DataFormatError, match="answer"):
        load_rows(_cfg("local", train_data_path=str(bad)), "train")
    # An empty system prompt file added nothing, silently.
    ok = tmp_path / "ok.jsonl"
    _write_jsonl(ok, [{"question": "q", "answer": "1"}])
    (tmp_path / "system.txt").write_text("  \n")
    with pytest.raises(InputError, match=r"data.system_prompt_file .*system.txt: the file is empty"):
        load_rows(_cfg("local", train_data_path=str(ok), val_data_path=str(ok),
                       system_prompt_file=str(tmp_path / "system.txt")), "train")


def test_a_folder_whose_files_cannot_be_one_dataset_names_the_file(tmp_path):
    # datasets said "An error occurred while generating the dataset", and posttrain that "loading it
    # from the hub failed", naming neither the file nor its line.
    from posttrain.config import InputError

    folder = tmp_path / "shards"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [{"question": "q", "answer": "1"}])
    (folder / "b.jsonl").write_text('{"question": "q", "answer": "2"}\n{"question": oops\n')
    cfg = _cfg(str(folder), dataset_kwargs={"cache_dir": str(tmp_path / "cache")})
    with pytest.raises(InputError, match=r"data.dataset_name=.*: the folder's file .*b\.jsonl row 2: invalid JSON"):
        load_rows(cfg, "train")
    _write_jsonl(folder / "b.jsonl", [{"prompt": "q", "completion": "2"}])
    with pytest.raises(InputError, match=r"the folder's files have different columns, which one dataset cannot hold "
                                         r"\(a\.jsonl: answer, question; b\.jsonl: completion, prompt\)"):
        load_rows(cfg, "train")


def test_a_folders_rows_are_named_by_their_file_and_line(tmp_path):
    # Errors counted rows across the files joined ("folder[train] row 23"), and a byte that is not
    # UTF-8 failed as datasets' UnicodeDecodeError naming neither file nor line.
    folder = tmp_path / "shards"
    folder.mkdir()
    _write_jsonl(folder / "train-00000-of-00002.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(20)])
    rows = [{"prompt": f"q{i}", "completion": "" if i == 2 else "c"} for i in range(20)]
    _write_jsonl(folder / "train-00001-of-00002.jsonl", rows)
    cfg = _cfg(str(folder), dataset_kwargs={"cache_dir": str(tmp_path / "cache")})
    with pytest.raises(DataFormatError, match=r"train-00001-of-00002\.jsonl row 3: .*completion.* empty"):
        load_rows(cfg, "train")
    _write_jsonl(folder / "train-00001-of-00002.jsonl", [{**r, "completion": "c"} for r in rows])
    assert len(load_rows(cfg, "train")) + len(load_rows(cfg, "val")) == 40
    with open(folder / "train-00001-of-00002.jsonl", "ab") as f:
        f.write(b'{"prompt": "x\xff", "completion": "c"}\n')
    with pytest.raises(InputError, match=r"train-00001-of-00002\.jsonl.* line 21.*UTF-8"):
        load_rows(cfg, "train")


def test_save_to_disk_folder_is_read_with_its_splits(tmp_path):
    # `Dataset.save_to_disk` folders stopped with datasets' "use `load_from_disk` instead", which no
    # setting could do.
    import datasets

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(8)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:6]),
                          "test": datasets.Dataset.from_list(rows[6:])}).save_to_disk(str(tmp_path / "dict"))
    assert [len(load_rows(_cfg(str(tmp_path / "dict")), s)) for s in ("train", "val")] == [6, 2]
    # One saved split is the train rows, a fraction of them held out for validation.
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    cfg = _cfg(str(tmp_path / "one"), val_split_fraction=0.25)
    train, val = load_rows(cfg, "train"), load_rows(cfg, "val")
    assert (len(train), len(val)) == (6, 2) and not set(map(str, train)) & set(map(str, val))
    # Errors name the folder, not "hub:one" (which reads as a download).
    with pytest.raises(InputError, match=rf"^{re.escape(str(tmp_path / 'one'))}\[train\]: data.column_map renames "
                                         r"'nothere'"):
        load_rows(_cfg(str(tmp_path / "one"), column_map={"nothere": "x"}), "train")


def test_dataset_kwargs_no_dataset_reads_are_refused(tmp_path):
    # The schema's example {"question_key": "q"} was read by nothing: a file whose question column
    # it meant to name loaded as if it were not there.
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}] * 4)
    for name in (path, "gsm8k", "local"):
        with pytest.raises(InputError, match=rf"data.dataset_kwargs \['question_key'\]: data.dataset_name="
                                             rf"'{re.escape(name)}' reads none"):
            load_rows(_cfg(name, train_data_path=path, dataset_kwargs={"question_key": "q"}), "train")
    puzzles = load_rows(_cfg("sliding_puzzle", num_train=2, dataset_kwargs={"size": 2}), "train")
    assert len(puzzles) == 2


def test_settings_of_the_generated_datasets_no_dataset_reads_are_named(tmp_path, caplog):
    # data.num_train=5 with a file (or gsm8k) trained on every row without a word.
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(40)])
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        rows = load_rows(_cfg(path, num_train=5, num_digits=3, demo_puzzle_error_rate=0.5), "train")
        load_rows(_cfg(path, num_train=5, num_digits=3, demo_puzzle_error_rate=0.5), "val")  # said once
    assert len(rows) == 38  # all but the held-out two
    said = [r.getMessage() for r in caplog.records if "generated datasets" in r.getMessage()]
    assert said == [f"data.num_digits=3, data.demo_puzzle_error_rate=0.5, data.num_train=5: settings of the generated "
                    f"datasets (arithmetic, sliding_puzzle, stories), left unread: data.dataset_name={path!r} reads "
                    "none of them (data.max_train_samples / data.max_val_samples cap any dataset's rows)"]
    # A mixture reads a setting when one of its datasets does; the defaults are never named.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.data.datasets"):
        mixed = load_rows(_cfg(None, num_train=5, mixture=[{"dataset_name": "arithmetic"}, {"dataset_name": path}]),
                          "train")
        load_rows(_cfg(path), "train")
    assert len(mixed) == 5 + 38 and not [r for r in caplog.records if "generated datasets" in r.getMessage()]


def test_data_file_paths_no_dataset_reads_are_refused(tmp_path):
    # A validation file named beside the arithmetic task or a hub set (or a folder) was not read:
    # validation scored the dataset's own rows.
    path = _write_jsonl(tmp_path / "val.jsonl", [{"question": "1+1?", "answer": "2"}] * 2)
    (tmp_path / "folder").mkdir()
    _write_jsonl(tmp_path / "folder" / "train.jsonl", [{"question": "1+1?", "answer": "2"}] * 2)
    for name, reads in (("arithmetic", "made from its settings"),
                        (str(tmp_path / "folder"), "a folder: its files' names give its splits")):
        with pytest.raises(InputError, match=rf"data.val_data_path: data.dataset_name='{re.escape(name)}' reads no "
                                             rf"data files \({reads}"):
            load_rows(_cfg(name, val_data_path=path), "val")
    assert load_rows(_cfg("gsm8k", train_data_path=path, val_data_path=path), "val")[0]["answer"] == "2"


def test_assistant_turn_without_text_or_tool_calls_is_malformed():
    # A blank gpt turn (ShareGPT dumps hold them where a reply failed) was trained as it stood:
    # the model learnt to answer with its end of turn alone. An empty alpaca `output` or DPO
    # `chosen` was already refused; a tool-calling turn may still have no text.
    blank = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n"}]}
    with pytest.raises(DataFormatError, match=r"^f row 1: `messages\[1\]\.content` is empty: an assistant turn "
                                              "without text or tool calls"):
        normalize_row(blank, "messages", "f row 1")
    gpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}
    with pytest.raises(DataFormatError, match=r"`conversations\[1\]\.value` is empty"):
        normalize_row(gpt, "sharegpt", "f row 1")
    pair = {"prompt": "q", "chosen": [{"role": "assistant", "content": ""}], "rejected": "b"}
    with pytest.raises(DataFormatError, match=r"`chosen\[0\]\.content` is empty"):
        normalize_row(pair, "preference", "f row 1")
    call = {"type": "function", "function": {"name": "add", "arguments": {}}}
    calling = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": "0"}, {"role": "assistant", "content": "0"}]}
    assert normalize_row(calling, "messages", "f row 1")["messages"][1]["content"] == ""


def test_whole_conversation_pairs_beside_their_prompt_are_split_at_the_shared_start():
    # UltraFeedback binarized (the usual DPO set) gives the question as `prompt` and each response
    # as the whole [user, assistant] conversation: it was refused ("`chosen` must start with an
    # assistant message"), where TRL reads the prompt as the start the two share.
    user = {"role": "user", "content": "What is 2+2?"}
    row = {"prompt": "What is 2+2?", "chosen": [user, {"role": "assistant", "content": "4"}],
           "rejected": [user, {"role": "assistant", "content": "5"}], "messages": [user], "score_chosen": 8.0}
    assert normalize_row(row, detect_format(row), "f row 1") == {
        "prompt_messages": [user], "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}]}
    system = {"role": "system", "content": "Be brief."}
    row = {**row, "chosen": [system, *row["chosen"]], "rejected": [system, *row["rejected"]]}
    assert normalize_row(row, "preference", "f row 1")["prompt_messages"] == [system, user]
    with pytest.raises(DataFormatError, match=r"^f row 1: `chosen` and `rejected` are whole conversations whose shared "
                                              "start does not end with `prompt`"):
        normalize_row({**row, "prompt": "What is 3+3?"}, "preference", "f row 1")


def test_csv_file_and_folder_keep_cells_as_written_and_name_lines(tmp_path):
    # A .csv file was refused ("unsupported data file type") while a folder of them loaded, and
    # the folder's cells came back typed by pandas: the answer "045" as 45.
    text = 'prompt,completion\n07+38=,045\n"Say ""hi"", then stop",hi\n,\n3+4=,007\n'
    (tmp_path / "pc.csv").write_text(text)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.csv").write_text("prompt,completion\n1+1=,02\n2+2=,04\n3+3=,06\n")
    rows = load_rows(DataConfig(dataset_name=str(tmp_path / "pc.csv"), val_split_fraction=0.3), "train")
    rows += load_rows(DataConfig(dataset_name=str(tmp_path / "pc.csv"), val_split_fraction=0.3), "val")
    answers = sorted(r["messages"][1]["content"] for r in rows)
    assert answers == ["007", "045", "hi"]  # the line of empty cells is no row
    assert 'Say "hi", then stop' in [r["messages"][0]["content"] for r in rows]
    folder = [r["messages"][1]["content"] for split in ("train", "val")
              for r in load_rows(DataConfig(dataset_name=str(tmp_path / "folder")), split)]
    assert sorted(folder) == ["02", "04", "06"]
    (tmp_path / "bad.csv").write_text("prompt,completion\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(DataFormatError, match=r"bad.csv row 3: 3 cells, but the header names 2 columns "
                                              r"\(prompt, completion\)"):
        load_rows(DataConfig(dataset_name=str(tmp_path / "bad.csv")), "train")
    # Skipped and counted under skip, as a malformed JSON line is.
    (tmp_path / "bad.csv").write_text("prompt,completion\n" + "".join(f"{i}+1=,{i + 1}\n" for i in range(9))
                                      + "2+2=,4,extra\n")
    skip = DataConfig(dataset_name=str(tmp_path / "bad.csv"), on_malformed_row="skip")
    assert len(load_rows(skip, "train") + load_rows(skip, "val")) == 9
    (tmp_path / "dup.csv").write_text("prompt,prompt\na,b\n")
    with pytest.raises(DataFormatError, match=r"dup.csv line 1: the header names 'prompt' twice"):
        load_rows(DataConfig(dataset_name=str(tmp_path / "dup.csv")), "train")
    (tmp_path / "quote.csv").write_text('prompt,completion\n1+1=,2\n"2+2=,4\n3+3=,6\n')
    with pytest.raises(DataFormatError, match=r"quote.csv line 3: cannot read the file as CSV"):  # where it opens
        load_rows(DataConfig(dataset_name=str(tmp_path / "quote.csv")), "train")
    # A cell longer than the csv module's 131,072 characters (a whole document) is read.
    (tmp_path / "long.csv").write_text("prompt,completion\n" + "".join(f"q{i},a{i}\n" for i in range(9))
                                       + "Summarise,\"" + "word " * 40_000 + "\"\n")
    rows = [r for split in ("train", "val") for r in load_rows(DataConfig(dataset_name=str(tmp_path / "long.csv")),
                                                                split)]
    assert sorted(len(r["messages"][1]["content"]) for r in rows)[-1] == 200_000
    # A folder whose first file makes a column text and whose second writes numbers and NA there:
    # the second's cells were typed before the join ("02108" came back as 2108, "NA" as missing).
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.csv").write_text("prompt,completion\nName a colour,red\nName a fruit,apple\n")
    (tmp_path / "mixed" / "b.csv").write_text("prompt,completion\nZip of Boston?,02108\nPi?,3.10\nNo?,NA\n")
    mixed = [r["messages"][1]["content"] for split in ("train", "val")
             for r in load_rows(DataConfig(dataset_name=str(tmp_path / "mixed")), split)]
    assert sorted(mixed) == ["02108", "3.10", "NA", "apple", "red"]
    (tmp_path / "noanswer.csv").write_text("prompt,completion\n1+1=,2\n2+2=,\n")
    with pytest.raises(DataFormatError, match=r"noanswer.csv row 3: prompt_completion row is missing `completion` "
                                              r"\(its value is a null or an empty CSV cell"):
        load_rows(DataConfig(dataset_name=str(tmp_path / "noanswer.csv")), "train")


def test_kto_labels_written_as_text_in_a_csv_file(tmp_path):
    from posttrain.data.formats import labelled_rows

    (tmp_path / "kto.csv").write_text("prompt,completion,label\nhi,hello,true\nhi,go away,0\nhey,hey there,1\n"
                                      "yo,what,False\n")
    with labelled_rows():
        rows = [r for split in ("train", "val")
                for r in load_rows(DataConfig(dataset_name=str(tmp_path / "kto.csv")), split)]
    assert sorted((r["messages"][-1]["content"], r["label"]) for r in rows) == [
        ("go away", False), ("hello", True), ("hey there", True), ("what", False)]


def test_an_empty_system_message_is_none_and_sharegpt_errors_name_value():
    # OpenAI and ShareGPT exports write `"content": ""` where no system prompt was set: it failed the file.
    row = normalize_row({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello"}]}, "messages", "f.jsonl line 1")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    row = normalize_row({"conversations": [{"from": "system", "value": "  "}, {"from": "human", "value": "hi"},
                                           {"from": "gpt", "value": "hello"}]}, "sharegpt", "f.jsonl line 2")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    with pytest.raises(DataFormatError, match=r"`conversations\[1\].value` is empty"):
        normalize_row({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}, "sharegpt", "line 3")
    with pytest.raises(DataFormatError, match=r"`messages\[0\].content` is empty"):  # a user turn is still needed
        normalize_row({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}, "messages", "l4")


def test_trl_standard_implicit_prompt_pairs_split_at_their_last_shared_word():
    # {"chosen": "The sky is blue.", "rejected": "The sky is green."} failed with "no shared context".
    def split(chosen, rejected):
        out = normalize_row({"chosen": chosen, "rejected": rejected}, "preference", "f row 1")
        return out["prompt_messages"], out["chosen"][0]["content"], out["rejected"][0]["content"]

    assert split("The sky is blue.", "The sky is green.") == ([{"role": "user", "content": "The sky is"}],
                                                             " blue.", " green.")
    assert split("The sky is green", "The sky is grey")[1:] == (" green", " grey")  # not "en" and "y"
    assert split("Hello world", "Hello world!")[1:] == (" world", " world!")
    assert split("The cat sat.", "The catfish sat.")[1:] == (" cat sat.", " catfish sat.")  # not "fish sat."
    with pytest.raises(DataFormatError, match=r"f row 1: preference row has no shared context: `chosen` and "
                                              r"`rejected` are texts that do not start with the same words"):
        split("Paris is big", "Rome is big")
    # A null prompt column is what such a row's error names (it explained only the texts').
    with pytest.raises(DataFormatError, match=r"f row 3 \(`prompt` is null\): preference row has no shared context"):
        normalize_row({"prompt": None, "chosen": "6", "rejected": "7"}, "preference", "f row 3")
    # A number where a response goes: a string is as welcome as messages (it asked for messages only).
    with pytest.raises(DataFormatError, match=r"^f row 3: `chosen` must be a string, a message or a list of "
                                              r"messages, got int: 6$"):
        normalize_row({"prompt": "q", "chosen": 6, "rejected": "7"}, "preference", "f row 3")


def test_math_rows_of_one_file_may_use_question_or_problem(tmp_path):
    # `datasets` gave the `problem` row a `question` of None: "math row is missing `question`".
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{"question": "1+1=", "answer": "2"},
                                                    {"problem": "2+2=", "answer": "4"}])
    rows = load_rows(_cfg(path), "train") + load_rows(_cfg(path), "val")
    assert sorted((r["messages"][-1]["content"], r["answer"]) for r in rows) == [("1+1=", "2"), ("2+2=", "4")]
    path = _write_jsonl(tmp_path / "neither.jsonl", [{"question": "1+1=", "answer": "2"}, {"answer": "4"}] * 2)
    with pytest.raises(DataFormatError, match="row 2: math row is missing `question`"):
        load_rows(_cfg(path), "train")


def test_alpaca_layout_preference_rows_keep_their_instruction_input_system_and_history():
    # LLaMA-Factory's alpaca preference layout: the instruction and input were dropped, and the
    # words both answers start with ("The answer is") became the prompt.
    row = normalize_row({"instruction": "What is 2+0?", "input": "Answer in words.", "system": "Be brief.",
                         "history": [["Hi", "Hello"]], "chosen": "The answer is 2.", "rejected": "The answer is 3."},
                        "preference", "row 1")
    assert row == {"prompt_messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                       {"role": "user", "content": "What is 2+0?\n\nAnswer in words."}],
                   "chosen": [{"role": "assistant", "content": "The answer is 2."}],
                   "rejected": [{"role": "assistant", "content": "The answer is 3."}]}
    plain = normalize_row({"question": "What is 2+0?", "chosen": "Two.", "rejected": "Three."}, "preference", "row 1")
    assert plain["prompt_messages"] == [{"role": "user", "content": "What is 2+0?"}]


def test_a_run_that_never_validates_trains_on_every_row(tmp_path):
    # It held 5% out (never trained on nor validated), and a one-row file could not train at all.
    from types import SimpleNamespace

    from posttrain.algorithms.offline import offline_data
    from posttrain.config import load_config
    from posttrain.data.datasets import run_rows
    from posttrain.data.processors import collate, process_sft_rows

    rows = [{"instruction": f"Say {i}", "output": str(i)} for i in range(40)]
    path = _write_jsonl(tmp_path / "a.jsonl", rows)
    never = SimpleNamespace(val_period=0, val_at_start=False, val_at_end=False)
    train, val = run_rows(_cfg(path), never)
    assert [r["messages"][-1]["content"] for r in train] == [str(i) for i in range(40)] and val == []
    train, val = run_rows(_cfg(path), SimpleNamespace(val_period=0, val_at_start=False, val_at_end=True))
    assert (len(train), len(val)) == (38, 2)
    # Named through data.dataset_name=local, or in a mixture, the same file held out 2 rows all the same.
    assert len(run_rows(_cfg("local", train_data_path=str(path)), never)[0]) == 40
    mixture = DataConfig(mixture=[{"dataset_name": str(path)}, {"dataset_name": "local", "train_data_path": str(path)}])
    assert len(run_rows(mixture, never)[0]) == 80
    one = _write_jsonl(tmp_path / "one.jsonl", rows[:1])
    cfg = load_config("sft", None, [f"data.dataset_name={one}", "policy.model_name=embedded:tiny",
                                    "sft.val_period=0", "sft.val_at_start=false", "sft.val_at_end=false",
                                    "policy.train_global_batch_size=1", "policy.train_micro_batch_size=1"])
    data = offline_data(cfg, "sft", process_sft_rows, collate)
    assert data.stats["train"]["kept"] == 1 and "val" not in data.stats and data.val_batches == []


def test_a_folder_with_splits_named_otherwise_is_read_by_the_split_dataset_kwargs_names(tmp_path):
    # UltraFeedback's hub layout (data/train_prefs-*.parquet, ...): "no train split" said no way
    # forward, and data.dataset_kwargs={split: ...} crashed in the builder a CSV folder is re-read by.
    (tmp_path / "uf" / "data").mkdir(parents=True)
    for split in ("train_prefs", "test_prefs"):
        (tmp_path / "uf" / "data" / f"{split}-00000-of-00001.csv").write_text(
            "prompt,chosen,rejected\n" + "".join(f"Zip {i}?,0{i}108,{i}\n" for i in range(10)))
    with pytest.raises(InputError, match=r"has no train split \(splits: .*\); name the one to train on, e.g. "
                                         r"data.dataset_kwargs=\{split: \w+_prefs\}"):
        load_rows(DataConfig(dataset_name=str(tmp_path / "uf")), "train")
    cfg = DataConfig(dataset_name=str(tmp_path / "uf"), dataset_kwargs={"split": "train_prefs"})
    rows = load_rows(cfg, "train") + load_rows(cfg, "val")
    assert sorted(r["chosen"][0]["content"] for r in rows) == sorted(f"0{i}108" for i in range(10))  # as written


def test_a_saved_dataset_whose_validation_split_is_named_valid_validates_on_it(tmp_path):
    # Its `valid` split was left unread and 5% of the training rows held out instead.
    import datasets

    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(12)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:10]),
                          "valid": datasets.Dataset.from_list(rows[10:])}).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(dataset_name=str(tmp_path / "saved"))
    assert [r["answer"] for r in load_rows(cfg, "val")] == ["11", "12"] and len(load_rows(cfg, "train")) == 10


def test_prompt_and_response_rows_say_how_to_train_on_the_response():
    # The advice was an environment, which `posttrain sft` refuses.
    with pytest.raises(DataFormatError, match=re.escape("for SFT on its `response` column, rename it: "
                                                        "data.column_map={response: completion}")):
        normalize_row({"prompt": "Hi", "response": "Hello"}, "prompt", "row 1")


def test_a_lone_surrogate_is_a_row_error_not_a_tokenizer_traceback(tmp_path):
    # Valid JSON ("\ud800" without its pair) that no UTF-8 tokenizer takes: it reached the
    # tokenizer and ended the run in a TypeError traceback naming no file or row, even with
    # data.on_malformed_row=skip.
    user = {"role": "user", "content": "a\ud800b"}
    rows = [({"messages": [user, {"role": "assistant", "content": "2"}]}, "messages", r"`messages\[0\]\.content`"),
            ({"prompt": "x\udfff", "chosen": "6", "rejected": "7"}, "preference", r"`prompt_messages\[0\]\.content`"),
            ({"question": "1+1?", "answer": "\ud83d"}, "math", "`answer`"),
            # Tool-call arguments reach the chat template too.
            ({"messages": [{"role": "user", "content": "look it up"},
                           {"role": "assistant", "content": "", "tool_calls": [
                               {"type": "function", "function": {"name": "search", "arguments": {"q": "a\ud800b"}}}]},
                           {"role": "tool", "content": "found"}, {"role": "assistant", "content": "ok"}]},
             "messages", r"`messages\[1\]\.tool_calls\[0\]\.function\.arguments\.q`")]
    for row, fmt, what in rows:
        with pytest.raises(DataFormatError, match=rf"^f\.jsonl row 8: {what} is not valid text: a lone UTF-16 "
                                                  r"surrogate '\\ud[89a-f]\w\w' at character \d"):
            normalize_row(json.loads(json.dumps(row)), fmt, "f.jsonl row 8")
    # In a key of the arguments, it is the key the message names (it called the dict text).
    row = rows[-1][0]
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"q\ud800": "x"}
    with pytest.raises(DataFormatError, match=r"^f\.jsonl row 8: a key of `messages\[1\]\.tool_calls\[0\]\.function"
                                              r"\.arguments` is not valid text: a lone UTF-16 surrogate '\\ud800' at "
                                              r"character 1$"):
        normalize_row(json.loads(json.dumps(row)), "messages", "f.jsonl row 8")
    path = _write_jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "user", "content": "1+1?"},
                                                             {"role": "assistant", "content": "2"}]}] * 3
                        + [{"messages": [user, {"role": "assistant", "content": "2"}]}])
    with pytest.raises(DataFormatError, match=r"s\.jsonl.* 4: .*is not valid text"):
        load_rows(_cfg("local", train_data_path=path, val_data_path=path), "train")
