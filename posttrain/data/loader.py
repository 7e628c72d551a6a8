"""A resumable loader over in-memory rows: the one data iterator of every algorithm.

Each epoch is a permutation of the rows drawn from `seed + epoch` (or, unshuffled, the rows in
their order), so the order is the same on every run and after a resume; `state_dict()` is all a
checkpoint needs to continue at the exact next row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from functools import cached_property
from typing import Any, Iterator, Sequence

from posttrain.config import InputError

log = logging.getLogger(__name__)


class RowLoader:
    """Yields lists of `batch_size` rows, epoch after epoch, shuffled per epoch when asked.

    Every step sees a full batch. Shuffled, the last incomplete batch of an epoch is dropped (as
    with `drop_last=True`; another few rows each epoch). Unshuffled, dropping it would leave out
    the same last rows of the data every epoch, so the rows run as one stream instead: a batch
    that reaches the end of the rows continues with the first ones, in the next epoch.
    `max_epochs` bounds the iteration (None = endless): at most that many passes over the rows.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        max_epochs: int | None = None,
        batch_key: str = "the batch size",
        section: str | None = None,
    ):
        """`batch_key`: the config key that sets `batch_size`; `section`: the algorithm's config
        section ("grpo"), whose `seed` and `max_num_epochs` set `seed` and `max_epochs`: all named
        in the errors."""
        if batch_size < 1:
            raise InputError(f"{batch_key} must be >= 1, got {batch_size}")
        if len(rows) < batch_size:
            raise InputError(
                f"the dataset has {len(rows)} rows, fewer than one batch of {batch_size}: "
                f"add data or lower {batch_key}"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self._section = f"{section}." if section else ""
        self.epoch = 0
        self.index = 0  # position of the next row within the current epoch's order
        # Rows handed out since the run began, over epochs and resumes (the checkpoints'
        # consumed_samples): not epoch x rows + index, which a batch size changed at a resume,
        # or an epoch's dropped tail, would miscount.
        self.served = 0
        self._order = self._make_order()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

    def last_step(self, max_num_steps: int, step: int) -> int:
        """The step a run at `step` ends at: `max_num_steps`, or earlier when the epochs run out
        first (`batches_left` from here, one per step; GRPO's dynamic sampling may take more, so
        then an upper bound, exact when no batch is left)."""
        left = self.batches_left
        return max_num_steps if left is None else min(max_num_steps, step + left)

    @property
    def batches_left(self) -> int | None:
        """Batches `next` yields from the current position before `max_epochs` ends (None: endless).

        Counted from the position, not as `max_epochs * batches_per_epoch`: a run resumed with
        another batch size continues at a row index that the old size reached.
        """
        if self.max_epochs is None:
            return None
        if self.epoch >= self.max_epochs:
            return 0
        if not self.shuffle:
            return (self.max_epochs * len(self.rows) - self._position) // self.batch_size
        this_epoch = (len(self.rows) - self.index) // self.batch_size
        return this_epoch + (self.max_epochs - self.epoch - 1) * self.batches_per_epoch

    @property
    def _position(self) -> int:
        """Rows of the unshuffled stream before the next one (over epochs)."""
        return self.epoch * len(self.rows) + self.index

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        n, size = len(self.rows), self.batch_size
        if not self.shuffle:
            start = self._position
            # Past the last pass the position stays, so that a run resumed with a higher
            # max_epochs continues with the rows the limit left out.
            if self.max_epochs is not None and start + size > self.max_epochs * n:
                raise StopIteration
            idx = [i % n for i in range(start, start + size)]
            self.epoch, self.index = divmod(start + size, n)
        else:
            if self.index + size > n:
                self.epoch += 1
                self.index = 0
                self._order = self._make_order()
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                raise StopIteration
            idx = self._order[self.index : self.index + size]
            self.index += size
        self.served += size
        return [self.rows[i] for i in idx]

    @cached_property
    def rows_digest(self) -> str:
        """A digest of the rows (their tokens, labels, texts): a resume checks the data is the one
        the checkpoint's run read, beyond its row count. Once per run (~0.1 s per 10^4 rows)."""
        h = hashlib.sha256()
        for row in self.rows:
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": len(self.rows), "seed": self.seed,
                "shuffle": self.shuffle, "served": self.served, "rows_digest": self.rows_digest}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_rows") not in (None, len(self.rows)):
            raise InputError(
                f"the checkpoint's data loader saw {state['num_rows']} rows but the dataset now has "
                f"{len(self.rows)}: resuming would not continue where the run stopped"
            )
        if state.get("rows_digest") not in (None, self.rows_digest):
            # Not refused: a file mended since (a typo fixed) is a reason to go on. But the position
            # is an index into the old rows' order, which the rest of the epoch follows.
            log.warning("the training rows differ from those the checkpoint's run read (the same %d rows in number, "
                        "other contents or order): the run continues at its position, so in the current epoch some "
                        "rows may come twice and others not at all", len(self.rows))
        shuffle, seed = state.get("shuffle", self.shuffle), state.get("seed", self.seed)
        # The position is an index into the epoch's order: another order would repeat some rows of
        # the epoch and skip others (without shuffling, the seed orders nothing).
        if shuffle != self.shuffle or (shuffle and seed != self.seed):
            raise InputError(
                f"the checkpoint's data loader ordered its rows with shuffle={shuffle}, seed={seed} but this run's "
                f"has shuffle={self.shuffle}, seed={self.seed}: resuming would repeat some rows of the current "
                f"epoch and skip others; put data.shuffle and {self._section}seed back"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        # Inside an epoch past the limit (max_num_epochs lowered since): the resume would train
        # nothing and end as if the run were done. At index 0 the previous epoch was just used up.
        if self.max_epochs is not None and (epoch, index) > (self.max_epochs, 0):
            raise InputError(
                f"the checkpoint's data loader is in epoch {epoch + 1}, past this run's "
                f"{self._section}max_num_epochs={self.max_epochs}: resuming would train nothing; raise "
                f"{self._section}max_num_epochs above {epoch} to continue"
            )
        self.epoch, self.index = epoch, index
        # Checkpoints from before the count: whole epochs of whole batches, the best estimate.
        self.served = int(state.get("served", self.epoch * self.batches_per_epoch * self.batch_size + self.index))
        self._order = self._make_order()
