import pytest

from posttrain.data.loader import RowLoader

ROWS = [{"i": i} for i in range(10)]


def ids(batch):
    return [r["i"] for r in batch]


def test_epochs_cover_all_rows_once_and_drop_the_remainder():
    loader = RowLoader(ROWS, 3, shuffle=True, seed=1)
    first_epoch = [ids(next(loader)) for _ in range(loader.batches_per_epoch)]
    seen = sorted(i for b in first_epoch for i in b)
    assert len(seen) == 9 and len(set(seen)) == 9  # 10 // 3 batches, no repeats
    assert loader.epoch == 0
    next(loader)
    assert loader.epoch == 1


def test_each_epoch_is_shuffled_anew():
    # One order for every epoch showed the model the same batches again and again.
    loader = RowLoader(ROWS[:8], 8, shuffle=True, seed=0)
    first, second = ids(next(loader)), ids(next(loader))
    assert sorted(first) == sorted(second) == list(range(8)) and first != second


def test_same_seed_same_order_other_seed_other_order():
    a = [ids(next(RowLoader(ROWS, 5, seed=7))) for _ in range(1)]
    b = [ids(next(RowLoader(ROWS, 5, seed=7))) for _ in range(1)]
    c = [ids(next(RowLoader(ROWS, 5, seed=8))) for _ in range(1)]
    assert a == b and a != c


def test_resume_continues_at_the_next_row():
    full = RowLoader(ROWS, 4, seed=3)
    expected = [ids(next(full)) for _ in range(7)]
    first = RowLoader(ROWS, 4, seed=3)
    got = [ids(next(first)) for _ in range(3)]
    resumed = RowLoader(ROWS, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [ids(next(resumed)) for _ in range(4)]
    assert got == expected


def test_max_epochs_stops_and_errors_are_clear():
    assert len(list(RowLoader(ROWS, 5, max_epochs=2))) == 4
    with pytest.raises(ValueError, match="fewer than one batch"):
        RowLoader(ROWS[:2], 3)
    loader = RowLoader(ROWS, 2)
    with pytest.raises(ValueError, match="dataset now has 10"):
        loader.load_state_dict({"epoch": 0, "index": 0, "num_rows": 12})


def test_batches_left_counts_from_the_position_also_after_a_resume_with_another_batch_size():
    assert RowLoader(ROWS, 3, max_epochs=2).batches_left == 6
    assert RowLoader(ROWS, 3).batches_left is None  # endless
    first = RowLoader(ROWS, 3, seed=1, max_epochs=2)
    for _ in range(3):
        next(first)  # at row 9 of epoch 0
    # Resumed with batches of 2: none left in epoch 0 (1 row), 5 in epoch 1; `next` yields exactly those.
    resumed = RowLoader(ROWS, 2, seed=1, max_epochs=2)
    resumed.load_state_dict(first.state_dict())
    assert resumed.batches_left == 5
    assert len(list(resumed)) == 5 and resumed.batches_left == 0


def test_served_counts_the_rows_handed_out_over_epochs_and_a_resume_with_another_batch_size():
    first = RowLoader(ROWS, 3, seed=1)
    for _ in range(4):
        next(first)  # 3 batches of epoch 0 (its last row dropped), 1 of epoch 1
    assert first.served == 12 and first.state_dict()["served"] == 12
    resumed = RowLoader(ROWS, 2, seed=1)
    resumed.load_state_dict(first.state_dict())
    next(resumed)
    assert resumed.served == 14  # not (epoch x rows + index) = 12 nor steps x batch size
    # A checkpoint from before the count: whole batches of the finished epochs plus the index.
    old = RowLoader(ROWS, 3, seed=1)
    old.load_state_dict({"epoch": 1, "index": 3, "num_rows": 10, "seed": 1, "shuffle": True})
    assert old.served == 12


def test_resume_refuses_another_row_order():
    first = RowLoader(ROWS, 4, seed=3)
    next(first)
    for other in (RowLoader(ROWS, 4, seed=4), RowLoader(ROWS, 4, seed=3, shuffle=False)):
        with pytest.raises(ValueError, match="repeat some rows of the current epoch"):
            other.load_state_dict(first.state_dict())
    # Without shuffling the seed orders nothing; a checkpoint without `shuffle` predates the key.
    unshuffled = RowLoader(ROWS, 4, seed=3, shuffle=False)
    next(unshuffled)
    RowLoader(ROWS, 4, seed=9, shuffle=False).load_state_dict(unshuffled.state_dict())
    RowLoader(ROWS, 4, seed=3).load_state_dict({"epoch": 0, "index": 4, "num_rows": 10, "seed": 3})


def test_resume_warns_when_the_rows_changed_but_not_their_number(caplog):
    # Only the row count was compared: a file re-sorted or rewritten since resumed without a word,
    # and the rest of the epoch repeated some rows and skipped others.
    first = RowLoader(ROWS, 4, seed=3)
    next(first)
    RowLoader([dict(r) for r in ROWS], 4, seed=3).load_state_dict(first.state_dict())  # the same rows
    assert "differ" not in caplog.text
    for changed in (ROWS[::-1], [{**r, "extra": 1} for r in ROWS]):
        caplog.clear()
        RowLoader(changed, 4, seed=3).load_state_dict(first.state_dict())
        assert "the training rows differ from those the checkpoint's run read (the same 10 rows" in caplog.text


def test_resume_refuses_a_position_past_a_lowered_max_epochs_but_not_a_used_up_last_epoch():
    first = RowLoader(ROWS, 2, max_epochs=3)
    for _ in range(12):
        next(first)  # inside epoch 2 (the third)
    for max_epochs in (2, 1):  # lowered since: it would train nothing and end as if done
        with pytest.raises(ValueError, match=r"in epoch 3, past this run's max_num_epochs=" + str(max_epochs)):
            RowLoader(ROWS, 2, max_epochs=max_epochs).load_state_dict(first.state_dict())
    # A loader made by an algorithm names its section's key, the one to raise.
    with pytest.raises(ValueError, match=r"past this run's sft.max_num_epochs=2: .* raise sft.max_num_epochs above 2"):
        RowLoader(ROWS, 2, max_epochs=2, section="sft").load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match=r"put data.shuffle and grpo.seed back"):
        RowLoader(ROWS, 2, max_epochs=3, seed=7, section="grpo").load_state_dict(first.state_dict())
    resumed = RowLoader(ROWS, 2, max_epochs=3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.batches_left == 3
    # A run that drew past its last batch (GRPO's end of the prompts) saved epoch max_epochs at row 0:
    # a rerun of the finished run, not a lowered limit.
    assert len(list(resumed)) == 3
    again = RowLoader(ROWS, 2, max_epochs=3)
    again.load_state_dict(resumed.state_dict())
    assert again.batches_left == 0


def test_unshuffled_rows_run_as_one_stream_so_every_row_is_used():
    # Dropping each epoch's incomplete last batch left out the same last row (9) every epoch.
    loader = RowLoader(ROWS, 3, shuffle=False, max_epochs=3)
    assert loader.batches_left == 10  # 30 rows of 3 passes, in whole batches
    batches = [ids(b) for b in loader]
    assert batches[:4] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]  # the 4th continues into epoch 1
    assert len(batches) == 10 and batches[-1] == [7, 8, 9]
    counts = [sum(b.count(i) for b in batches) for i in range(10)]
    assert counts == [3] * 10
    assert loader.served == 30 and (loader.epoch, loader.index) == (3, 0) and loader.batches_left == 0
    # One pass of whole batches leaves out row 9; `epoch` says which pass the next row is in.
    one = RowLoader(ROWS, 3, shuffle=False, max_epochs=1)
    assert [ids(b) for b in one] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    partway = RowLoader(ROWS, 3, shuffle=False)
    for _ in range(4):
        next(partway)
    assert (partway.epoch, partway.index, partway.served) == (1, 2, 12)


def test_unshuffled_stream_resumes_at_the_next_row_also_with_another_batch_size_or_max_epochs():
    full = RowLoader(ROWS, 3, shuffle=False)
    expected = [ids(next(full)) for _ in range(7)]
    first = RowLoader(ROWS, 3, shuffle=False)
    got = [ids(next(first)) for _ in range(4)]
    resumed = RowLoader(ROWS, 3, shuffle=False)
    resumed.load_state_dict(first.state_dict())
    got += [ids(next(resumed)) for _ in range(3)]
    assert got == expected
    other_size = RowLoader(ROWS, 4, shuffle=False, max_epochs=2)
    other_size.load_state_dict(first.state_dict())  # at row 2 of epoch 1
    assert other_size.batches_left == 2
    assert [ids(b) for b in other_size] == [[2, 3, 4, 5], [6, 7, 8, 9]]
    assert other_size.served == 12 + 8
    # A finished run keeps its position: raising max_epochs continues with the row the limit left out.
    done = RowLoader(ROWS, 3, shuffle=False, max_epochs=1)
    assert len(list(done)) == 3 and next(done, None) is None
    again = RowLoader(ROWS, 3, shuffle=False, max_epochs=1)
    again.load_state_dict(done.state_dict())
    assert again.batches_left == 0 and next(again, None) is None
    more = RowLoader(ROWS, 3, shuffle=False, max_epochs=2)
    more.load_state_dict(done.state_dict())
    assert more.batches_left == 3 and ids(next(more)) == [9, 0, 1]
