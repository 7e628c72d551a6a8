"""Tokenization of canonical rows into training examples and batches.

A conversation is rendered with the tokenizer's chat template (`policy.tokenizer.chat_template`
overrides it) one message at a time: the text each message adds to the rendered prefix is
tokenized on its own (as a continuation: `encode_continuation`), so the token boundaries of the
loss mask are exact; the messages before the first user message that get no loss (a system
prompt) are rendered with it, as no render ends before it (`first_user_message`). The loss mask
is 1 on assistant tokens only (content and the template's end-of-turn marker, not the
`<|assistant|>`-style header the generation prompt adds, so training matches generation; with
`data.add_generation_prompt=false` prompts end without that header, so it is trained). A
template that renders an earlier turn differently once later messages follow (Qwen3's: an empty
`<think></think>` block in the last assistant turn alone, no reasoning in the turns before the
last user message) makes one example per stretch of turns, each turn trained as the model
generates it after the prompt the template gives it then (`tokenize_conversation`); a preference
pair's response must be one sequence. A template that drops the reasoning of a trained assistant
turn, a `<think>` block in its content (DeepSeek-R1's from every turn) or its
`reasoning_content` field (one that reads no such field: Llama's), is an error naming the row
and turn, not a model silently trained on the answers alone (`check_reasoning_rendered`).

Rows longer than the context follow `data.truncation`: "drop" removes them, "truncate" cuts
them at the right (a row of several examples goes whole under "drop", and keeps the examples
that fit under "truncate"); rows left without a single loss token are removed too. The counts come
back in the stats dict (the algorithms log them), and a dataset with no row left is an
error, not a silent zero-step run.

Batches follow the training-batch contract (docs/architecture.md): `input_ids [B, S]`,
`input_lengths [B]`, `token_mask [B, S]` (1 where token t gets loss), `sample_mask [B]`.
Preference batches interleave pairs: row 2i is chosen, row 2i+1 rejected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from typing import Any, Callable, Iterator

import torch

from posttrain.config import InputError
from posttrain.data.batch import BatchedDataDict
from posttrain.data.formats import REASONING_FIELDS, REASONING_KEY, demonstration_messages, row_name, trained_message
from posttrain.schemas import DataConfig, TokenizerConfig

Example = dict[str, list[int]]  # {"input_ids": [...], "loss_mask": [...]}

log = logging.getLogger(__name__)


_TEMPLATE_REPLACED: set[str] = set()  # the model folders whose chat template a config's replaced (warned once)


def load_tokenizer(cfg: TokenizerConfig, key: str = "policy.tokenizer.name"):
    """The tokenizer named by `policy.tokenizer.name` (embedded names resolved), with the
    config's chat template applied and a pad token (EOS when the tokenizer has none); errors
    name the config `key` that gave the name."""
    from transformers import AutoTokenizer

    from posttrain.embedded import model_load_error, resolve_model_path

    path = resolve_model_path(cfg.name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise model_load_error(key, cfg.name, path, "a tokenizer", e) from None
    where = "policy.tokenizer" if key.startswith("policy.") else key.rsplit(".", 1)[0]
    if cfg.chat_template is not None:
        from posttrain.policy.hf_io import written_by_export

        if (tok.chat_template is not None and not written_by_export(tok.chat_template, cfg.chat_template)
                and path not in _TEMPLATE_REPLACED):
            # An export's own template (an SFT run's) replaced without a word: the model learned one
            # layout and the run trains (and exports) another.
            _TEMPLATE_REPLACED.add(path)
            log.warning("%s.chat_template replaces the chat template of %s, which differs: the run trains, "
                        "samples and exports with the config's", where, cfg.name)
        tok.chat_template = cfg.chat_template
    check_template_renders_content(tok, f"{where}.chat_template" if cfg.chat_template is not None
                                   else f"{key}={cfg.name!r}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy_tokenizer(policy):
    """`load_tokenizer` for `policy` (a PolicyConfig): its errors name `policy.model_name` when the
    tokenizer is the model's own (the default, or NeMo RL's `name: ${policy.model_name}` that the
    example configs write), the key the user wrote."""
    own = policy.tokenizer.name in (None, policy.model_name)
    key = "policy.model_name" if own else "policy.tokenizer.name"
    tokenizer = load_tokenizer(policy.tokenizer.model_copy(update={"name": policy.tokenizer_name}), key=key)
    check_token_ids_fit(tokenizer, policy, key)
    return tokenizer


def check_token_ids_fit(tokenizer, policy, key: str) -> None:
    """Every id the tokenizer writes, and every `policy.generation.stop_token_ids`, must be a row of
    the model's embedding: another model's tokenizer failed at the first step with an IndexError
    from inside the model, and a stop id past the vocabulary never fires."""
    from posttrain.policy.hf_io import load_model_config

    # An adapter's rows are its base's (posttrain eval loads base + adapter from its folder).
    vocab = getattr(load_model_config(policy.model_name)[1], "vocab_size", None)
    if vocab is None:
        return
    if len(tokenizer) > vocab:
        raise InputError(f"{key}: the tokenizer has {len(tokenizer)} tokens, more than the {vocab} rows of "
                         f"{policy.model_name!r}'s embedding (vocab_size): is it the model's own tokenizer?")
    past = [i for i in policy.generation.stop_token_ids or [] if not 0 <= i < vocab]
    if past:
        raise InputError(f"policy.generation.stop_token_ids: {past} are not token ids of {policy.model_name!r} "
                         f"(0 to {vocab - 1})")


def require_chat_template(tokenizer) -> None:
    """Every prompt and conversation is rendered by the chat template (`render_chat`): fail at the
    first, naming the key to set (a base model's tokenizer often has none); plain-text rows need
    none."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
            "policy.tokenizer.chat_template (e.g. \"{% for m in messages %}{{ m['content'] }}{% endfor %}\" "
            "for plain text)"
        )


# Message texts no template writes by itself, to find in a render.
_PROBE_TEXTS = {"system": "posttrain-probe-system-4d1e", "user": "posttrain-probe-user-9b2c",
                "assistant": "posttrain-probe-assistant-7a3f"}


def _probe_render(tokenizer, roles: tuple[str, ...]) -> str | None:
    """The template's text of one message of each of `roles` (their `_PROBE_TEXTS`), None when the
    template refuses that conversation (some raise on a system message: the rows' own renders say)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template([{"role": r, "content": _PROBE_TEXTS[r]} for r in roles], tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        return None


def check_template_renders_content(tokenizer, key: str) -> None:
    """Refuse a chat template that leaves out what a user says (a template of constant text, a
    file's path taken as one: every prompt the same); warn when it leaves out the assistant's (a
    prompt-only template serves single-turn GRPO, but SFT, DPO and multi-turn rollouts would train
    on nothing of the answers)."""
    text = _probe_render(tokenizer, ("user", "assistant"))
    if text is None:
        return
    shown = f"(a user message then an assistant message render as {text[:120]!r})"
    if _PROBE_TEXTS["user"] not in text:
        raise InputError(f"{key}: the chat template does not write the user message's content {shown}; every "
                         "prompt would read as the same text")
    if _PROBE_TEXTS["assistant"] not in text:
        log.warning("%s: the chat template does not write an assistant message's content %s: SFT, DPO, RM and KTO "
                    "train on nothing of the answers, and multi-turn rollouts show none of the earlier ones", key, shown)


def note_dropped_system(tokenizer, rows: list[dict[str, Any]]) -> None:
    """Warn when rows start with a system message (theirs or data.system_prompt_file's) that the
    chat template leaves out: the model would never see it, silently."""
    with_system = sum(1 for r in rows
                      if (r.get("prompt_messages") or r.get("messages") or [{}])[0].get("role") == "system")
    if not with_system:
        return
    text = _probe_render(tokenizer, ("system", "user"))
    if text is not None and _PROBE_TEXTS["system"] not in text:
        log.warning("%d of %d rows start with a system message (their own or data.system_prompt_file's), which the "
                    "chat template does not write: the model never sees it; set policy.tokenizer.chat_template to "
                    "one that renders it unless that is meant", with_system, len(rows))


# Stands in for an assistant message's content to find what the template writes around it.
CONTENT_SENTINEL = "\u2063posttrain-content\u2063"


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool, tools: Any = None) -> str:
    """The chat template's text of `messages`, followed by the template's generation prompt
    (the assistant header) when `add_generation_prompt`.

    The one place posttrain renders chat text: a prompt for the assistant's next turn (a
    generation prompt, a multi-turn observation, the prompt before a trained assistant turn)
    passes `data.add_generation_prompt`; a conversation rendered as it stands passes False.
    An assistant message's reasoning field (`REASONING_KEY`) reaches the template under the name
    it reads (`_template_reasoning_key`).
    """
    require_chat_template(tokenizer)
    key = _template_reasoning_key(tokenizer.chat_template)
    if key != REASONING_KEY and any(REASONING_KEY in m for m in messages):
        messages = [{**{k: v for k, v in m.items() if k != REASONING_KEY}, key: m[REASONING_KEY]}
                    if REASONING_KEY in m else m for m in messages]
    kwargs = {"tools": tools} if tools else {}
    if tools:
        _note_if_tools_unread(_template_text(tokenizer.chat_template))
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def first_user_message(messages: list[dict]) -> int | None:
    """Index of the first user message of `messages` (None without one): a conversation ending before it
    is one a chat template may refuse (Qwen3.5's and Qwen3-2507's raise "No user query found in
    messages."), so posttrain renders none."""
    return next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)


def _template_reasoning_key(template: str | dict | None) -> str:
    """The message field (of `REASONING_FIELDS`) that `template` reads an assistant turn's reasoning
    from: `reasoning_content` (Qwen3's), `thinking` (gpt-oss's) or `reasoning`, as an
    attribute (`message.thinking`) or an item (`message['thinking']`); `REASONING_KEY` when it
    reads none of them (`check_reasoning_rendered` then names the turns it drops). Recent
    transformers (5.24, here) add `thinking` beside `reasoning_content` themselves; older ones
    (posttrain takes >= 4.50) pass a message as it is, and none adds `reasoning`."""
    return _reasoning_key_read(_template_text(template))


def _template_text(template: str | dict | None) -> str:
    """A chat template's text: a tokenizer's several named templates joined, none as ""."""
    return " ".join(template.values()) if isinstance(template, dict) else template or ""


@functools.lru_cache(maxsize=16)
def _note_if_tools_unread(template: str) -> None:
    """Warn, once per template, when rows give `tools` (function schemas) to a chat template that
    never reads them: the model then sees calls of functions it was never shown, silently (a
    demonstration-taught tool, as grpo_tools.yaml's embedded model learns its calculator, is fine)."""
    if not re.search(r"\btools\b", template):
        log.warning("the chat template does not render the rows' `tools` (function schemas): the model sees tool "
                    "calls and results of functions it is never shown; set policy.tokenizer.chat_template to one "
                    "that renders them (the model's own, if it was trained on tool use) unless that is meant")


@functools.lru_cache(maxsize=16)
def _reasoning_key_read(text: str) -> str:
    # Cached: every render of a row with a reasoning field asks, and scanning a template that reads
    # none of the names (Llama's, 4-8 KB) costs about as much as rendering it.
    return next((k for k in REASONING_FIELDS if re.search(rf"\.{k}\b|\[\s*['\"]{k}['\"]\s*\]", text)),
                REASONING_KEY)


@contextlib.contextmanager
def naming_row(row: str, messages: list[dict]) -> Iterator[None]:
    """Errors of rendering one dataset row as InputErrors naming it (`row`: `row_name`'s, the file
    and row it was read from, else e.g. "row 3": 1-based, within its split) and its roles: many
    chat templates raise on a conversation they refuse (Mistral's and Gemma's on two user turns
    in a row, Gemma's on a system message), naming no row."""
    from jinja2 import TemplateError

    try:
        yield
    except (TemplateError, InputError) as e:
        roles = ", ".join(str(m.get("role")) for m in messages)
        what = f"the chat template rejects it: {e}" if isinstance(e, TemplateError) else str(e)
        raise InputError(f"{row} (roles {roles}): {what}") from None


def tokenize_conversation(
    messages: list[dict[str, str]],
    tokenizer,
    *,
    add_bos: bool = True,
    add_eos: bool = True,
    loss_start: int = 0,
    tools: Any = None,
    add_generation_prompt: bool = True,
    check_reasoning: bool = True,
) -> list[Example]:
    """Token ids and loss masks of one conversation: one example, unless the chat template renders
    an earlier turn differently once later messages follow; then one example per stretch of turns
    whose renders extend each other.

    Assistant messages at index >= `loss_start` get loss (a preference pair passes the
    length of its shared prompt, so earlier assistant turns of the context are not trained).
    `add_bos` prepends BOS unless the template already starts with it; `add_eos` appends EOS
    unless the template already ends with it, or with it and whitespace (it gets loss when the
    last message does).
    `add_generation_prompt` (`data.add_generation_prompt`): the template's generation prompt
    (assistant header) before a trained turn ends the prompt and gets no loss, as in the
    generation prompts of rollouts; false: it is trained as part of the assistant turn.
    `check_reasoning`: fail when the template drops the `<think>` reasoning of an assistant turn
    that gets loss (`check_reasoning_rendered`); False where the tokens are only read, as a reward
    model reads a conversation the way its template shows it.

    Each message's text is what it adds to the render of the messages before it. Qwen3's template
    writes an empty `<think></think>` block into the last assistant turn alone and drops the
    reasoning of the turns before the last user message, so a turn reads differently once a user
    turn follows: one sequence of the whole conversation would train each earlier turn as it reads
    in a later context (no block, no reasoning), which the model never generates (after Qwen3's
    generation prompt it writes its `<think>` block), and drop its reasoning from training. Where
    that happens, the example so far ends (its turns are trained as the model generated them), and
    the next one starts from the conversation as the template now renders it, as the model's
    prompt for the next turn, without loss. Text re-rendered after the example's last trained turn
    (Qwen3's writes a turn's tool results as one user turn, so the first one's end moves once a
    second follows) is tokenized again in place: it gets no loss, so nothing splits there. Rows of a
    template whose renders extend each other
    (Llama's, the embedded one) are one example, as before. Examples without a loss token are left
    out, unless none has one.
    """
    return [ex for ex, _ in _tokenized(messages, tokenizer, add_bos=add_bos, add_eos=add_eos, loss_start=loss_start,
                                       tools=tools, add_generation_prompt=add_generation_prompt,
                                       check_reasoning=check_reasoning)]


def tokenize_messages(messages: list[dict[str, str]], tokenizer, **kwargs: Any) -> Example:
    """The one example of a conversation whose trained turns must be one sequence (a preference pair's
    sides, a conversation a reward model reads): `tokenize_conversation`'s, with its arguments; an
    error when its turns that get loss fall in more than one example."""
    pieces = _tokenized(messages, tokenizer, **kwargs)
    if len(pieces) > 1:
        raise InputError(pieces[0][1]())
    return pieces[0][0]


def _tokenized(messages: list[dict], tokenizer, *, add_bos: bool = True, add_eos: bool = True, loss_start: int = 0,
               tools: Any = None, add_generation_prompt: bool = True,
               check_reasoning: bool = True) -> list[tuple[Example, Callable[[], str]]]:
    """`tokenize_conversation`'s examples, each with what makes the error `tokenize_messages` raises
    when a turn that gets loss follows it in another example ("" for the last)."""
    require_chat_template(tokenizer)
    pieces: list[tuple[Example, Callable[[], str]]] = []
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    starts: list[int] = []  # where the text of each message begins in `rendered` (at the latest)
    marks: list[int] = []  # where its tokens begin in `ids` (messages from `first` on)
    first = 0  # the first message whose text this example adds itself (those before it: its prompt)
    # The messages before the first one that gets loss are rendered in one piece, as a generation
    # prompt is (`render_prompt`): tokenized message by message, a BPE tokenizer cuts their text at
    # other places ("\n\n###" as "\n\n" "###", where the whole prompt reads "\n" "\n###"), so the
    # model would be trained on prompts it is never sampled on. Without a generation prompt to
    # render them with, the rendering starts at the first user message (a leading system message
    # alone is a conversation templates may refuse: `first_user_message`).
    first_user = first_user_message(messages) or 0
    first_trained = next((i for i, m in enumerate(messages) if trained_message(m) and i >= loss_start), None)
    lead = first_trained if first_trained is not None and add_generation_prompt else first_user
    ahead = ""  # the text of the messages before `lead`, rendered for their `starts` only
    for i, msg in enumerate(messages):
        starts.append(len(rendered or ahead))
        marks.append(len(ids))
        trains = trained_message(msg) and i >= loss_start
        if i < lead:
            if i >= first_user:
                ahead = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
            continue
        full = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if ids and not full.startswith(rendered):
            # Text re-rendered after the example's last trained turn (Qwen3's moves the end of a tool
            # result's turn once a second result follows) is tokenized again; a split is for trained turns.
            k, _ = _first_change(rendered, full, starts)
            if k >= first and any(mask) and not any(mask[marks[k]:]):
                rendered, ids, mask = rendered[: starts[k]], ids[: marks[k]], mask[: marks[k]]
                starts, marks = [*starts[:k], *[len(rendered)] * (i + 1 - k)], [*marks[:k], *[len(ids)] * (i + 1 - k)]
        prompt = None  # the conversation before a trained turn as the model is prompted for it
        if trains and add_generation_prompt:
            if i:
                prompt = render_chat(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
            else:
                # A conversation that opens with the assistant's turn (ShareGPT rows starting with "gpt"):
                # its header is what the template writes before its content, no loss (it was trained).
                stand_in = render_chat(tokenizer, [{"role": "assistant", "content": CONTENT_SENTINEL}],
                                       add_generation_prompt=False, tools=tools)
                prompt = stand_in[: stand_in.find(CONTENT_SENTINEL)] if CONTENT_SENTINEL in stand_in else None
            if prompt is not None and not full.startswith(prompt):
                prompt = None
            elif prompt is not None and prompt.startswith(rendered):
                if not ids:  # the text before may read otherwise with the generation prompt after it
                    at = len(os.path.commonprefix([ahead, prompt]))
                    starts = [min(s, at) for s in starts]
                _extend(ids, mask, tokenizer, prompt[len(rendered):], 0)
                rendered = prompt
        if trains and i and not ids and prompt is None:
            # The messages left for the generation prompt to render, which does not lead to this turn
            # (`ahead` holds them once rendering has started, at the first user message).
            before = ahead if i > first_user else render_chat(tokenizer, messages[:i], add_generation_prompt=False,
                                                              tools=tools)
            if full.startswith(before):
                _extend(ids, mask, tokenizer, before, 0)
                rendered = before
        if not full.startswith(rendered):
            context = prompt if trains else full
            if context is None:
                raise InputError(_rerendered(messages, i, rendered, full, starts,
                                             f"the assistant turn of message {i} cannot be told apart from its prompt"))
            pieces.append((_finish(messages[:i], ids, mask, rendered, starts[:i], tokenizer, add_bos=add_bos,
                                   add_eos=add_eos, loss_start=max(loss_start, first),
                                   check_reasoning=check_reasoning),
                           # Built only if tokenize_messages raises it: SFT keeps the split.
                           functools.partial(_rerendered, messages, i, rendered, context, list(starts),
                                             f"the turns that get loss (from message {loss_start} on) are not one "
                                             "sequence as the model generates them")))
            at = len(os.path.commonprefix([rendered, context]))
            starts = [min(s, at) for s in starts]  # the text before `at` reads as it did
            marks = [0] * len(marks)  # not cut at: the tokens of `context` are encoded whole
            ids, mask = [], []
            _extend(ids, mask, tokenizer, context, 0)
            rendered, first = context, i + (not trains)
            if not trains:
                continue
        _extend(ids, mask, tokenizer, full[len(rendered):], int(trains))
        rendered = full
    pieces.append((_finish(messages, ids, mask, rendered, starts, tokenizer, add_bos=add_bos, add_eos=add_eos,
                           loss_start=max(loss_start, first), check_reasoning=check_reasoning), str))
    return [p for p in pieces if any(p[0]["loss_mask"])] or pieces[-1:]


def _finish(messages: list[dict], ids: list[int], mask: list[int], rendered: str, starts: list[int], tokenizer, *,
            add_bos: bool, add_eos: bool, loss_start: int, check_reasoning: bool) -> Example:
    """The example of `messages` tokenized as `ids`/`mask` (their text `rendered`, message i's from
    `starts[i]` on), checked (`check_tool_turns_rendered`, `check_reasoning_rendered` of the turns
    from `loss_start` on), with BOS and EOS by `add_bos`/`add_eos`."""
    check_tool_turns_rendered(messages, rendered, starts)
    if check_reasoning:
        check_reasoning_rendered(messages, rendered, starts, loss_start)
    eos = tokenizer.eos_token_id
    if add_bos:
        prefixed = with_bos(ids, tokenizer)
        mask = [0] * (len(prefixed) - len(ids)) + mask
        ids = prefixed
    # ChatML templates end each turn with "<|im_end|>\n", <|im_end|> being the EOS of Qwen's chat
    # models: an EOS after the newline trained them on "<|im_end|>\n<|im_end|>".
    if add_eos and eos is not None and not rendered.rstrip().endswith(tokenizer.eos_token):
        ids = [*ids, eos]
        mask = [*mask, mask[-1] if mask else 0]
    return {"input_ids": ids, "loss_mask": mask}


def check_tool_turns_rendered(messages: list[dict], rendered: str, starts: list[int]) -> None:
    """Fail when the chat template left out a tool call or a tool result of `messages`, whose
    text `rendered` holds from `starts[i]` on for message i.

    A template that knows only system/user/assistant (a plain-text one set in
    policy.tokenizer.chat_template, a base model's) renders neither an assistant's `tool_calls`
    nor a `tool` message, without an error: SFT on tool-calling data (the shared glaive demo)
    then trained empty assistant turns and answers that quote results the model never saw. Each
    call's function name, and each result's text (or its JSON-escaped form, as templates that
    write it with `tojson` show it), must appear from that message's start on (a template may
    render a run of results at its end).
    """
    for i, msg in enumerate(messages):
        after = rendered[starts[i]:]
        missing = [f"its call of {c['function']['name']!r}" for c in msg.get("tool_calls") or []
                   if c["function"]["name"] not in after]
        result = str(msg.get("content") or "").strip()
        # transformers' `tojson` keeps non-ASCII characters as they are (ensure_ascii=False).
        escaped = json.dumps(result, ensure_ascii=False)[1:-1]
        if msg["role"] == "tool" and result and result not in after and escaped not in after:
            missing.append("the tool result")
        if missing:
            raise InputError(
                f"the chat template does not render {' and '.join(missing)} (message {i}, role {msg['role']!r}), so "
                "training would see the conversation without it; set policy.tokenizer.chat_template to a template "
                "that renders tool calls and tool results (the model's own, if it was trained on tool use)"
            )


def _reasoning_of(message: dict) -> str:
    """The reasoning of an assistant message: its reasoning field (`REASONING_KEY`, as the loader
    keeps it), else its content's text before `</think>` (and after `<think>`, which a model whose
    generation prompt opens the block does not write), the part reasoning models' chat templates
    strip (Qwen3, QwQ, DeepSeek-R1); "" when there is none."""
    content = message.get("content")
    if message.get("role") != "assistant":
        return ""
    if isinstance(message.get(REASONING_KEY), str):
        return message[REASONING_KEY].strip()
    if not isinstance(content, str) or "</think>" not in content:
        return ""
    return content.split("</think>")[0].split("<think>")[-1].strip()


def _shows(text: str, part: str) -> bool:
    # Blind to whitespace: a template may re-space the block (Qwen3's writes "<think>\n...\n</think>\n\n").
    return "".join(part.split()) in "".join(text.split())


def _reasoning_named(message: dict) -> tuple[str, str]:
    """How an error names the reasoning of `message` (`_reasoning_of`), and the ways to train it (or not)."""
    if isinstance(message.get(REASONING_KEY), str):
        # A template that writes content alone (the embedded one, Llama's) never shows a field.
        return "reasoning field", (
            "set policy.tokenizer.chat_template to a template that renders it in each assistant turn that gets loss, "
            "or move the reasoning into the content as <think>...</think> if the template keeps that, or drop the "
            "field (`reasoning_content`, `reasoning` or `thinking`) to train the answers alone")
    return "<think> reasoning", (
        "set policy.tokenizer.chat_template to a template that writes each assistant turn's content as it is, "
        "<think> block included, or remove the reasoning from the data to train the answers alone")


def check_reasoning_rendered(messages: list[dict], rendered: str, starts: list[int], loss_start: int = 0) -> None:
    """Fail when the chat template left out the reasoning (`_reasoning_of`) of an assistant message
    at index >= `loss_start` (one that gets loss), whose text `rendered` holds from `starts[i]` on.

    DeepSeek-R1's template writes every assistant turn as its text after `</think>`, and a template
    that reads no reasoning field (Llama's) writes the content alone: SFT on reasoning traces
    trained the answers alone, and DPO pairs that differ in their reasoning became the same
    tokens, without a word. The rollouts of GRPO keep the generated tokens, reasoning included,
    whatever the template shows (posttrain/rollouts.py).
    """
    for i in range(loss_start, len(messages)):
        end = starts[i + 1] if i + 1 < len(starts) else len(rendered)
        reasoning = _reasoning_of(messages[i]) if trained_message(messages[i]) else None
        if reasoning and not _shows(rendered[starts[i]:end], reasoning):
            what, fix = _reasoning_named(messages[i])
            raise InputError(
                f"the chat template drops the {what} of assistant message {i}, which gets loss, so training would "
                f"teach its answer without the reasoning; {fix}"
            )


def _rerendered(messages: list[dict], i: int, rendered: str, full: str, starts: list[int], so: str) -> str:
    """The error of a template that renders the text before message i differently once message i
    follows: which earlier message changed (and why when it lost its reasoning), `so` what follows."""
    k, at = _first_change(rendered, full, starts)
    changed, role = f"message {k} (role {messages[k]['role']!r})", messages[i]["role"]
    if (reasoning := _reasoning_of(messages[k])) and _shows(rendered, reasoning) and not _shows(full, reasoning):
        what, fix = _reasoning_named(messages[k])
        return (f"the chat template drops the {what} of {changed} once message {i} (role {role!r}) follows "
                f"(Qwen3's and QwQ's keep it after the last user message only), so {so}; {fix}")
    return (f"the chat template renders {changed} differently once message {i} (role {role!r}) follows "
            f"({change_excerpt(rendered, full, at, starts[k])}; Qwen3's template, for one, writes an "
            f"empty <think></think> block into the last assistant turn alone), so {so}; set "
            "policy.tokenizer.chat_template to a template whose renders extend each other")


def change_excerpt(before: str, after: str, at: int, floor: int = 0) -> str:
    """`'...' became '...'`: 30 characters either side of offset `at`, where `after` first differs
    from `before`, from `floor` on, for the errors of templates whose renders change."""
    start = max(floor, at - 30)
    return f"{before[start:at + 30]!r} became {after[start:at + 30]!r}"


def _first_change(rendered: str, full: str, starts: list[int]) -> tuple[int, int]:
    """Where `full` first differs from `rendered`: the message whose text (from `starts[k]` on in
    `rendered`) it changed, and the character offset."""
    at = len(os.path.commonprefix([rendered, full]))
    return max(j for j in range(len(starts)) if starts[j] <= at), at


def with_bos(ids: list[int], tokenizer) -> list[int]:
    """`ids` with the tokenizer's BOS in front unless it is already there (or there is no BOS).

    The one BOS rule of training rows and of generation prompts (`data.add_bos`): a model must
    see a prompt exactly as it saw it in training, or every position shifts by one.
    """
    bos = tokenizer.bos_token_id
    if bos is None or (ids and ids[0] == bos):
        return ids
    return [bos, *ids]


def decode_all(tokenizer, rows: list[list[int]]) -> list[str]:
    """`tokenizer.batch_decode(rows, skip_special_tokens=True)`, through the Rust tokenizer itself
    when transformers' fast tokenizer would only pass each row on to it: its batch_decode first
    walks every id of every row to convert it to Python (1.2 against 0.2 ms for a GRPO step's 512
    short completions)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or tokenizer.clean_up_tokenization_spaces
            or type(tokenizer)._decode is not TokenizersBackend._decode):  # a subclass's own decoding
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
    return [backend.decode(r, skip_special_tokens=True) for r in rows]


def encode_continuation(tokenizer, text: str) -> list[int]:
    """Token ids of `text` where it continues earlier text (the next message of a rendered
    conversation, a multi-turn observation), as they read after a token boundary.

    A sentencepiece tokenizer (Llama 2, Mistral v0.1, Phi-3, stories260K) writes a space before
    the start of every text it encodes ("there" -> "\u2581there", "\n" -> "\u2581" "\n"): encoded
    on its own, each message got a space the whole conversation does not have, which the model
    then learnt to write at the start of every answer. Encoded after a newline whose tokens are
    then dropped, it gets none; where the text merges with the newline (byte-level BPE's "\n\n"),
    it is encoded on its own, as such tokenizers write no space.
    """
    anchor = encode_text(tokenizer, "\n")
    ids = encode_text(tokenizer, "\n" + text)
    if ids[: len(anchor)] == anchor:
        return ids[len(anchor):]
    return encode_text(tokenizer, text)


def encode_text(tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer itself where
    transformers' fast tokenizer would only pass the text on to it: its per-call checks, its
    truncation and padding set-up and its conversion of the result cost more than encoding a
    short text (the quickstart's 20,000 warm-up rows: 7.5 -> 5.7 s, most of the rest rendering the
    chat template). A tokenizer class of its own encoding, or a backend set to truncate or pad (or
    not yet told `split_special_tokens`), goes through transformers."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
            or type(tokenizer).encode is not PreTrainedTokenizerBase.encode
            or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(tokenizer.split_special_tokens)):
        return tokenizer.encode(text, add_special_tokens=False)
    return backend.encode(text, add_special_tokens=False).ids


def _extend(ids: list[int], mask: list[int], tokenizer, text: str, value: int) -> None:
    """Append the tokens of `text`, which continues the text of `ids` (or starts it), with loss `value`."""
    if text:
        new = encode_continuation(tokenizer, text) if ids else encode_text(tokenizer, text)
        ids.extend(new)
        mask.extend([value] * len(new))


def _fit(example: Example, max_len: int, policy: str) -> tuple[Example | None, str]:
    """(example or None, what happened: "ok" | "truncated" | "dropped" | "no_loss")."""
    status = "ok"
    if len(example["input_ids"]) > max_len:
        if policy == "drop":
            return None, "dropped"
        example = {k: v[:max_len] for k, v in example.items()}
        status = "truncated"
    if not any(example["loss_mask"]):
        return None, "no_loss"
    return example, status


def _fit_row(examples: list[Example], max_len: int, policy: str) -> tuple[list[Example], str]:
    """The examples of one row (`tokenize_conversation`'s) that fit, each by `_fit`, and what happened
    to the row: "dropped" when one of them is too long under "drop" (a row longer than the context
    goes whole, as a row of one example does), "no_loss" when none keeps a loss token, "truncated"
    when one was cut (or lost to the cut); else "ok"."""
    fitted = [_fit(ex, max_len, policy) for ex in examples]
    kept = [ex for ex, _ in fitted if ex is not None]
    statuses = {status for _, status in fitted}
    if "dropped" in statuses:
        return [], "dropped"
    if not kept:
        return [], "no_loss"
    return kept, "ok" if statuses == {"ok"} else "truncated"


def _check_left(kept: int, stats: dict[str, int], max_len: int, cfg: DataConfig, what: str) -> None:
    if kept == 0 and cfg.truncation == "drop" and stats.get("no_loss") and not stats.get("dropped"):
        # Whole rows without a token to train (none was cut): not a matter of length.
        raise InputError(f"no {what} left: none has a token to train ({stats}): their answers render as no tokens, "
                         "as with a chat template that does not write the assistant's content (see its warning, "
                         "and set policy.tokenizer.chat_template)")
    if kept == 0:
        # Under "truncate" the rows went for prompts that fill the context: cutting cannot help.
        other = " or use data.truncation=truncate" if cfg.truncation == "drop" else ""
        raise InputError(
            f"no {what} left after applying data.truncation={cfg.truncation!r} at {max_len} tokens "
            f"({stats}); raise policy.max_total_sequence_length / data.max_input_seq_length{other}"
        )


def process_sft_rows(
    rows: list[dict[str, Any]], tokenizer, cfg: DataConfig, max_len: int
) -> tuple[list[Example], dict[str, int]]:
    """Tokenize SFT rows `{"messages"}`; returns the examples and the counts of rows
    {rows, kept, truncated, dropped, no_loss} (see the module docstring), and `examples` when
    there are more examples than rows kept (`tokenize_conversation`: one per stretch of turns where
    the chat template re-renders earlier turns, as Qwen3's does)."""
    stats = {"rows": len(rows), "kept": 0, "truncated": 0, "dropped": 0, "no_loss": 0}
    out = []
    for n, row in enumerate(rows, start=1):
        if "text" in row:
            examples = [_plain_text_example(row["text"], tokenizer, cfg)]
        elif "messages" not in row:
            raise InputError(f"SFT needs rows with `messages` or `text`, got keys {sorted(row)} (a preference dataset?)")
        else:
            messages, name = row["messages"], row_name(row, f"row {n}")
            if row.get("task_name") is not None:
                # An RL/eval row (a math or code file, the embedded arithmetic task) is a prompt: SFT
                # trains on its reference answer after it, as GRPO's warm-up does.
                demo = demonstration_messages(row)
                if demo is None:
                    raise InputError(f"{name}: an RL/eval prompt (task_name {row['task_name']!r}) without an "
                                     "`answer` or `demonstration`, so SFT has no response to train on")
                messages = messages + demo
            with naming_row(name, messages):
                examples = tokenize_conversation(messages, tokenizer, add_bos=cfg.add_bos, add_eos=cfg.add_eos,
                                                 tools=row.get("tools"), add_generation_prompt=cfg.add_generation_prompt)
        kept, status = _fit_row(examples, max_len, cfg.truncation)
        if status != "ok":
            stats[status] += 1
        stats["kept"] += bool(kept)
        out.extend(kept)
    if len(out) != stats["kept"]:
        stats["examples"] = len(out)
    _check_left(stats["kept"], stats, max_len, cfg, "rows")
    return out, stats


def _plain_text_example(text: str, tokenizer, cfg: DataConfig) -> Example:
    """A plain-text row as one example, every token trained (the BOS that data.add_bos puts in
    front is context, the EOS of data.add_eos is trained: where a text ends)."""
    body = encode_text(tokenizer, text)
    front = with_bos(body, tokenizer) if cfg.add_bos else body
    end = [tokenizer.eos_token_id] if cfg.add_eos and tokenizer.eos_token_id is not None else []
    return {"input_ids": front + end, "loss_mask": [0] * (len(front) - len(body)) + [1] * (len(body) + len(end))}


def shown_example(tokenizer, example: Example, limit: int = 400) -> str:
    """An example's text as the model reads it, the tokens with loss between «»: what training
    on a dataset means, at a glance (a chat template or format read otherwise shows here)."""
    ids, mask = example["input_ids"], example.get("loss_mask") or [0] * len(example["input_ids"])
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            parts.append(f"«{text}»" if mask[start] else text)
            start = i
    return shortened("".join(parts), limit, len(ids))


def shortened(text: str, limit: int, tokens: int) -> str:
    """`text` as a repr of at most about `limit` characters: its start and its end (where an
    example's trained answer is), the middle left out."""
    if len(text) <= limit:
        return repr(text)
    head = limit // 3
    return f"{text[:head]!r} ... {text[head - limit:]!r} ({tokens} tokens)"


def process_preference_rows(
    rows: list[dict[str, Any]], tokenizer, cfg: DataConfig, max_len: int
) -> tuple[list[tuple[Example, Example]], dict[str, int]]:
    """Tokenize preference rows into (chosen, rejected) example pairs. Loss tokens are the
    responses only; a pair is dropped when either side is (counts as in `process_sft_rows`), and
    when its sides are the same tokens (counted as `identical`)."""
    stats = {"rows": len(rows), "kept": 0, "truncated": 0, "dropped": 0, "no_loss": 0, "identical": 0}
    out = []
    for n, row in enumerate(rows, start=1):
        if "prompt_messages" not in row:
            raise InputError(f"{row_name(row, f'row {n}')}: {cfg.source()} gives rows with keys {sorted(row)}; DPO/RM "
                             "train on preference pairs (`chosen`/`rejected`, with their context): name such a "
                             "file or hub set (e.g. examples/configs/dpo.yaml's)")
        prompt = row["prompt_messages"]
        pair, statuses = [], []
        for side in ("chosen", "rejected"):
            with naming_row(row_name(row, f"row {n}"), prompt + row[side]):
                ex = tokenize_messages(prompt + row[side], tokenizer, add_bos=cfg.add_bos, add_eos=cfg.add_eos,
                                       loss_start=len(prompt), tools=row.get("tools"),
                                       add_generation_prompt=cfg.add_generation_prompt)
            ex, status = _fit(ex, max_len, cfg.truncation)
            pair.append(ex)
            statuses.append(status)
        if pair[0] is not None and pair[1] is not None and pair[0]["input_ids"] == pair[1]["input_ids"]:
            # Responses that differ only past the cut at the context (or in what the template strips):
            # as a pair with chosen == rejected (refused when read), it prefers nothing, yet took a
            # place in its batch and counted as a miss in the accuracy.
            pair, statuses = [None, None], [*statuses, "identical"]
        # One count per pair, for what happened to it (a drop outranks a truncation).
        status = next((s for s in ("dropped", "no_loss", "identical", "truncated") if s in statuses), None)
        if status:
            stats[status] += 1
        if all(ex is not None for ex in pair):
            out.append((pair[0], pair[1]))
    stats["kept"] = len(out)
    _check_left(len(out), stats, max_len, cfg, "preference pairs")
    return out, stats


def collate(examples: list[Example], pad_id: int) -> BatchedDataDict:
    """A training batch from examples: input_ids/token_mask right padded to the longest."""
    longest = max(len(ex["input_ids"]) for ex in examples)
    b = len(examples)
    input_ids = torch.full((b, longest), pad_id, dtype=torch.long)  # [B, S]
    token_mask = torch.zeros((b, longest), dtype=torch.float32)  # [B, S]
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        token_mask[i, :n] = torch.tensor(ex["loss_mask"], dtype=torch.float32)
    # Position 0 has no logprob (nothing precedes it), so it never gets loss.
    token_mask[:, 0] = 0
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor([len(ex["input_ids"]) for ex in examples], dtype=torch.long),  # [B]
        token_mask=token_mask,
        sample_mask=torch.ones(b, dtype=torch.float32),  # [B]
    )


def collate_pairs(pairs: list[tuple[Example, Example]], pad_id: int) -> BatchedDataDict:
    """A preference batch: rows 2i (chosen) and 2i+1 (rejected) of pair i."""
    return collate([ex for pair in pairs for ex in pair], pad_id)


def process_kto_rows(
    rows: list[dict[str, Any]], tokenizer, cfg: DataConfig, max_len: int
) -> tuple[list[Example], dict[str, int]]:
    """Tokenize KTO rows (read under `formats.labelled_rows`) into examples labelled desirable or not
    (`label`: 1 / 0, a one-item list so that `_fit` cuts it as the rest). A conversation row
    `{"messages", "label"}` is the prompt
    (every message before the last) and the response (the last, an assistant message), loss on
    the response only; a preference pair gives two examples, its chosen side desirable and its
    rejected side not (TRL's KTOTrainer unpairs such data the same way). Counts as
    `process_sft_rows`'s, per example (`rows`: a pair counts twice, so that kept <= rows), and
    `identical`: the sides of pairs that the cut at the context made one sequence, dropped."""
    stats = {"rows": 0, "kept": 0, "truncated": 0, "dropped": 0, "no_loss": 0, "identical": 0}
    out = []
    for n, row in enumerate(rows, start=1):
        name = row_name(row, f"row {n}")
        if "prompt_messages" in row:  # a preference pair
            prompt, sides = row["prompt_messages"], [(row["chosen"], True), (row["rejected"], False)]
        elif "messages" in row and "task_name" not in row:  # labelled and checked when read (`labelled_rows`)
            prompt, sides = row["messages"][:-1], [([row["messages"][-1]], row["label"])]
        else:
            raise InputError(f"{name}: {cfg.source()} gives rows with keys {sorted(row)}; KTO "
                             "trains on labelled conversations (`messages` + `label`, TRL's `prompt`/`completion`/"
                             "`label`) or preference pairs: name such a file or hub set (e.g. "
                             "examples/configs/kto.yaml's)")
        stats["rows"] += len(sides)
        fitted, statuses = [], []
        for response, label in sides:
            with naming_row(name, prompt + response):
                ex = tokenize_messages(prompt + response, tokenizer, add_bos=cfg.add_bos, add_eos=cfg.add_eos,
                                       loss_start=len(prompt), tools=row.get("tools"),
                                       add_generation_prompt=cfg.add_generation_prompt)
            ex, status = _fit({**ex, "label": [int(label)]}, max_len, cfg.truncation)
            fitted.append(ex)
            statuses.append(status)
        if len(fitted) == 2 and None not in fitted and fitted[0]["input_ids"] == fitted[1]["input_ids"]:
            # A pair's sides that differ only past the cut at the context (as DPO drops them): one
            # sequence labelled desirable and undesirable at once, which teaches nothing.
            fitted, statuses = [None, None], ["identical", "identical"]
        for status in statuses:
            if status != "ok":
                stats[status] += 1
        out += [ex for ex in fitted if ex is not None]
    stats["kept"] = len(out)
    _check_left(len(out), stats, max_len, cfg, "examples")
    return out, stats


def collate_kto(examples: list[Example], pad_id: int, max_len: int) -> BatchedDataDict:
    """A KTO batch: the examples as `collate` makes them, with `kto_label [B]` (1: desirable), and
    the mismatched pairs KTO's KL estimate reads in `kl_input_ids`, `kl_input_lengths` and
    `kl_token_mask`: example i's prompt with the response of the next example (mod B) whose prompt
    differs (cut at `max_len`), as TRL pairs each prompt with its neighbour's response. The next
    one alone would be a matched pair wherever neighbours share their prompt, as the two sides of
    an unpaired preference pair do in validation batches and unshuffled data (TRL unpairs a
    chunk's chosen sides before its rejected ones). When every prompt of the batch is the same,
    the next example's response (a batch of one: its own, an estimate of 0 at the start)."""
    batch = collate(examples, pad_id)
    starts = [ex["loss_mask"].index(1) for ex in examples]
    prompts = [ex["input_ids"][:start] for ex, start in zip(examples, starts)]
    n = len(examples)
    kl = []
    for i, ex in enumerate(examples):
        j = next((k % n for k in range(i + 1, i + n) if prompts[k % n] != prompts[i]), (i + 1) % n)
        other = examples[j]
        kl.append({"input_ids": (ex["input_ids"][: starts[i]] + other["input_ids"][starts[j]:])[:max_len],
                   "loss_mask": ([0] * starts[i] + other["loss_mask"][starts[j]:])[:max_len]})
    mismatched = collate(kl, pad_id)
    batch["kto_label"] = torch.tensor([ex["label"][0] for ex in examples], dtype=torch.float32)
    for key in ("input_ids", "input_lengths", "token_mask"):
        batch[f"kl_{key}"] = mismatched[key]
    return batch
