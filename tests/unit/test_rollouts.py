"""Prompt rendering of rollouts agrees token for token with how training rows are built."""

import pytest

from posttrain.data.processors import tokenize_messages
from posttrain.embedded import build_tokenizer
from posttrain.rollouts import _observation_tokens, render_prompt


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("add_bos", [True, False])
def test_generation_prompt_is_the_prefix_of_the_training_row(tok, add_bos):
    prompt = [{"role": "user", "content": "07+38="}]
    row = tokenize_messages(prompt + [{"role": "assistant", "content": "045"}], tok, add_bos=add_bos, add_eos=True)
    ids = render_prompt(tok, prompt, add_bos)
    # The model is asked exactly what it was trained on; the loss starts right after it.
    assert row["input_ids"][: len(ids)] == ids
    assert row["loss_mask"][: len(ids)] == [0] * len(ids)
    assert tok.decode(row["input_ids"][len(ids):]) == "045<|end|>"
    assert (ids[0] == tok.bos_token_id) is add_bos


def test_observation_tokens_continue_the_conversation(tok):
    before = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "up"}]
    obs = _observation_tokens(tok, before, {"role": "environment", "content": "Board"})
    # An environment message is shown as a user turn, followed by the next generation prompt.
    assert tok.decode(obs) == "<|user|>Board<|end|><|assistant|>"
