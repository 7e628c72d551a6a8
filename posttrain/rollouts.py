"""Single- and multi-turn rollouts: generation + environments -> a token-aligned batch.

One code path serves both: a single-turn task is a multi-turn rollout whose environment
terminates after the first answer. Per turn, the active conversations are generated in one
batch, the environments score them (grouped by each row's `task_name`), and the
observations of conversations that go on are appended as chat messages, tokenized with the
tokenizer's chat template. Loss masks cover generated tokens only; a conversation that
reaches `max_seq_len` stops and is counted as truncated.

Prompts follow the rules of training rows (`posttrain.data.processors`): BOS by
`data.add_bos` (`with_bos`), the chat template's generation prompt by
`data.add_generation_prompt` (`render_chat`), so a model is prompted as it was trained.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import numbers
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from posttrain.config import InputError
from posttrain.data.batch import BatchedDataDict
from posttrain.data.processors import (CONTENT_SENTINEL, change_excerpt, decode_all, encode_continuation,
                                       encode_text, first_user_message, render_chat, with_bos)
from posttrain.environments.interfaces import (
    CORRECT_KEY,
    ENV_ERROR_KEY,
    ENV_METRICS_KEY,
    REWARD_COMPONENTS_KEY,
    ROLLOUT_KEY,
    TOOL_CALLS_KEY,
    verdict,
)
from posttrain.environments.tool_calls import without_tool_calls
from posttrain.evals import accuracy

log = logging.getLogger(__name__)

# A row's prompt tokens as `render_prompt` gives them, under the run's data.add_bos and
# data.add_generation_prompt (GRPO's setup renders every prompt once to check its length and
# keeps the result here): a step then copies them instead of rendering the chat template again.
PROMPT_IDS_KEY = "_prompt_ids"
# Metadata keys of a step's result that the next step of the conversation is not given.
_NOT_PASSED_ON = (ENV_ERROR_KEY, CORRECT_KEY)


class _EnvGroup(Protocol):
    def step(self, message_logs: list[list[dict]], metadata: list[dict]) -> Any: ...


@dataclass
class Conversation:
    """The state of one rollout: its tokens and what the loss and the logs need of them."""

    messages: list[dict[str, str]]
    metadata: dict[str, Any]
    task_name: str
    tokens: list[int]
    prompt_length: int
    prompt_messages: int = 0  # messages[:prompt_messages] are the row's prompt (a system prompt included)
    generated_mask: list[int] = field(default_factory=list)
    generation_logprobs: list[float] = field(default_factory=list)
    stop_strings: list[str] | None = None  # of the next generation turn
    row_stop_strings: list[str] | None = None  # the row's own: every turn's unless the environment sets others
    tools: list[dict] | None = None  # JSON schemas the chat template renders (the row's "tools")
    reward: float = 0.0
    # The environment's verdict of its last step (CORRECT_KEY): True, False, None (not judged).
    correct: bool | None = None
    done: bool = False
    # Why it ended (samples.jsonl): "environment" (terminated), "max_turns", "max_new_tokens" (the
    # answer cut at the token limit), "context" (the context is full: in a turn, or the next
    # observation does not fit, which the environment was not told: `ROLLOUT_KEY`'s tokens_left),
    # "observation_error" (the chat template cannot write the observation).
    stop_reason: str = ""
    truncated: bool = False
    prompt_truncated: bool = False  # the engine cut its prompt from the left (overlong_prompt=truncate)
    turns: int = 0
    response_tokens: int = 0
    env_errors: int = 0

    @property
    def question(self) -> str:
        """The prompt's last message: the question, without the system prompt or earlier turns."""
        return self.messages[self.prompt_messages - 1]["content"] if self.prompt_messages else ""

    @property
    def exchange(self) -> list[dict[str, str]]:
        """The messages after the prompt: the model's turns and the environment's observations."""
        return self.messages[self.prompt_messages:]

    @property
    def response(self) -> str:
        """The model's turns after the prompt, one per line; a turn's tool calls (its `tool_calls`,
        out of its content) as `name({arguments})` after its text."""
        def turn(m: dict[str, Any]) -> str:
            calls = [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
                     for c in m.get("tool_calls") or ()]
            return " ".join(part for part in (m["content"], *calls) if part)

        return "\n".join(turn(m) for m in self.exchange if m["role"] == "assistant")

    @property
    def env_error(self) -> str | None:
        """Why the environment failed this sample (samples.jsonl), None when it did not."""
        return (self.metadata.get(ENV_ERROR_KEY) or "unknown error") if self.env_errors else None


@dataclass
class RolloutResult:
    batch: BatchedDataDict  # input_ids/token_mask/generation_logprobs [B, S]; input_lengths, rewards, truncated [B]
    conversations: list[Conversation]
    # Seconds in the engine's generate calls alone, over every turn: not the environments' scoring,
    # the tokenizing between turns, nor a refit before (generation_tokens_per_s divides by it).
    generate_s: float = 0.0

    @functools.cached_property
    def metrics(self) -> dict[str, float]:
        """`summarize_rollouts` of these conversations, on first use: GRPO summarizes a step's
        generation rounds together instead (~1 ms of the driver's step for 512 samples)."""
        return summarize_rollouts(self.conversations)


def _utf8(text: str) -> str:
    """`text` with lone surrogates written as escapes ("\\ud800"): the model's own text echoed back
    (a program's exception, a tool's error about the argument it named) held one, which no
    tokenizer encodes, and the sample became an environment error."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def render_prompt(
    tokenizer, messages: list[dict[str, str]], add_bos: bool = True, *, add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by the chat template as a generation prompt: ending in
    the template's generation prompt when `add_generation_prompt` (`data.add_generation_prompt`),
    with BOS in front when `add_bos` (`data.add_bos`), by the same rules as training rows;
    `tools`: the JSON schemas of the tools the model may call."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    ids = encode_text(tokenizer, text)
    return with_bos(ids, tokenizer) if add_bos else ids


def _observation_tokens(
    tokenizer, before: list[dict[str, str]], observation: list[dict[str, str]], *, add_generation_prompt: bool = True,
    last_token: int, tools: list[dict] | None = None, turn_text: str | None = None,
) -> list[int]:
    """Tokens that follow the model's last turn for `observation` (its messages): the rest of that
    turn's closing, the observation, and the next generation prompt when `add_generation_prompt`
    (`data.add_generation_prompt`).

    The observation is rendered as the difference between the template over the conversation
    with and without it, so templates that inject text between turns (or group consecutive tool
    results into one turn) stay exact. Chat templates know user/assistant/system/tool roles; an
    environment's message is shown as a user turn.

    The closing is what the template writes after the assistant's content (e.g. "<|end|>", or
    "<|im_end|>\n"): a turn cut by a stop string ends before it, and one the model ended with
    its EOS (`last_token`, the turn's last generated token) has only written that token of it.
    Without the rest the next turns would see a conversation no template (and no warm-up or
    SFT row) ever renders. `turn_text`: the text the model wrote in its turn before `last_token`.
    """
    before, shown = _as_shown(before), _as_shown(observation)
    prev = render_chat(tokenizer, before, add_generation_prompt=False, tools=tools)
    full = render_chat(tokenizer, before + shown, add_generation_prompt=add_generation_prompt, tools=tools)
    if full.startswith(prev):
        delta = full[len(prev):]
    else:
        # A template that re-renders the last turn once more follows (Qwen3's drops its empty
        # <think></think> block): the observation as the template writes it on its own, or, when it
        # holds no user message (tool results), after the conversation's opening up to its first
        # user message, as a template may refuse a conversation without one (`first_user_message`).
        k = first_user_message(before)
        head = before[: k + 1] if first_user_message(shown) is None and k is not None else []
        opening = render_chat(tokenizer, head, add_generation_prompt=False, tools=tools) if head else ""
        alone = render_chat(tokenizer, head + shown, add_generation_prompt=add_generation_prompt,
                            tools=tools if head else None)
        if not alone.startswith(opening):
            # Cutting at len(opening) would hand the model text no render of this conversation holds.
            at = len(os.path.commonprefix([opening, alone]))
            raise InputError(
                f"the chat template renders the conversation differently once the observation follows, both after "
                f"the whole conversation and after its opening ({change_excerpt(opening, alone, at)}), so the "
                "observation's tokens cannot be cut from a render; set policy.tokenizer.chat_template to a "
                "template whose renders extend each other")
        delta = alone[len(opening):]
    return encode_continuation(tokenizer, _turn_closing(tokenizer, before, last_token, tools, turn_text) + delta)


def _as_shown(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with an environment's message as the user turn it is shown as. The earlier
    observations too: a template that refuses other roles (Mistral's, Gemma's) raised on the
    conversation's first observation once it rendered the second, and stopped every rollout of
    three turns or more."""
    return [{**m, "role": "user"} if m["role"] == "environment" else m for m in messages]



def _closing(tokenizer, before: list[dict[str, str]], tools: list[dict] | None) -> str | None:
    """What the chat template writes after the content of `before`'s last (assistant) message,
    found with a stand-in for the content; None for a template that rewrites the content."""
    stand_in = render_chat(tokenizer, [*before[:-1], {"role": "assistant", "content": CONTENT_SENTINEL}],
                           add_generation_prompt=False, tools=tools)
    at = stand_in.rfind(CONTENT_SENTINEL)
    return None if at < 0 else stand_in[at + len(CONTENT_SENTINEL):]


def _special_text(tokenizer, token: int) -> str | None:
    """The text of `token` when it is a special token (EOS) that a decode skips; None for one of text."""
    if tokenizer.decode([token], skip_special_tokens=True) != "":
        return None
    return tokenizer.decode([token], skip_special_tokens=False)


def _turn_closing(tokenizer, before: list[dict[str, str]], last_token: int, tools: list[dict] | None,
                  turn_text: str | None = None) -> str:
    """What the chat template writes after the content of `before`'s last (assistant) message
    and the model has not generated: all of it after a stop string, the rest of it after the
    special token (EOS) that ended the turn, none of it when the model wrote it before that token
    (`turn_text`, the turn's text, ends with it). "" when the last message is not the assistant's."""
    if not before or before[-1].get("role") != "assistant":
        return ""
    # Without the turn's `tool_calls`: a template that writes them after the content (Qwen2.5's)
    # would put a second copy of calls the model already wrote into the closing.
    closing = _closing(tokenizer, before, tools)
    if closing is None:  # a template that rewrites the content: keep what was generated as it is
        return ""
    written = _special_text(tokenizer, last_token)
    if written and written in closing:
        # The special token that ended the turn is in the tokens already, and what the template
        # writes before it (Llama 2's space in " </s>") the model did not: the rest follows it.
        closing = closing[closing.index(written) + len(written):]
    elif written and closing and turn_text is not None and turn_text.endswith(closing):
        # A template that writes no end token ("{{ content }}\n\n"): the model wrote its closing and
        # then EOS, as trained (see _written_before_end); a second one followed the EOS.
        return ""
    return closing


@functools.lru_cache(maxsize=16)
def _written_before_end(tokenizer, end_token: int) -> str:
    """The text a chat template writes between an assistant message's content and `end_token`,
    the special token (EOS) a turn ended with: an answer's text ends with it, as the model was
    trained to write it ("\n\n" of a template whose turns end "{{ content }}\n\n", EOS after it).
    It is no part of the message: rendered again (a reward model's template, the logs' conversation)
    the template writes it a second time. "" for a token that is text, or no such text."""
    written = _special_text(tokenizer, end_token)
    if written is None:
        return ""
    try:
        closing = _closing(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}], None)
    except Exception:  # noqa: BLE001 - a template that wants more than this: the text stays as generated
        return ""
    if closing is None:
        return ""
    # The token in the template (ChatML's <|im_end|>): the text before it; else (EOS added after the
    # template's text in training) the whole closing.
    return closing[: closing.index(written)] if written and written in closing else closing


def _next_turn_tokens(tokenizer, c: Conversation, observation: list[dict], add_generation_prompt: bool) -> list[int]:
    """`_observation_tokens` after `c`'s last turn. A turn with structured `tool_calls` keeps in
    its content only the text around them (`without_tool_calls`): the template writes them. A
    template that refuses them (Llama 3.1's takes one call per turn) gets the turn without them,
    as the model wrote it: the calls stay in its content, and the results still name them."""
    from jinja2 import TemplateError

    turn = len(c.generated_mask) - next((i for i, g in enumerate(reversed(c.generated_mask)) if not g),
                                         len(c.generated_mask))
    turn_text = tokenizer.decode(c.tokens[turn:-1], skip_special_tokens=False) if turn < len(c.tokens) else None

    def tokens() -> list[int]:
        return _observation_tokens(tokenizer, c.messages, observation, add_generation_prompt=add_generation_prompt,
                                   tools=c.tools, last_token=c.tokens[-1], turn_text=turn_text)

    last = c.messages[-1]
    written = last.get("content")
    if last.get("tool_calls") and isinstance(written, str):
        last["content"] = without_tool_calls(written)
    try:
        return tokens()
    except TemplateError:
        if not last.pop("tool_calls", None):
            raise
        last["content"] = written
        return tokens()


def start_conversations(
    tokenizer, rows: Sequence[dict[str, Any]], add_bos: bool = True, *, add_generation_prompt: bool = True
) -> list[Conversation]:
    convs = []
    rendered: dict[str, list[int]] = {}  # a GRPO step holds each prompt n times: render it once
    for row in rows:
        messages = [dict(m) for m in row["messages"]]
        tools = row.get("tools")
        if PROMPT_IDS_KEY in row:
            tokens = list(row[PROMPT_IDS_KEY])
        else:
            key = repr((messages, tools))
            if key not in rendered:
                rendered[key] = render_prompt(tokenizer, messages, add_bos, add_generation_prompt=add_generation_prompt,
                                              tools=tools)
            tokens = list(rendered[key])
        metadata = dict(row.get("metadata") or {})
        if "answer" in row:
            metadata.setdefault("answer", row["answer"])
        convs.append(
            Conversation(
                messages=messages,
                metadata=metadata,
                task_name=row.get("task_name", "math"),
                tokens=tokens,
                prompt_length=len(tokens),
                prompt_messages=len(messages),
                generated_mask=[0] * len(tokens),
                generation_logprobs=[0.0] * len(tokens),
                stop_strings=row.get("stop_strings"),
                row_stop_strings=row.get("stop_strings"),
                tools=tools,
            )
        )
    return convs


def check_tool_turns(tokenizer, rows: Sequence[dict[str, Any]], add_bos: bool = True, *,
                     add_generation_prompt: bool = True) -> None:
    """Render a tool call and its result after the first prompt of each task whose rows carry
    tools, as a rollout's next turn would be rendered: a chat template that cannot show a tool
    result (one that only takes alternating user/assistant turns) fails here, at setup, naming
    the task, instead of at the first tool call of a run."""
    seen: set[str] = set()
    for row in rows:
        task = row.get("task_name", "math")
        if not row.get("tools") or task in seen:
            continue
        seen.add(task)
        (c,) = start_conversations(tokenizer, [row], add_bos, add_generation_prompt=add_generation_prompt)
        name = row["tools"][0].get("function", {}).get("name", "tool")
        call = {"id": "call00000", "type": "function", "function": {"name": name, "arguments": {}}}
        c.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        c.tokens.append(tokenizer.eos_token_id)  # as if the model ended its turn itself
        result = [{"role": "tool", "content": "0", "name": name, "tool_call_id": call["id"]}]
        try:
            _next_turn_tokens(tokenizer, c, result, add_generation_prompt)
        except InputError as e:  # the template renders tool results, but not as one conversation
            raise InputError(f"environment {task!r} has tools, and {e}") from None
        except Exception as e:  # a template raises what it likes: TemplateError, TypeError, KeyError
            raise InputError(
                f"environment {task!r} has tools, but the tokenizer's chat template cannot render a tool "
                f"result after a tool call ({type(e).__name__}: {e}); use a model or tokenizer.chat_template "
                "whose template knows the tool role"
            ) from None


def _keep_last(c: Conversation, keep: int) -> None:
    """Cut `c` to its last `keep` tokens, as the engine cut the prompt it generated after
    (`overlong_prompt=truncate`): its answer follows those tokens in the output, and its tokens,
    loss mask and logprobs stay aligned with what the model saw."""
    cut = len(c.tokens) - keep
    c.tokens, c.generated_mask = c.tokens[cut:], c.generated_mask[cut:]
    c.generation_logprobs = c.generation_logprobs[cut:]
    c.prompt_length = max(0, c.prompt_length - cut)
    c.prompt_truncated = True


def _pad(seqs: list[list], value, dtype) -> torch.Tensor:
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    out = torch.full((len(seqs), int(lengths.max())), value, dtype=dtype)
    # One array from the concatenated rows, scattered under a mask: one conversion, not one per row.
    # numpy reads the Python numbers 2x faster than torch.tensor does (512 rows of 14: 0.2 vs 0.5 ms);
    # floats are read as float64, then rounded to `dtype` once, as torch.tensor would.
    flat = np.fromiter(itertools.chain.from_iterable(seqs), count=int(lengths.sum()),
                       dtype=np.float64 if dtype.is_floating_point else np.int64)
    out[torch.arange(out.shape[1]) < torch.from_numpy(lengths)[:, None]] = torch.from_numpy(flat).to(dtype)
    return out


def run_rollouts(
    generation,
    rows: Sequence[dict[str, Any]],
    envs: dict[str, _EnvGroup],
    tokenizer,
    *,
    max_turns: int,
    max_seq_len: int,
    greedy: bool = False,
    add_bos: bool = True,
    add_generation_prompt: bool = True,
    global_step: int | None = None,
    max_steps: int | None = None,
) -> RolloutResult:
    """Roll out every row to termination (or `max_turns` / `max_seq_len`) and score it.

    `generation` follows `posttrain.generation.GenerationInterface`; `envs` maps task names
    to environment groups. Returns the training-ready batch (right padded with the pad id):
    `input_ids [B, S]`, `input_lengths [B]`, `token_mask [B, S]` (1 on generated tokens),
    `generation_logprobs [B, S]`, `rewards [B]`, `truncated [B]`, `response_lengths [B]`.
    `add_bos` and `add_generation_prompt` must be what the model was trained with
    (`data.add_bos`, `data.add_generation_prompt`). `global_step` (the training steps done) and
    `max_steps` reach the environments with each sample's tokens (`ROLLOUT_KEY`).
    """
    missing = sorted({r.get("task_name", "math") for r in rows} - set(envs))
    if missing:
        raise ValueError(f"rows name task(s) {missing} but only environments {sorted(envs)} are configured (env section)")
    convs = start_conversations(tokenizer, rows, add_bos, add_generation_prompt=add_generation_prompt)
    progress = {"global_step": global_step, "max_steps": max_steps}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generate_s = 0.0
    for turn in range(max_turns):
        last_turn = turn == max_turns - 1  # every conversation ends after it, whatever its environment says
        active = [c for c in convs if not c.done]
        if not active:
            break
        gen_in = BatchedDataDict(
            input_ids=_pad([c.tokens for c in active], pad_id, torch.long),
            input_lengths=torch.tensor([len(c.tokens) for c in active], dtype=torch.long),
            stop_strings=[c.stop_strings for c in active],
        )
        start = time.perf_counter()
        out = generation.generate(gen_in, greedy=greedy)
        generate_s += time.perf_counter() - start
        # Whole tensors to lists and one decode_all: per-row tensor slicing and decoding cost
        # more than the generation itself for hundreds of short completions.
        ids, lps = out["output_ids"].tolist(), out["logprobs"].tolist()
        lengths, truncated = out["generation_lengths"].tolist(), out["truncated"].tolist()
        for j in out["prompt_truncated"].nonzero().flatten().tolist():
            _keep_last(active[j], int(out["unpadded_sequence_lengths"][j]) - lengths[j])
        spans = [(len(c.tokens), len(c.tokens) + n) for c, n in zip(active, lengths)]
        news = [ids[j][a:b] for j, (a, b) in enumerate(spans)]
        texts = decode_all(tokenizer, news)
        for j, c in enumerate(active):
            (a, b), n = spans[j], lengths[j]
            c.tokens += news[j]
            c.generated_mask += [1] * n
            c.generation_logprobs += lps[j][a:b]
            c.response_tokens += n
            c.turns += 1
            text = texts[j]
            if n and not truncated[j] and (end := _written_before_end(tokenizer, news[j][-1])) and text.endswith(end):
                text = text[: -len(end)]  # the template's, not the answer's: see _written_before_end
            c.messages.append({"role": "assistant", "content": text})
            if truncated[j]:
                c.truncated = True

        by_task: dict[str, list[Conversation]] = defaultdict(list)
        for c in active:
            by_task[c.task_name].append(c)
        for task, group in by_task.items():
            # An earlier turn's error stays out of what the environment sees, so that one echoing its
            # metadata back (or returning None for it) does not count that error again; so does a
            # verdict (a row's own key too): the conversation's is its last step's.
            ret = envs[task].step([c.messages for c in group],
                                  [{**{key: v for key, v in c.metadata.items() if key not in _NOT_PASSED_ON},
                                    # A truncated answer ends the conversation too (below): an environment
                                    # holding the score for a later turn must score it now.
                                    ROLLOUT_KEY: {"completion_ids": c.tokens[c.prompt_length:], **progress,
                                                  "last_turn": last_turn or c.truncated,
                                                  "tokens_left": max_seq_len - len(c.tokens)}}
                                   for c in group])
            rewards, terminateds = ret.rewards, ret.terminateds  # lists (EnvironmentReturn)
            for k, c in enumerate(group):
                c.reward += rewards[k]
                earlier_error, returned = c.metadata.get(ENV_ERROR_KEY), ret.metadata[k]
                c.correct = verdict(returned)
                if returned is not None:
                    c.metadata = {key: v for key, v in returned.items() if key not in (ROLLOUT_KEY, CORRECT_KEY)}
                if returned is not None and returned.get(ENV_ERROR_KEY):
                    c.env_errors += 1
                elif earlier_error:
                    c.metadata[ENV_ERROR_KEY] = earlier_error  # the sample's log keeps it
                if c.env_errors:  # a failed verification scores the sample 0, earlier turns' rewards too,
                    # and has no verdict: a NaN reward with env_correct=True counted in accuracy and pass@k
                    c.reward, c.correct = 0.0, None
                if ret.tool_calls is not None and ret.tool_calls[k]:
                    c.messages[-1]["tool_calls"] = ret.tool_calls[k]  # what the tool results answer
                if terminateds[k] or last_turn or c.truncated:
                    c.done = True
                    # A cut answer says so though the environment ended the conversation too: a
                    # single-turn one always does, and every sample read "environment".
                    c.stop_reason = ("context" if c.truncated and len(c.tokens) >= max_seq_len else
                                     "max_new_tokens" if c.truncated else
                                     "environment" if terminateds[k] else "max_turns")
                    continue
                obs = ret.observations[k]
                obs = obs if isinstance(obs, list) else [obs]  # several: one tool result per call
                # A message without a role is the environment's, as a text observation is: kept
                # without one, it stopped the step at the logs, which read each message's role.
                obs = [m if m.get("role") else {**m, "role": "environment"} for m in obs]
                obs = [{**m, "content": _utf8(m["content"])} if isinstance(m.get("content"), str) else m for m in obs]
                try:
                    obs_tokens = _next_turn_tokens(tokenizer, c, obs, add_generation_prompt)
                except Exception as e:  # noqa: BLE001 - e.g. content the chat template cannot write
                    # The environment's observation, not the run, is at fault: the sample scores 0.
                    error = f"environment {task!r}: the chat template cannot render its observation {obs!r:.120}: " \
                            f"{type(e).__name__}: {e}"
                    log.warning("%s; the sample scores 0", error)
                    c.metadata[ENV_ERROR_KEY] = error
                    c.env_errors += 1
                    c.reward = 0.0
                    c.done, c.stop_reason = True, "observation_error"
                    continue
                if len(c.tokens) + len(obs_tokens) >= max_seq_len:
                    c.done = c.truncated = True
                    c.stop_reason = "context"
                    if ret.tool_calls is not None and ret.tool_calls[k] and _is_number(c.metadata.get(TOOL_CALLS_KEY)):
                        # Its results never reach the model: the call counts as one in the last turn
                        # does not (the environment, told only the tokens left, ran it).
                        c.metadata[TOOL_CALLS_KEY] = max(0, c.metadata[TOOL_CALLS_KEY] - 1)
                    continue
                c.messages += obs
                c.tokens += obs_tokens
                c.generated_mask += [0] * len(obs_tokens)
                c.generation_logprobs += [0.0] * len(obs_tokens)
                nxt = ret.next_stop_strings[k]
                c.stop_strings = nxt if nxt is not None else c.row_stop_strings

    batch = BatchedDataDict(
        input_ids=_pad([c.tokens for c in convs], pad_id, torch.long),
        input_lengths=torch.tensor([len(c.tokens) for c in convs], dtype=torch.long),
        token_mask=_pad([c.generated_mask for c in convs], 0, torch.float32),
        generation_logprobs=_pad([c.generation_logprobs for c in convs], 0.0, torch.float32),
        rewards=torch.tensor([c.reward for c in convs], dtype=torch.float32),
        truncated=torch.tensor([c.truncated for c in convs], dtype=torch.bool),
        env_errors=torch.tensor([c.env_errors > 0 for c in convs], dtype=torch.bool),
        response_lengths=torch.tensor([c.response_tokens for c in convs], dtype=torch.float32),
    )
    return RolloutResult(batch=batch, conversations=convs, generate_s=generate_s)


def summarize_rollouts(convs: Sequence[Conversation]) -> dict[str, float]:
    """Means over conversations (a step's rollouts, over all its generation rounds): the reward, the
    share of the judged ones their environment judged correct (accuracy; left out when none was
    judged, see `posttrain.environments.interfaces`), lengths and turns, plus each reward component's mean
    as reward/<name> (over the samples a list of reward functions scored, less those a TRL
    function returned None for), each environment metric's
    mean as env/<name> (over the samples that have it as a number) and, when the model had tools, the turns
    with tool calls per conversation (tool_calls_mean), and per environment when there are several
    (`_per_task`)."""
    n = len(convs)
    lengths = [c.response_tokens for c in convs]
    components: dict[str, list[float]] = defaultdict(list)
    env_metrics: dict[str, list[float]] = defaultdict(list)
    for c in convs:
        # Numbers only (a NumPy or torch scalar too), here and for the tool calls below: these keys
        # are the environment's to write, and a sample's None (a TRL function's "not applicable",
        # "not measured here"), text or list stopped the driver in the sums, after the step's generation.
        for key, out in ((REWARD_COMPONENTS_KEY, components), (ENV_METRICS_KEY, env_metrics)):
            for name, value in _mapping((c.metadata or {}).get(key)).items():
                if _is_number(value):
                    out[name].append(float(value))
    tool_calls = [float(v) if _is_number(v := (c.metadata or {}).get(TOOL_CALLS_KEY, 0)) else 0.0 for c in convs]
    share_correct = accuracy([c.correct for c in convs])
    return {
        "reward": sum(c.reward for c in convs) / n,
        **({"accuracy": share_correct} if share_correct is not None else {}),
        "response_length_mean": sum(lengths) / n,
        "response_length_max": float(max(lengths)),
        "truncation_rate": sum(c.truncated for c in convs) / n,
        # Conversations whose prompt the engine cut from the left to fit the context
        # (policy.generation.overlong_prompt=truncate; a later turn's, as GRPO's setup fits the first).
        "prompt_truncated": float(sum(c.prompt_truncated for c in convs)),
        "turns_mean": sum(c.turns for c in convs) / n,
        "env_errors": float(sum(c.env_errors for c in convs)),
        "generated_tokens": float(sum(lengths)),
        **{f"reward/{name}": sum(v) / len(v) for name, v in components.items()},
        **{f"env/{name}": sum(v) / len(v) for name, v in env_metrics.items()},
        **({"tool_calls_mean": sum(tool_calls) / n} if any(c.tools for c in convs) else {}),
        **_per_task(convs),
    }


def _per_task(convs: Sequence[Conversation]) -> dict[str, float]:
    """With conversations of several environments (data.mixture), each one's mean reward and accuracy
    (task_reward/<task>, task_accuracy/<task>: the latter over its judged ones, left out without any)."""
    tasks = sorted({c.task_name for c in convs})
    if len(tasks) < 2:
        return {}
    out = {}
    for task in tasks:
        mine = [c for c in convs if c.task_name == task]
        out[f"task_reward/{task}"] = sum(c.reward for c in mine) / len(mine)
        if (share := accuracy([c.correct for c in mine])) is not None:
            out[f"task_accuracy/{task}"] = share
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) or getattr(value, "shape", None) == ()  # a bool too: a rate


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}
