"""The `story` environment (stories260K GRPO demo): mention counting, the graded reward, and
the prompt rows' train/validation split."""

import pytest

from posttrain.environments.story import (
    ANIMALS,
    OPENINGS,
    StoryEnvironment,
    count_mentions,
    make_story_rows,
)
from posttrain.schemas import DataConfig, EnvWorkerConfig


def _conv(text):
    return [{"role": "user", "content": "Lily had a pet dog."}, {"role": "assistant", "content": text}]


def test_count_mentions_whole_words_plural_and_case():
    assert count_mentions("The dog ran. Dogs bark! A DOG.", "dog") == 3
    assert count_mentions("doghouse hotdog dogma", "dog") == 0
    assert count_mentions("", "cat") == 0


@pytest.mark.parametrize(
    "text,min_mentions,reward",
    [("no animal here", 3, 0.0), ("the dog", 3, 1 / 3), ("dog dog", 3, 2 / 3), ("dog dog dog dog", 3, 1.0),
     ("the dog", 1, 1.0)],
)
def test_reward_is_capped_fraction_of_mentions(text, min_mentions, reward):
    env = StoryEnvironment(EnvWorkerConfig(cfg={"min_mentions": min_mentions}))
    ret = env.step([_conv(text)], [{"answer": "dog"}])
    assert ret.rewards == pytest.approx([reward])
    assert ret.terminateds == [True]
    assert ret.answers == [str(count_mentions(text, "dog"))]


def test_missing_answer_scores_zero_with_an_error():
    env = StoryEnvironment(EnvWorkerConfig())
    ret = env.step([_conv("dog dog dog")], [{}])
    assert ret.rewards == [0.0]
    assert "answer" in ret.metadata[0]["env_error"]


def test_eval_refuses_story_rows_without_the_animal_at_setup():
    # A file of story prompts (data.task_name=story) without `answer`: eval took it, and every
    # sample scored 0 as an environment error instead of the run failing at setup naming the rows.
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    rows = [{"messages": [{"role": "user", "content": "Lily had a pet dog."}], "task_name": "story"}]
    with pytest.raises(ValueError, match="1 of 1 rows for environment 'story' have no reference `answer`"):
        resolve_task_envs(rows, EnvConfig(), require_answers=True)
    assert resolve_task_envs([{**rows[0], "answer": "dog"}], EnvConfig(), require_answers=True) == ["story"]


def test_bad_env_config_is_rejected():
    with pytest.raises(ValueError):
        StoryEnvironment(EnvWorkerConfig(cfg={"min_mentions": 0}))


def test_rows_split_is_disjoint_seeded_and_covers_all_pairs():
    cfg = DataConfig(dataset_name="stories", num_val=16, seed=3)
    val, train = make_story_rows(cfg, "val"), make_story_rows(cfg, "train")
    assert len(val) == 16 and len(train) == len(OPENINGS) * len(ANIMALS) - 16
    key = lambda r: r["messages"][0]["content"]  # noqa: E731
    assert not {key(r) for r in val} & {key(r) for r in train}
    assert [key(r) for r in make_story_rows(cfg, "val")] == [key(r) for r in val]
    assert [key(r) for r in make_story_rows(DataConfig(num_val=16, seed=4), "val")] != [key(r) for r in val]
    for r in val + train:
        assert r["task_name"] == "story" and r["answer"] in ANIMALS and r["answer"] in key(r)
    # Validation is capped at a quarter of the pairs so that training keeps most of them.
    assert len(make_story_rows(DataConfig(num_val=1000), "val")) == len(OPENINGS) * len(ANIMALS) // 4
    assert len(make_story_rows(DataConfig(num_val=8, num_train=10), "train")) == 10
