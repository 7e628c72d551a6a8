"""Dataset row formats, normalised into the two canonical rows every algorithm consumes.

Canonical rows:
    SFT:        {"messages": [{"role": ..., "content": ...}, ...]}            (+ "tools" if given),
                or {"text": ...}: plain text, trained whole without a chat template
    preference: {"prompt_messages": [...], "chosen": [...msgs], "rejected": [...msgs]}

`chosen` / `rejected` are the continuations after the shared context (usually one assistant
message). Roles are "system", "user", "assistant" and "tool".

Accepted input formats (`data.format`, auto-detected from the first row's keys when null):
    messages            {"messages": [{"role", "content"}, ...]}                  (OpenAI); with a
                        `task_name` it is an RL/eval row kept as is (prompt messages, `answer`,
                        `demonstration`, `metadata`, `stop_strings`, `tools`); a final assistant
                        message is the `answer` (NeMo RL's [user, assistant] math rows; one with
                        a reasoning field is the `demonstration` too), refused beside an
                        `answer`. Tool calling as
                        OpenAI writes it: an assistant message's `tool_calls` ([{"id"?, "type":
                        "function", "function": {"name", "arguments"}}], its `content` may then be
                        null; arguments as a JSON string are decoded) and a tool message's
                        `tool_call_id` and `name` are kept for the chat template, which renders
                        the calls (and trains on them) in the model's own format. Calls without
                        an id get one, and a result naming no call answers the next call of the
                        turn before it. A row's `tools` (a list of function schemas, or a JSON
                        string of one, as LLaMA-Factory writes it) become OpenAI schemas.
                        An assistant message's reasoning written apart from its content, in
                        `reasoning_content`, `reasoning` or `thinking` (any format's messages),
                        is kept as `reasoning_content` for the chat template (refused on other
                        roles, and beside a <think> block in the content). An assistant
                        message's `weight: 0` (OpenAI fine-tuning's) gets no loss
    sharegpt            {"conversations": [{"from", "value"}, ...], "system"?}    (ShareGPT; a
                        `function_call` turn's JSON call(s) become the assistant's `tool_calls`)
    alpaca              {"instruction", "input"?, "output", "system"?, "history"?}
    prompt_completion   {"prompt": str | msgs, "completion": str | msgs}: loss on the completion
                        alone (assistant turns in the prompt are context, as TRL trains)
    prompt              {"prompt": str | msgs, <other columns>} (TRL's prompt-only GRPO data) -> an
                        RL/eval row of the environment its `task_name` (or data.task_name) names,
                        with its `answer` when given and every other column in its `metadata`
                        (TRL reward functions get them as keywords, and strings for a string
                        prompt, as TRL gives its standard format)
    squad               {"context", "question", "answers": {"text": [...]}}      (a flattened
                        SQuAD entry; the official nested file is flattened by the loader)
    math                {"question" | "problem", "answer", "solution"?} -> an RL/eval row
                        {"messages": [user], "answer", "task_name": "math"}; a GSM8K answer
                        ("... #### 18") keeps only its final number; the worked solution (the
                        GSM8K answer as written, else MATH's `solution`) is the `demonstration`
    text                {"text"}: plain text for SFT (TRL's language-modeling format), every token
                        trained, BOS and EOS per data.add_bos / data.add_eos
    code                {"text" | "prompt", "test_list", "test_setup_code"? | "test_imports"?} (MBPP,
                        full or sanitized) or {"prompt", "test", "entry_point"} (HumanEval) -> an
                        RL/eval row {"messages": [user], "task_name": "code", "metadata": {"tests",
                        "setup"}, "answer": the reference solution, when given} for the `code`
                        environment
    preference          {"chosen", "rejected"} with the shared context in `conversations`
                        (LLaMA-Factory), `instruction` + `input`? + `history`? (LLaMA-Factory's
                        alpaca layout), `prompt` (TRL; str or msgs), `messages`, `question`, or implicit
                        (chosen/rejected are full conversations sharing a prefix, which may
                        end with a given `prompt`, as in UltraFeedback binarized; or texts, TRL's
                        standard implicit prompt, whose shared words are the prompt: a user turn,
                        the rests the assistant's, through the chat template, where TRL trains
                        the raw text). Each
                        response may be a string, one message, or a list of messages; a
                        string that is an Anthropic HH-RLHF transcript ("\n\nHuman: ...
                        \n\nAssistant: ...") is read as the conversation it writes.

A conversation row with `label: false` (LLaMA-Factory's and TRL's unpaired KTO data: an answer
not to give) is malformed for SFT, which would train the model to imitate it. Read for KTO
(`labelled_rows`), a conversation row keeps its boolean `label`, and one without such a label (or
whose last message is not the assistant's response) is malformed there. SFT on RL/eval
rows (the math and code formats, the embedded tasks) trains each prompt's `demonstration`, else
its `answer`, as the assistant turn (`demonstration_messages`), as GRPO's warm-up does.

Every error names the source (file) and the 1-based row number.
"""

from __future__ import annotations

import contextvars
import json
import re
from contextlib import contextmanager
from typing import Any, Iterator

from posttrain.config import InputError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt", "squad", "preference", "math", "code",
           "text")

# ShareGPT speaker names -> roles (LLaMA-Factory's tool-call data uses function_call/observation).
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
_ROLES = ("system", "user", "assistant", "tool")

# An assistant turn's reasoning written apart from its content, under the names data and chat
# templates give it: `reasoning_content` (Qwen3's template, DeepSeek's API, vLLM's older one),
# `reasoning` (vLLM's newer API, OpenRouter), `thinking` (gpt-oss's template and the data made for
# it, Ollama). Canonical rows carry it as REASONING_KEY, the name most templates read;
# `render_chat` hands it to a template under the name that template reads.
REASONING_KEY = "reasoning_content"
# An assistant message that gets no loss carries WEIGHT_KEY: 0 (OpenAI fine-tuning's per-message
# "weight", 0 or 1; a prompt/completion row's assistant turns inside its prompt). Trained ones carry none.
WEIGHT_KEY = "weight"


def trained_message(message: dict[str, Any]) -> bool:
    """Whether a message of a conversation SFT, DPO, KTO or an RM trains on gets loss."""
    return message["role"] == "assistant" and message.get(WEIGHT_KEY, 1) != 0


# Metadata of a prompt-only row whose prompt was a string (TRL's standard format): its TRL reward
# functions get prompts and completions as strings. Underscored: no reward function's keyword.
TEXT_PROMPT_KEY = "_text_prompt"
REASONING_FIELDS = (REASONING_KEY, "reasoning", "thinking")


class DataFormatError(InputError):
    """A malformed dataset row; the message names the file and the row."""


def where(source: str, row_number: int) -> str:
    """How errors locate a row: `file row N` (1-based; the line number for JSONL)."""
    return f"{source} row {row_number}"


class SourcedRow(dict):
    """A canonical row that remembers where it was read (`where`, as `where()` writes it).

    Errors raised after a row left its file (a chat template refusing it, a prompt too long for
    the context) then name the file and row: its place in a split says little once rows were held
    out for validation or capped. A plain dict otherwise (equality, JSON, pickling); a copy made
    with `{**row}` forgets the place, `with_fields` keeps it."""

    __slots__ = ("where",)

    def __init__(self, row: dict[str, Any], where: str):
        super().__init__(row)
        self.where = where


def with_fields(row: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """`{**row, **fields}`, still knowing where `row` was read."""
    out = {**row, **fields}
    return SourcedRow(out, row.where) if isinstance(row, SourcedRow) else out


def row_name(row: dict[str, Any], fallback: str) -> str:
    """How an error names `row`: the file and row it was read from, else `fallback` (e.g.
    "train row 3", its place in the split; generated rows come from no file)."""
    return getattr(row, "where", None) or fallback


def detect_format(row: dict[str, Any], loc: str = "row") -> str:
    """The format of a row from its keys (see the module docstring)."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    keys = set(_keys(row))
    if "chosen" in keys or "rejected" in keys:
        return "preference"
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    if "prompt" in keys and "completion" in keys:
        return "prompt_completion"
    if {"context", "question", "answers"} <= keys:
        return "squad"
    if "answer" in keys and ("question" in keys or "problem" in keys):
        return "math"
    if "test_list" in keys or {"prompt", "test", "entry_point"} <= keys:
        return "code"
    if "prompt" in keys:
        return "prompt"
    if "text" in keys:
        return "text"
    raise DataFormatError(
        f"{loc}: cannot tell the format from the keys {sorted(keys)}; expected one of: messages "
        "(`messages`), sharegpt (`conversations`), alpaca (`instruction`/`output`), prompt_completion "
        "(`prompt`/`completion`), prompt (`prompt` alone: TRL's GRPO data), squad (`context`/`question`/`answers`), "
        "preference (`chosen`/"
        "`rejected`), math (`question`|`problem`/`answer`), code (`test_list`, or `prompt`/`test`/"
        "`entry_point`), text (`text`: plain text to train on whole); or set data.format, and rename the file's columns to those keys with "
        "data.column_map={<column>: <key>, ...}"
    )


# Set while `posttrain kto` reads its data (`labelled_rows`); a context variable rather than an
# argument through every loader (files, folders, hub sets, the registry) to the one line that reads it.
_LABELLED = contextvars.ContextVar("posttrain_labelled_rows", default=False)


@contextmanager
def labelled_rows() -> Iterator[None]:
    """Rows read inside keep their `label` (KTO's desirable / undesirable) instead of refusing a false one;
    a conversation without a boolean label is malformed (`_labelled`)."""
    token = _LABELLED.set(True)
    try:
        yield
    finally:
        _LABELLED.reset(token)


def normalize_row(row: dict[str, Any], fmt: str, loc: str, task_name: str | None = None) -> dict[str, Any]:
    """Normalise one row of format `fmt` into its canonical row; `loc` is `where(file, n)`.
    `task_name` (`data.task_name`): a `messages` row is then an RL/eval row scored by that
    environment, as one with its own `task_name` is (its prompt needs no assistant message); so is
    the conversation of another format (sharegpt, alpaca, ...), its final assistant message the answer."""
    if fmt not in _NORMALIZERS:
        raise ValueError(f"unknown data format {fmt!r}; valid: {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    if task_name is not None and fmt in ("messages", "prompt"):
        row = {**row, "task_name": task_name}
    out = _NORMALIZERS[fmt](row, loc)
    if task_name is not None and "messages" in out and "task_name" not in out:
        # Left an SFT row, GRPO would prompt with the whole conversation, answer included, and
        # score it in `math` (the environment of rows without a task_name).
        out = _from_messages({**out, "task_name": task_name}, loc)
    _check_unicode(out, loc)
    if _LABELLED.get():
        return _labelled(out, row.get("label"), loc)
    if _as_label(row.get("label")) is False and "task_name" not in out and not is_preference(out):
        raise DataFormatError(
            f"{loc}: `label` is false: KTO data (responses labelled desirable or not), which `posttrain kto` "
            "trains on; SFT would train the model to imitate this answer not to give, DPO and RM need "
            "`chosen`/`rejected` pairs and eval prompts to answer, which KTO data has not. For SFT on its "
            "desirable rows, set data.on_malformed_row=skip (the others counted)"
        )
    return out


def _labelled(out: dict[str, Any], label: Any, loc: str) -> dict[str, Any]:
    """A KTO conversation row with its boolean `label`; a row without one, or whose last message is
    not the response, is malformed here (skipped and counted under data.on_malformed_row=skip).
    Preference pairs (KTO unpairs them) and RL rows (refused for the whole dataset by
    `process_kto_rows`) pass as they are."""
    if "task_name" in out or is_preference(out):
        return out
    if _as_label(label) is None:
        raise DataFormatError(
            f"{loc}: KTO trains on responses labelled desirable (`label: true`) or not (`label: false`); "
            + ("this row has no `label`" if label is None else f"got label {label!r}")
            + " (or on preference pairs, `chosen`/`rejected`); fix it, or set data.on_malformed_row=skip (counted)")
    if not out["messages"] or out["messages"][-1].get("role") != "assistant":
        raise DataFormatError(f"{loc}: KTO's response is the row's last message, which must be the assistant's")
    return {**out, "label": _as_label(label)}


def _as_label(value: Any) -> bool | None:
    """A KTO label as a bool: true/false, or 1/0 as CSV and parquet exports write them (refused
    before as "got label 1"), also as text (a CSV file's cells); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):  # a CSV cell
        return value.strip().lower() in ("true", "1")
    return None


def demonstration_messages(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """What an RL/eval row's answer looks like as the model's turns after its prompt, for SFT
    (GRPO's warm-up, or `posttrain sft` on RL rows): its `demonstration` (one answer, or a list of
    messages, e.g. tool calls, their results and the answer), else its `answer`; None without both."""
    demo = row["demonstration"] if row.get("demonstration") is not None else row.get("answer")
    if demo is None:
        return None
    return [dict(m) for m in demo] if isinstance(demo, list) else [{"role": "assistant", "content": str(demo)}]


def is_preference(row: dict[str, Any]) -> bool:
    return "chosen" in row and "prompt_messages" in row


# --------------------------------------------------------------------------- helpers


def _keys(row: dict[str, Any]) -> list[str]:
    """The keys a row has: a file read through `datasets` gives every row every key of the file,
    None where the row has none (so a row of another format in the file is told by its own keys)."""
    return sorted(k for k, v in row.items() if v is not None)


def _require(row: dict[str, Any], key: str, loc: str, fmt: str) -> Any:
    if key in row and row[key] is None:
        # The file has the column (the null a file read by `datasets` gives a row without a key
        # others have, a CSV's empty cell): no column_map can help.
        raise DataFormatError(f"{loc}: {fmt} row is missing `{key}` (its value is a null or an empty CSV cell, "
                              f"or other rows of the file have the key and this one not; keys with a value: "
                              f"{_keys(row)})")
    if key not in row:
        # A file's columns named otherwise (the first row's miss) are renamed by data.column_map.
        raise DataFormatError(f"{loc}: {fmt} row is missing `{key}` (keys: {_keys(row)}; columns named otherwise: "
                              f"data.column_map={{<column>: {key}}})")
    return row[key]


def _text(value: Any, loc: str, what: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise DataFormatError(f"{loc}: `{what}` must be a string, got {type(value).__name__}: {value!r:.80}")
    if not allow_empty and not value.strip():
        raise DataFormatError(f"{loc}: `{what}` is empty")
    return value


def _lone_surrogate(text: str) -> str | None:
    """Where `text` is not UTF-8 text, said for a message; None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone UTF-16 surrogate {text[e.start]!r} at character {e.start}"
    return None


def _check_unicode(value: Any, loc: str, path: str = "") -> None:
    """Every string in a normalised row (what the tokenizer and chat template get, tool-call
    arguments included) must be UTF-8 text: JSON's "\\ud800" without its pair is valid JSON, and the
    tokenizer failed on it with a TypeError traceback naming no file or row."""
    if isinstance(value, str):
        if bad := _lone_surrogate(value):
            raise DataFormatError(f"{loc}: `{path}` is not valid text: {bad}")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and (bad := _lone_surrogate(k)):
                raise DataFormatError(f"{loc}: a key of `{path}` is not valid text: {bad}")
            _check_unicode(v, loc, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_unicode(v, loc, f"{path}[{i}]")


def _content_text(value: Any, loc: str, what: str) -> Any:
    """OpenAI's list of content parts ([{"type": "text", "text": ...}, ...]) as one string, its
    text parts joined by newlines (as vLLM's chat front end does); any other value as it is. A
    part of another type (an image) is refused: the models trained here read text only."""
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = repr(part.get("type")) if isinstance(part, dict) else type(part).__name__
            raise DataFormatError(f"{loc}: `{what}[{i}]` is a content part of type {kind}; only text parts "
                                  '({"type": "text", "text": ...}) are read')
        texts.append(part["text"])
    return "\n".join(texts)


def _message(m: Any, loc: str, what: str) -> dict[str, str]:
    """One message in OpenAI ({role, content}) or ShareGPT ({from, value}) form."""
    if not isinstance(m, dict):
        raise DataFormatError(f"{loc}: {what} must be a message object, got {type(m).__name__}: {m!r:.80}")
    if "role" in m and m["role"] is not None:
        role, content, field = m["role"], m.get("content"), "content"
    elif "from" in m and m["from"] is not None:
        speaker = m["from"]
        if speaker not in _SHAREGPT_ROLES:
            raise DataFormatError(
                f"{loc}: {what} has unknown speaker `from: {speaker!r}`; valid: {', '.join(_SHAREGPT_ROLES)}"
            )
        role, content = _SHAREGPT_ROLES[speaker], m.get("value")
        field = "value"
        if speaker == "function_call":  # LLaMA-Factory: the call(s) as JSON text; templates want them structured
            calls = _written_calls(content, loc, what)
            return _with_reasoning({"role": "assistant", "content": "", "tool_calls": calls}, m, loc, what)
    else:
        raise DataFormatError(f"{loc}: {what} needs `role`/`content` or `from`/`value`, got keys {sorted(m)}")
    if role not in _ROLES:
        raise DataFormatError(f"{loc}: {what} has unknown role {role!r}; valid: {', '.join(_ROLES)}")
    content = _content_text(content, loc, f"{what}.{field}")
    calls = _tool_calls(m.get("tool_calls"), loc, f"{what}.tool_calls") if role == "assistant" else None
    if content is None and calls:
        content = ""  # OpenAI's tool-calling turn: `content: null`, the calls in `tool_calls`
    if role == "assistant" and not calls and isinstance(content, str) and not content.strip():
        # As an empty alpaca `output` or DPO `chosen` is: trained, it teaches the model to answer
        # with nothing but its end of turn (ShareGPT dumps hold blank turns where a reply failed).
        raise DataFormatError(f"{loc}: `{what}.{field}` is empty: an assistant turn without text or tool calls "
                              "would train the model to answer with nothing")
    # A tool-calling assistant turn may be empty (OpenAI's `content: null`); others may not.
    out = {"role": role, "content": _text(content, loc, f"{what}.{field}", allow_empty=bool(calls))}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":  # which call the result answers and the tool's name, for templates that show them
        out.update({k: _text(m[k], loc, f"{what}.{k}") for k in ("tool_call_id", "name") if m.get(k) is not None})
    if m.get(WEIGHT_KEY) is not None:
        if role != "assistant" or isinstance(m[WEIGHT_KEY], bool) or m[WEIGHT_KEY] not in (0, 1):
            raise DataFormatError(f"{loc}: `{what}.{WEIGHT_KEY}` must be 0 (no loss) or 1 on an assistant message, "
                                  f"got {m[WEIGHT_KEY]!r} on a {role} message")
        if m[WEIGHT_KEY] == 0:
            out[WEIGHT_KEY] = 0
    return _with_reasoning(out, m, loc, what)


def _with_reasoning(out: dict[str, Any], m: dict[str, Any], loc: str, what: str) -> dict[str, Any]:
    """`out` (message `m` read) with the reasoning `m` writes in a field of its own
    (`REASONING_FIELDS`) as `out[REASONING_KEY]`. Empty or null is none: a file read through
    `datasets` gives every message every key of the file."""
    given = {}
    for key in REASONING_FIELDS:
        if m.get(key) is not None and _text(m[key], loc, f"{what}.{key}", allow_empty=True).strip():
            given[key] = m[key]
    if not given:
        return out
    names = " and ".join(f"`{k}`" for k in given)
    if out["role"] != "assistant":
        raise DataFormatError(f"{loc}: `{what}.{next(iter(given))}` is reasoning on a {out['role']} message; only "
                              "assistant turns have reasoning for a chat template to render")
    if len({text.strip() for text in given.values()}) > 1:
        raise DataFormatError(f"{loc}: `{what}` gives different reasoning in {names}; keep one")
    if "<think>" in out["content"] or "</think>" in out["content"]:
        # Qwen3's template writes the field as the <think> block and the content as it is, a second
        # block included; others write one of them. Which of the two is the turn's is not ours to guess.
        raise DataFormatError(f"{loc}: `{what}` has its reasoning both in {names} and as a <think> block in "
                              "`content`; keep one")
    return {**out, REASONING_KEY: next(iter(given.values()))}


def _named_function(item: Any, loc: str, what: str, shape: str) -> dict[str, Any]:
    """`item["function"]` (OpenAI's wrapper of a call or a tool schema) or `item` itself, which
    must name a function."""
    fn = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataFormatError(f"{loc}: `{what}` must be {shape}, got {item!r:.80}")
    return fn


def _tool_calls(value: Any, loc: str, what: str) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls` in the OpenAI form {"id"?, "type": "function",
    "function": {"name", "arguments"}} (a flat {"name", "arguments"} is read too). Arguments
    written as a JSON string are decoded: chat templates write them with `tojson`."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise DataFormatError(f"{loc}: `{what}` must be a list of calls, got {type(value).__name__}: {value!r:.80}")
    calls = []
    for i, call in enumerate(value):
        fn = _named_function(call, loc, f"{what}[{i}]", '{"function": {"name": ..., "arguments": {...}}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{loc}: `{what}[{i}].function.arguments` is not JSON ({e.msg}): {args!r:.80}")
        if not isinstance(args, dict):
            raise DataFormatError(f"{loc}: `{what}[{i}].function.arguments` must be an object, got {args!r:.80}")
        out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and call.get("id") is not None:
            out = {"id": _text(call["id"], loc, f"{what}[{i}].id"), **out}
        calls.append(out)
    return calls


def _written_calls(value: Any, loc: str, what: str) -> list[dict[str, Any]]:
    """Tool calls written as JSON text ({"name", "arguments"}, or a list of them) in OpenAI form."""
    from posttrain.environments.tool_calls import parse_tool_calls

    calls = parse_tool_calls(_text(value, loc, f"{what}.value"))
    bad = next((c.error for c in calls if c.error), None) if calls else "no JSON call"
    if bad:
        raise DataFormatError(f'{loc}: {what} is a function_call but not {{"name": ..., "arguments": {{...}}}} '
                              f"({bad}): {value!r:.80}")
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _messages(value: Any, loc: str, what: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataFormatError(f"{loc}: `{what}` must be a non-empty list of messages, got {value!r:.80}")
    return _link_tool_results([_message(m, loc, f"{what}[{i}]") for i, m in enumerate(value)
                               if not _empty_system(m)])


def _empty_system(m: Any) -> bool:
    """A system message without text (`"content": ""`), as OpenAI and ShareGPT exports write where
    no system prompt was set: none, as chat templates take it (it failed the whole file)."""
    if not isinstance(m, dict):
        return False
    role, content = (m.get("role"), m.get("content")) if m.get("role") is not None else (m.get("from"), m.get("value"))
    return role == "system" and (content is None or (isinstance(content, str) and not content.strip()))


def _link_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every tool call gets an id (its own, else `tool_call_ids`'s from the calls), and each tool
    result that names no call answers the next unanswered call of the turn before it, taking its
    id and tool name: templates such as Mistral's render results only against their calls."""
    from posttrain.environments.tool_calls import ToolCall, tool_call_ids

    pending: list[tuple[str, str]] = []  # (id, name) of the last calling turn's unanswered calls
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            ids = tool_call_ids([ToolCall(c["function"]["name"], id=c.get("id")) for c in calls],
                                seed=f"{i}\0{json.dumps(calls, sort_keys=True, default=str)}")
            m["tool_calls"] = [{**c, "id": c.get("id") or call_id} for c, call_id in zip(calls, ids)]
            pending = [(c["id"], c["function"]["name"]) for c in m["tool_calls"]]
        elif m["role"] == "tool":
            answered = next((p for p in pending if p[0] == m.get("tool_call_id")), pending[0] if pending else None)
            if answered is not None:
                pending.remove(answered)
                m.setdefault("tool_call_id", answered[0])
                m.setdefault("name", answered[1])
        else:
            pending = []
    return messages


def _require_assistant(messages: list[dict[str, str]], loc: str, what: str, hint: str = "") -> None:
    if not any(trained_message(m) for m in messages):
        weighed = any(m["role"] == "assistant" for m in messages)
        raise DataFormatError(f"{loc}: `{what}` has no assistant message"
                              + (f" without {WEIGHT_KEY} 0" if weighed else "") + f", so nothing to train on{hint}")


# A turn of an Anthropic HH-RLHF transcript: the speaker after a blank line.
_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")


def _empty_answer(value: Any) -> bool:
    """Whether `value`, a response, is one assistant answer without text (or tool calls)."""
    if isinstance(value, str):
        return not value.strip()
    m = value[0] if isinstance(value, list) and len(value) == 1 else value
    if not isinstance(m, dict) or m.get("role", m.get("from")) not in ("assistant", "gpt") or m.get("tool_calls"):
        return False
    text = m.get("content", m.get("value"))
    return text is None or (isinstance(text, str) and not text.strip())


def _response(value: Any, loc: str, what: str) -> list[dict[str, str]]:
    """A response: a string (one assistant message, or an HH-RLHF transcript, the conversation
    it writes), one message, or a list of messages."""
    if isinstance(value, str) and value.startswith("\n\nHuman:"):
        # The chosen and rejected transcripts share their turns up to the last answer: the
        # conversations split into the prompt and the two answers as any implicit-prompt pair.
        turns = _HH_TURN.split(value)[1:]  # speaker, text, speaker, text, ...
        return _messages([{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
                          for who, text in zip(turns[::2], turns[1::2])], loc, what)
    if isinstance(value, str):
        return [{"role": "assistant", "content": _text(value, loc, what)}]
    if isinstance(value, dict):
        return [_message(value, loc, what)]
    if not isinstance(value, list):
        raise DataFormatError(f"{loc}: `{what}` must be a string, a message or a list of messages, got "
                              f"{type(value).__name__}: {value!r:.80}")
    return _messages(value, loc, what)


def _with_tools(out: dict[str, Any], row: dict[str, Any], loc: str) -> dict[str, Any]:
    if row.get("tools"):
        out["tools"] = _tool_schemas(row["tools"], loc)
    return out


def _tool_schemas(value: Any, loc: str) -> list[dict[str, Any]]:
    """A row's `tools` as chat templates take them: a list of OpenAI function schemas
    ({"type": "function", "function": {"name", "description", "parameters"}}). LLaMA-Factory
    writes them as a JSON string of bare function schemas; both are read."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{loc}: `tools` is a string but not JSON ({e.msg}): {value!r:.80}") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list):
        raise DataFormatError(f"{loc}: `tools` must be a list of function schemas, got {value!r:.80}")
    schemas = []
    for i, tool in enumerate(value):
        fn = _named_function(tool, loc, f"tools[{i}]", 'a function schema {"name": ..., "parameters": ...}')
        schemas.append({"type": "function", "function": fn})
    return schemas


# --------------------------------------------------------------------------- formats


def _with_system(messages: list[dict], row: dict[str, Any], loc: str) -> list[dict]:
    """`messages` after the row's `system` column (LLaMA-Factory's, TRL's) as a system message; a
    conversation's own system turn wins over the column, as in LLaMA-Factory (both gave two system
    messages, which many chat templates refuse)."""
    if row.get("system") and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": _text(row["system"], loc, "system")})
    return messages


def _from_messages(row: dict[str, Any], loc: str) -> dict[str, Any]:
    messages = _with_system(_messages(_require(row, "messages", loc, "messages"), loc, "messages"), row, loc)
    # A file read through `datasets` gives every row every key: a row without one has task_name None.
    if row.get("task_name") is not None:
        # An RL/eval row (docs/architecture.md): the prompt, and the environment that scores it.
        if not isinstance(row["task_name"], str) or not row["task_name"]:
            raise DataFormatError(f"{loc}: `task_name` must be an environment name, got {row['task_name']!r}")
        keep = {k: row[k] for k in ("answer", "demonstration", "metadata", "stop_strings") if k in row}
        if keep.get("stop_strings") is not None:
            keep["stop_strings"] = _stop_strings(keep["stop_strings"], loc)
        if messages[-1]["role"] == "assistant":
            # Left in the prompt, GRPO would reward copying it and eval score it as the model's. A
            # conversation without an `answer` ends with its reference, as NeMo RL's math rows
            # ([user, assistant]) give the ground truth.
            last = messages[-1]
            if keep.get("answer") is not None or not isinstance(last.get("content"), str) or "tool_calls" in last:
                raise DataFormatError(
                    f"{loc}: an RL/eval row's prompt ends with an assistant message, which the model would see "
                    "before answering: give the prompt only, the reference in `answer` (or the reference as the "
                    "last message and no `answer`)"
                )
            messages, keep["answer"] = messages[:-1], last["content"]
            if REASONING_KEY in last and keep.get("demonstration") is None:
                keep["demonstration"] = [last]  # SFT (warm-up) trains the answer with its reasoning
        return _with_tools({"messages": messages, "task_name": row["task_name"], **keep}, row, loc)
    _require_assistant(messages, loc, "messages", hint="; for GRPO or eval, a prompt row names the environment "
                       "that scores it: give it a `task_name`, or set data.task_name")
    return _with_tools({"messages": messages}, row, loc)


def _stop_strings(value: Any, loc: str) -> list[str]:
    """A row's `stop_strings`: a list of non-empty strings ("\n" is one). A bare string would be
    read as a list of its characters (every character a stop), and "" would match at once."""
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise DataFormatError(f"{loc}: `stop_strings` must be a list of non-empty strings, got {value!r:.80}")
    return value


def _from_sharegpt(row: dict[str, Any], loc: str) -> dict[str, Any]:
    messages = _with_system(_messages(_require(row, "conversations", loc, "sharegpt"), loc, "conversations"), row,
                            loc)
    _require_assistant(messages, loc, "conversations")
    return _with_tools({"messages": messages}, row, loc)


def _alpaca_prompt(row: dict[str, Any], loc: str, fmt: str) -> list[dict]:
    """The conversation an Alpaca row's answer follows: its `system`, its `history` pairs, and the
    instruction with its `input` (LLaMA-Factory's alpaca layout, of SFT and of preference rows)."""
    instruction = _text(_require(row, "instruction", loc, fmt), loc, "instruction")
    extra = row.get("input") or ""
    _text(extra, loc, "input", allow_empty=True)
    messages = _with_system([], row, loc)
    for i, turn in enumerate(row.get("history") or []):
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise DataFormatError(f"{loc}: `history[{i}]` must be a [user, assistant] pair, got {turn!r:.80}")
        messages.append({"role": "user", "content": _text(turn[0], loc, f"history[{i}][0]")})
        messages.append({"role": "assistant", "content": _text(turn[1], loc, f"history[{i}][1]")})
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [*messages, {"role": "user", "content": user}]


def _from_alpaca(row: dict[str, Any], loc: str) -> dict[str, Any]:
    prompt = _alpaca_prompt(row, loc, "alpaca")
    output = _text(_require(row, "output", loc, "alpaca"), loc, "output")
    return {"messages": [*prompt, {"role": "assistant", "content": output}]}


def _from_prompt_completion(row: dict[str, Any], loc: str) -> dict[str, Any]:
    prompt = _require(row, "prompt", loc, "prompt_completion")
    completion = _require(row, "completion", loc, "prompt_completion")
    prompt_msgs = (
        [{"role": "user", "content": _text(prompt, loc, "prompt")}]
        if isinstance(prompt, str)
        else _messages(prompt, loc, "prompt")
    )
    # Loss on the completion alone (TRL's completion_only_loss): assistant turns of the prompt are context.
    prompt_msgs = [{**m, WEIGHT_KEY: 0} if m["role"] == "assistant" else m for m in prompt_msgs]
    messages = prompt_msgs + _response(completion, loc, "completion")
    _require_assistant(messages, loc, "completion")
    return {"messages": messages}


def _answer_text(answer: Any, loc: str) -> str:
    """A reference answer as text: a number is its text; a bool (an int to isinstance) is no
    answer ("True" was taken as one)."""
    return _text(str(answer) if isinstance(answer, (int, float)) and not isinstance(answer, bool) else answer,
                 loc, "answer")


def _from_text(row: dict[str, Any], loc: str) -> dict[str, Any]:
    """Plain text (TRL SFTTrainer's language-modeling data, `dataset_text_field="text"`): trained
    whole, without a chat template."""
    return {"text": _text(_require(row, "text", loc, "text"), loc, "text")}


# An RL row's own keys, which a prompt-only row's other columns are not.
_RL_ROW_KEYS = ("prompt", "task_name", "answer", "metadata", "demonstration", "stop_strings", "tools")


def _from_prompt(row: dict[str, Any], loc: str) -> dict[str, Any]:
    """TRL's prompt-only GRPO data: an RL/eval row of the prompt (a string is one user message),
    its `answer` when given, and every other column in its metadata, whence TRL reward functions
    get them as keywords (`solution`, test cases). A string prompt is TRL's standard format:
    such functions get the prompt and completion as strings (`TEXT_PROMPT_KEY`), as TRL gives them."""
    prompt = _require(row, "prompt", loc, "prompt")
    text = isinstance(prompt, str)
    messages = _with_system([{"role": "user", "content": _text(prompt, loc, "prompt")}] if text
                            else _messages(prompt, loc, "prompt"), row, loc)
    if row.get("task_name") is None:
        # A column named like an answer to train on: prompt/completion data under other names.
        answer = next((k for k in ("response", "output", "target")
                       if isinstance(row.get(k), str)), None)
        sft = (f"; for SFT on its `{answer}` column, rename it: data.column_map={{{answer}: completion}}"
               if answer else "")
        raise DataFormatError(f"{loc}: a prompt-only row (`prompt` without `completion`: TRL's GRPO data) is scored "
                              "by an environment: set data.task_name=<environment> (e.g. your reward functions' "
                              f"env.<name>.target), or give the rows a task_name{sft}")
    if messages[-1]["role"] == "assistant":
        raise DataFormatError(f"{loc}: the `prompt` ends with an assistant message, which the model would see before "
                              "answering; for SFT on prompt and answer use `prompt`/`completion`")
    metadata = {k: v for k, v in row.items() if k not in _RL_ROW_KEYS and k != "system" and v is not None}
    metadata.update(row.get("metadata") or {})
    if text:
        metadata[TEXT_PROMPT_KEY] = True
    out = {"messages": messages, "task_name": row["task_name"], "metadata": metadata}
    if row.get("answer") is not None:
        out["answer"] = _answer_text(row["answer"], loc)
    if row.get("demonstration") is not None:
        out["demonstration"] = row["demonstration"]
    if row.get("stop_strings") is not None:
        out["stop_strings"] = _stop_strings(row["stop_strings"], loc)
    return _with_tools(out, row, loc)


def _from_squad(row: dict[str, Any], loc: str) -> dict[str, Any]:
    """Context as the system message, the question as the user turn, the first answer as the
    assistant turn (NeMo RL's SQuAD SFT layout; its chat template renders `Context: ...
    Question: ... Answer: ...`). Unanswerable SQuAD v2 questions (no answer) are errors."""
    context = _text(_require(row, "context", loc, "squad"), loc, "context")
    question = _text(_require(row, "question", loc, "squad"), loc, "question")
    answers = _require(row, "answers", loc, "squad")
    texts = answers.get("text") if isinstance(answers, dict) else answers
    if isinstance(texts, list) and texts and isinstance(texts[0], dict):  # official: [{"text", "answer_start"}]
        texts = [a.get("text") for a in texts]
    if not isinstance(texts, list) or not texts:
        raise DataFormatError(f"{loc}: `answers` has no answer text (unanswerable question?): {answers!r:.80}")
    return {
        "messages": [
            {"role": "system", "content": context},
            {"role": "user", "content": question},
            {"role": "assistant", "content": _text(texts[0], loc, "answers.text[0]")},
        ]
    }


def _from_preference(row: dict[str, Any], loc: str) -> dict[str, Any]:
    for key in ("chosen", "rejected"):
        _require(row, key, loc, "preference")  # a preference row needs both
    chosen = _response(row["chosen"], loc, "chosen")
    # An empty rejected answer is a preference for any answer over none (TRL takes it); an empty
    # chosen one, or an empty completion, would teach the model to say nothing.
    rejected = ([{"role": "assistant", "content": ""}] if _empty_answer(row["rejected"])
                else _response(row["rejected"], loc, "rejected"))
    # `instruction` (with `input`): LLaMA-Factory's alpaca preference layout; `question` a plain one.
    context_keys = ("conversations", "prompt", "messages", "context", "instruction", "question")
    context_key = next((k for k in context_keys if row.get(k)), None)
    # A prompt column whose value is null or empty leaves the pair to say its prompt itself; if it
    # cannot, that column is what the error names.
    blank = next((f" (`{k}` is {'null' if row[k] is None else 'empty'})" for k in context_keys if k in row), "")
    if context_key == "instruction":
        prompt = _alpaca_prompt(row, loc, "preference")
    elif context_key is None and len(chosen) == len(rejected) == 1 and isinstance(row["chosen"], str):
        prompt, chosen, rejected = _split_shared_text(chosen[0]["content"], rejected[0]["content"], loc + blank)
    elif context_key is None:
        prompt, chosen, rejected = _split_shared_prefix(chosen, rejected, loc + blank)
    else:
        if isinstance(row[context_key], str):
            prompt = [{"role": "user", "content": _text(row[context_key], loc, context_key)}]
        else:
            prompt = _messages(row[context_key], loc, context_key)
        if chosen[0]["role"] != "assistant" and rejected[0]["role"] != "assistant":
            # Whole conversations beside a copy of their prompt (UltraFeedback binarized: `prompt`
            # the question, `chosen`/`rejected` [user, assistant]): as TRL reads them, the prompt
            # is the start they share, which must end with the given one.
            shared, chosen, rejected = _split_shared_prefix(chosen, rejected, loc)
            if shared[-len(prompt):] != prompt:
                raise DataFormatError(f"{loc}: `chosen` and `rejected` are whole conversations whose shared start "
                                      f"does not end with `{context_key}`; give the responses alone, or no "
                                      f"`{context_key}`")
            prompt = shared
    prompt = _with_system(prompt, row, loc)
    for key, resp in (("chosen", chosen), ("rejected", rejected)):
        if resp[0]["role"] != "assistant":
            raise DataFormatError(f"{loc}: `{key}` must start with an assistant message, got role {resp[0]['role']!r}")
    if chosen == rejected:
        # Its loss has no gradient, yet it counts in the batch's pairs and as a miss in the reward accuracy.
        raise DataFormatError(f"{loc}: `chosen` and `rejected` are the same response, so the pair prefers nothing")
    return _with_tools({"prompt_messages": prompt, "chosen": chosen, "rejected": rejected}, row, loc)


def _split_shared_text(chosen: str, rejected: str, loc: str) -> tuple[list, list, list]:
    """TRL's standard implicit-prompt pair ({"chosen": "The sky is blue.", "rejected": "The sky is
    green."}): the text both start with, up to its last whitespace (a word they share in part,
    "gre" of "green" and "grey", stays in the responses), is the prompt, a user message; the
    rests are the responses, which keep their leading space."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    # The responses start at a whitespace of both: within the shared text, or right after it.
    after = all(n < len(t) and t[n].isspace() for t in (chosen, rejected))
    cut = n if after else max(chosen.rfind(c, 0, n) for c in " \n\t")
    if cut <= 0 or not chosen[:cut].strip():
        raise DataFormatError(
            f"{loc}: preference row has no shared context: `chosen` and `rejected` are texts that do not start with "
            "the same words; give the prompt in `prompt` (or `conversations`)")
    prompt = [{"role": "user", "content": chosen[:cut]}]
    return prompt, [{"role": "assistant", "content": chosen[cut:]}], [{"role": "assistant", "content": rejected[cut:]}]


def _split_shared_prefix(chosen: list[dict], rejected: list[dict], loc: str) -> tuple[list, list, list]:
    """Implicit-prompt pairs (e.g. Anthropic HH): the longest common message prefix is the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise DataFormatError(
            f"{loc}: preference row has no shared context: give `prompt` or `conversations`, or make "
            "`chosen`/`rejected` full conversations that share their prompt messages"
        )
    return chosen[:n], chosen[n:], rejected[n:]


def _from_math(row: dict[str, Any], loc: str) -> dict[str, Any]:
    # A file read by `datasets` gives every row both keys when some rows have each (None for the other).
    key = "problem" if row.get("question") is None and row.get("problem") is not None else "question"
    question = _text(_require(row, key, loc, "math"), loc, key)
    answer = _answer_text(_require(row, "answer", loc, "math"), loc)
    # The worked solution is what SFT and GRPO's warm-up imitate: without it they trained the
    # model to answer with the bare final number.
    solution = row.get("solution") if isinstance(row.get("solution"), str) and row["solution"].strip() else None
    if "####" in answer:  # GSM8K: the reasoning, then "#### <final number>"
        solution, answer = answer, answer.rsplit("####", 1)[1].strip().replace(",", "")
    metadata = {k: v for k, v in row.items() if k not in (key, "answer") and isinstance(v, (str, int, float))}
    out = {"messages": [{"role": "user", "content": question}], "answer": answer, "task_name": "math",
           "metadata": metadata}
    return {**out, "demonstration": solution} if solution is not None else out


def _from_code(row: dict[str, Any], loc: str) -> dict[str, Any]:
    if "test_list" in row:  # MBPP: a task in words; its tests show the function's name and use
        key = "text" if "text" in row else "prompt"
        task = _text(_require(row, key, loc, "code"), loc, key)
        tests = row["test_list"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise DataFormatError(f"{loc}: `test_list` must be a non-empty list of test statements (strings)")
        setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
        content = f"{task}\nYour code should pass these tests:\n" + "\n".join(tests)
        solution = row.get("code")
    else:  # HumanEval: a signature and docstring to complete; `test` defines check(candidate)
        prompt = _text(_require(row, "prompt", loc, "code"), loc, "prompt")
        test = _text(_require(row, "test", loc, "code"), loc, "test")
        entry = _text(_require(row, "entry_point", loc, "code"), loc, "entry_point")
        tests = [f"{test}\ncheck({entry})"]
        # The prompt's imports (typing's List, math), which a completion may leave out.
        setup = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        content = f"Complete this Python function and answer with all of it in a ```python block:\n```python\n{prompt}```"
        solution = prompt + row["canonical_solution"] if isinstance(row.get("canonical_solution"), str) else None
    if not isinstance(setup, str):
        raise DataFormatError(f"{loc}: the test set-up code must be a string")
    metadata = {k: v for k, v in row.items() if k in ("task_id", "source_file") and isinstance(v, (str, int))}
    out = {"messages": [{"role": "user", "content": content}], "task_name": "code",
           "metadata": {**metadata, "tests": tests, "setup": setup}}
    if isinstance(solution, str) and solution.strip():  # the reference, for grpo.warmup_sft_steps and eval logs
        out["answer"] = f"```python\n{solution.strip()}\n```"
    return out


_NORMALIZERS = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
    "prompt_completion": _from_prompt_completion,
    "prompt": _from_prompt,
    "squad": _from_squad,
    "preference": _from_preference,
    "math": _from_math,
    "code": _from_code,
    "text": _from_text,
}
