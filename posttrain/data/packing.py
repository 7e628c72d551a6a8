"""Sequence packing and dynamic batching: how rows are grouped into micro-batches by tokens.

Packing puts several sequences into one row; their `position_ids` restart at 0 for each
sequence and there is no attention mask, which transformers (>= 4.53, all attention
backends: sdpa, eager, flash-attention varlen) reads as "packed sequences": each token
attends only to earlier tokens of its own sequence (see `transformers.masking_utils.
find_packed_sequence_indices`). The model must then be called with `use_cache=False`.

Dynamic batching keeps one sequence per row but sizes micro-batches by a token budget
(rows x padded length), sorting by length so that little compute goes into padding.

Both work on "units" of `group` consecutive rows (2 for chosen/rejected pairs) that always
stay in the same micro-batch, in their original order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKING_ALGORITHMS = ("modified_first_fit_decreasing", "first_fit_decreasing", "first_fit")


def round_up(x: int, multiple: int) -> int:
    """`x` rounded up to a multiple of `multiple`."""
    return -(-x // multiple) * multiple


def _first_fit(order: list[int], sizes: list[int], capacity: int, bins: list[list[int]], loads: list[int]) -> None:
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])


def pack_bins(sizes: list[int], capacity: int, algorithm: str = "modified_first_fit_decreasing") -> list[list[int]]:
    """Group item indices into bins whose summed `sizes` are <= `capacity`.

    - "first_fit": items in the given order, each into the first bin with room.
    - "first_fit_decreasing": the same over items sorted by size, largest first.
    - "modified_first_fit_decreasing" (Johnson & Garey 1985, "A 71/60 theorem for bin
      packing"): items > C/2 open one bin each; going forward through those bins, each takes
      the largest item in (C/3, C/2] that fits; going backward, each takes the smallest item
      <= C/3 plus the largest other such item that still fits; the rest go first-fit decreasing.
    Bins are returned with their item indices sorted ascending (original order inside a bin).
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; valid: {', '.join(PACKING_ALGORITHMS)}")
    too_big = [i for i, s in enumerate(sizes) if s > capacity]
    if too_big:
        raise ValueError(
            f"item {too_big[0]} has {sizes[too_big[0]]} tokens, more than the micro-batch token budget "
            f"{capacity}; raise the *_mb_tokens setting to at least the longest sequence"
        )
    bins: list[list[int]] = []
    loads: list[int] = []
    if algorithm == "first_fit":
        _first_fit(list(range(len(sizes))), sizes, capacity, bins, loads)
    elif algorithm == "first_fit_decreasing":
        _first_fit(sorted(range(len(sizes)), key=lambda i: -sizes[i]), sizes, capacity, bins, loads)
    else:
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        large = [i for i in order if sizes[i] * 2 > capacity]
        medium = [i for i in order if 3 * sizes[i] > capacity >= 2 * sizes[i]]
        small = [i for i in order if 3 * sizes[i] <= capacity]
        for i in large:
            bins.append([i])
            loads.append(sizes[i])
        for b in range(len(bins)):  # forward: largest medium item that fits
            for j, i in enumerate(medium):
                if loads[b] + sizes[i] <= capacity:
                    bins[b].append(medium.pop(j))
                    loads[b] += sizes[i]
                    break
        for b in reversed(range(len(bins))):  # backward: smallest small item + largest that fits with it
            if len(small) >= 2 and loads[b] + sizes[small[-1]] + sizes[small[-2]] <= capacity:
                first = small.pop()
                loads[b] += sizes[first]
                bins[b].append(first)
                for j, i in enumerate(small):
                    if loads[b] + sizes[i] <= capacity:
                        bins[b].append(small.pop(j))
                        loads[b] += sizes[i]
                        break
        _first_fit(sorted(medium + small, key=lambda i: -sizes[i]), sizes, capacity, bins, loads)
    return [sorted(b) for b in bins]


def _units(lengths: list[int], group: int) -> list[list[int]]:
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} rows do not split into groups of {group} (chosen/rejected pairs)")
    return [list(range(u, u + group)) for u in range(0, len(lengths), group)]


def packed_microbatches(lengths: list[int], token_budget: int, algorithm: str,
                        group: int = 1, budget_key: str = "the *_mb_tokens setting",
                        round_to: int = 1) -> list[list[list[int]]]:
    """Micro-batches of packed rows: `[[row indices of packed row 0, ...], ...]` per micro-batch.

    Sequences are packed into rows as long as the longest unit (a sequence, or a pair with
    `group=2`) rounded up to `round_to` (the width `pack_rows` pads them to: the rounding's room
    takes sequences too), so attention, which costs (row length)^2 per row without a varlen
    kernel, costs no more than without packing; then as many rows as fit `token_budget`
    (rows x row length) form one micro-batch. Padding is what packing saves. `budget_key`
    names the setting of `token_budget` in the error when a unit does not fit it.
    """
    units = _units(lengths, group)
    sizes = [sum(lengths[i] for i in u) for u in units]
    if max(sizes) > token_budget:
        raise ValueError(f"a {'pair of sequences' if group > 1 else 'sequence'} has {max(sizes)} tokens, more "
                         f"than the micro-batch token budget {token_budget}; raise {budget_key}")
    row_len = round_up(max(sizes), round_to)
    rows = [[i for u in b for i in units[u]] for b in pack_bins(sizes, row_len, algorithm)]
    per_mb = max(1, token_budget // row_len)
    return [rows[s : s + per_mb] for s in range(0, len(rows), per_mb)]


def dynamic_microbatches(lengths: list[int], token_budget: int, round_to: int = 1, group: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length (longest first) and cut so that
    rows x (longest length rounded up to `round_to`) <= `token_budget` (a single row may exceed it)."""
    units = _units(lengths, group)
    unit_len = [max(lengths[i] for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: -unit_len[u])
    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for u in order:
        padded = round_up(max(current_max, unit_len[u]), round_to)
        if current and padded * (len(current) + group) > token_budget:
            batches.append(current)
            current, current_max = [], 0
        current.extend(units[u])
        current_max = max(current_max, unit_len[u])
    if current:
        batches.append(current)
    return [sorted(b) for b in batches]


@dataclass
class PackedRows:
    """Packed rows `[R, L]` and where each source row sits (source rows in packed order)."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L] restarting at 0 for each sequence (and for the padding tail)
    row: list[int]  # packed row of each source row
    start: list[int]  # offset of each source row in its packed row
    length: list[int]  # unpadded length of each source row


def pack_rows(input_ids: torch.Tensor, input_lengths: torch.Tensor, rows: list[int], pad_id: int,
              round_to: int = 1) -> PackedRows:
    """Pack the unpadded rows of `input_ids [b, S]` into `len(rows)` rows: packed row r holds the
    next `rows[r]` source rows in order. Rows are right-padded to the longest, rounded up to
    a multiple of `round_to`."""
    if sum(rows) != input_ids.shape[0]:
        raise ValueError(f"pack_rows: row sizes {rows} do not cover the {input_ids.shape[0]} source rows")
    lengths = [int(x) for x in input_lengths.tolist()]
    row_of, starts, ids_rows, pos_rows = [], [], [], []
    src = 0
    for r, count in enumerate(rows):
        pieces, positions, offset = [], [], 0
        for _ in range(count):
            n = lengths[src]
            pieces.append(input_ids[src, :n])
            positions.append(torch.arange(n, device=input_ids.device))
            row_of.append(r)
            starts.append(offset)
            offset += n
            src += 1
        ids_rows.append(torch.cat(pieces))
        pos_rows.append(torch.cat(positions))
    width = round_up(max(len(x) for x in ids_rows), round_to)
    ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    pos = torch.zeros((len(rows), width), dtype=torch.long, device=input_ids.device)
    for r, (x, p) in enumerate(zip(ids_rows, pos_rows)):
        ids[r, : len(x)] = x
        # The padding tail is its own segment (positions 0, 1, ...), so it attends to nothing real.
        pos[r, : len(p)] = p
        pos[r, len(p) :] = torch.arange(width - len(p))
    return PackedRows(input_ids=ids, position_ids=pos, row=row_of, start=starts, length=lengths)


def unpack_token_values(values: torch.Tensor, packed: PackedRows, seq_len: int) -> torch.Tensor:
    """Token-aligned values of packed rows `[R, L]` back to `[b, seq_len]` source rows (zeros
    beyond each row's length, and at position 0 where the packed value belongs to the
    previous sequence)."""
    out = values.new_zeros(len(packed.length), seq_len)
    for i, (r, s, n) in enumerate(zip(packed.row, packed.start, packed.length)):
        out[i, 1:n] = values[r, s + 1 : s + n]
    return out


@dataclass
class SharedPrefixRows:
    """Sequences that start with the same prompt, packed as one prefix followed by their suffixes.

    A GRPO group is n completions of one prompt. Packed as `[prompt, suffix_1, ..., suffix_n]`,
    with every suffix attending to the prompt and to itself only and its positions continuing
    after the prompt, each token sees exactly the context it has in its own row, so logits and
    gradients are those of the unshared rows while the prompt is computed once per packed row
    instead of n times (the idea of Prefix Grouper, Liu et al. 2025).
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    segments: torch.Tensor  # [R, L]: 0 = the shared prefix, k >= 1 = the k-th suffix, -1 = padding
    row: torch.Tensor  # [b]: packed row of each source row
    index: torch.Tensor  # [b, S]: packed position of each source token (0 past the row's length)
    prefix_lengths: torch.Tensor  # [R]: the shared prefix is positions [0, prefix_lengths[r])
    suffix_starts: torch.Tensor  # [R, K]: first position of the k-th suffix (K: most suffixes per row)
    suffix_lengths: torch.Tensor  # [R, K]: its length (0 for rows with fewer suffixes)
    # Run attention blockwise (posttrain.policy.blockwise_attention) rather than densely
    # under `attention_mask()`; share_prefixes decides by its cost model.
    blockwise: bool = False

    def attention_mask(self, additive_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`[R, 1, L, L]`: True where query i may attend to key j (a float 0 / -inf-like mask with
        `additive_dtype`, the form eager attention adds to its scores)."""
        seg = self.segments
        length = seg.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        allowed = causal & same & (seg[:, :, None] >= 0) & (seg[:, None, :] >= 0)
        # Padding queries see themselves: a row with no allowed key would turn into NaN, and a
        # NaN value poisons later layers even where its attention weight is 0.
        allowed |= torch.eye(length, dtype=torch.bool, device=seg.device)
        allowed = allowed[:, None]
        if additive_dtype is None:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=additive_dtype, device=seg.device)
        return mask.masked_fill_(~allowed, torch.finfo(additive_dtype).min)


# Blockwise attention pays for its extra kernels (row gathers, two score blocks, a write-back)
# once the dense masked scores reach about this many per head and layer. Measured on CPU:
# the quickstart's micro-batch (8 packed rows of 96, 74k scores) trains 4 optimizer steps in
# 124-130 ms blockwise against 101-127 ms dense, though the attention alone (fwd+bwd) is 1.9 vs
# 2.0 ms; 16 rows of 265 (1.1M): 19 vs 78 ms; a 30M model's GRPO groups (16 x 534, 4.6M): the
# training step 3.0-3.3 s against 4.0-5.9 s dense.
BLOCKWISE_MIN_SCORES = 1 << 18


def share_prefixes(input_ids: torch.Tensor, input_lengths: torch.Tensor, prefix_lengths: torch.Tensor,
                   pad_id: int, max_row_tokens: int, round_to: int = 1,
                   score_cost: float = 0.0, blockwise: bool = False) -> SharedPrefixRows | None:
    """Pack rows whose first `prefix_lengths[r]` tokens are identical as one prefix plus suffixes.

    Rows are grouped by their exact prefix tokens; a group's suffixes fill packed rows of at
    most `max_row_tokens` tokens, or of a smaller cap when that is cheaper (a new packed row
    repeats the prefix). Returns None when no
    two rows share a prefix or when packing would not be cheaper (the caller then runs the
    rows as they are). Cost = tokens + `score_cost` x attention scores: a packed row of length
    L computes L^2 scores under its dense mask, a plain row n^2 / 2 with causal attention;
    `score_cost` is one score's cost in units of one token through the rest of the model.
    With `blockwise` (the model can run blockwise attention) the layout is marked blockwise
    when its dense scores reach BLOCKWISE_MIN_SCORES, and its cost counts the blockwise
    scores: P^2 for the prefix block and S x (P + S) per suffix slot, with P, S the longest
    prefix and suffix and K slots per packed row.
    """
    b, seq_len = input_ids.shape
    # The layout is built in Python lists and becomes tensors once: per-row tensor slicing and
    # assignment (a dozen small ops per row) cost 2.7 ms per quickstart optimizer step.
    tokens = input_ids.tolist()
    lengths = [int(x) for x in input_lengths.tolist()]
    prefixes = [min(int(p), n) for p, n in zip(prefix_lengths.tolist(), lengths)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(b):
        groups.setdefault(tuple(tokens[r][: prefixes[r]]), []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return None
    plain = round_up(max(lengths), round_to)
    plain_cost = b * plain * (1 + score_cost * plain / 2)

    def layout(cap: int) -> tuple[list[tuple[int, list[int]]], int, bool, float]:
        # (prefix length, rows) per packed row, each row at most `cap` tokens (or one suffix).
        packed: list[tuple[int, list[int]]] = []
        for rows in groups.values():
            p = prefixes[rows[0]]
            current, size = [], p
            for r in rows:
                suffix = lengths[r] - p
                if current and size + suffix > cap:
                    packed.append((p, current))
                    current, size = [], p
                current.append(r)
                size += suffix
            packed.append((p, current))
        width = round_up(max(p + sum(lengths[r] - p for r in rows) for p, rows in packed), round_to)
        scores = len(packed) * width * width
        marked = blockwise and scores >= BLOCKWISE_MIN_SCORES
        if marked:
            p_max = max(p for p, _ in packed)
            s_max = max(lengths[r] - p for p, rows in packed for r in rows)
            k_max = max(len(rows) for _, rows in packed)
            scores = len(packed) * (p_max * p_max + k_max * s_max * (p_max + s_max))
        return packed, width, marked, len(packed) * width + score_cost * scores

    # Every packed row is as wide as the widest, so one big group (a prompt drawn twice in a
    # step) would pad all the others to its width: try each group's width as the row cap and
    # keep the cheapest layout (the big group then splits into more rows of the common width).
    # Narrowing the cap pays until it starts splitting the common groups; stop at the first rise.
    caps = {min(prefixes[rows[0]] + sum(lengths[r] - prefixes[r] for r in rows), max_row_tokens)
            for rows in groups.values()}
    best = None
    for cap in sorted(caps, reverse=True):
        candidate = layout(cap)
        if best is not None and candidate[3] > best[3]:
            break
        if best is None or candidate[3] < best[3]:
            best = candidate
    packed, width, blockwise, cost = best
    if cost >= plain_cost:
        return None
    ids, pos, seg = [], [], []
    row = [0] * b
    index = [[0] * seq_len for _ in range(b)]
    starts: list[list[int]] = []
    sizes: list[list[int]] = []
    for i, (p, rows) in enumerate(packed):
        ids_i, pos_i, seg_i = tokens[rows[0]][:p], list(range(p)), [0] * p
        starts.append([])
        sizes.append([])
        for k, r in enumerate(rows, start=1):
            offset, end = len(ids_i), lengths[r]
            ids_i += tokens[r][p:end]
            pos_i += range(p, end)
            seg_i += [k] * (end - p)
            row[r] = i
            index[r][:end] = [*range(p), *range(offset, offset + end - p)]
            starts[-1].append(offset)
            sizes[-1].append(end - p)
        pad = width - len(ids_i)
        ids.append(ids_i + [pad_id] * pad)
        pos.append(pos_i + [0] * pad)
        seg.append(seg_i + [-1] * pad)
    slots = max(len(x) for x in starts)
    dev = input_ids.device

    def tensor(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=dev)

    return SharedPrefixRows(input_ids=tensor(ids, input_ids.dtype), position_ids=tensor(pos),
                            segments=tensor(seg), row=tensor(row), index=tensor(index),
                            prefix_lengths=tensor([p for p, _ in packed]),
                            suffix_starts=tensor([x + [0] * (slots - len(x)) for x in starts]),
                            suffix_lengths=tensor([x + [0] * (slots - len(x)) for x in sizes]),
                            blockwise=blockwise)
