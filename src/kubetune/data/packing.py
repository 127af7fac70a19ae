"""Deterministic, resumable, data-parallel batches of packed (or padded) rows.

The order of epoch `e` is a pure function of (seed, e): samples are permuted, then packed
greedily into rows of at most `max_seq_len` tokens (best fit among a few open rows). Data-
parallel rank r takes rows r, r+dp, r+2dp, ... (all ranks get the same count), and cuts
them into micro-batches. Packed training rows are ordered by length within windows of
`ROW_WINDOW` consecutive rows, longest first (`order_by_length`): the rows that meet in one
step then cost about the same, so a rank rarely waits at the step's all-reduce for another
that drew a fuller row, and a padded micro-batch pads little. The windows do not depend on
the world size, and neither does the order. A position in the data is therefore just
(epoch, first unread row): that is all a checkpoint needs to resume mid-epoch exactly, with
any world size (the position is counted in rows consumed by all ranks together).

On Gaudi, batches are padded to a few static shapes (`shape_buckets`): HPU graphs are
compiled per input shape, and rows whose length follows their samples would compile a
new graph almost every step. Padding is its own segment with ignored targets, so the loss
is unchanged. CUDA keeps the rows' own lengths, each micro-batch padded to its longest row.
A CPU trains fastest unpadded, so there (`flat`) a micro-batch's rows are laid end to end as
one row: its samples, its tokens and its loss are the same, and no token is padding (rows
padded to the longest of four of the shipped sample's were 8% padding). A GPU keeps the rows
apart: its one masked attention call over a row costs the row's length squared.

Pair data (preference objectives, `TokenizedData.pairs`) is batched by pairs: a pair is one
unit of the shuffle and of packing, so both of its samples sit side by side in one row (its
chosen sample first), each its own attention segment, and a pair is never split across rows
or micro-batches; without packing a row is one pair. Each sample keeps the SFT bound of
`max_seq_len` tokens, so a row of pair data holds up to twice that (`row_tokens`), and the HPU
shapes add the doubled buckets. The batch says which sample each target belongs to and which
samples form each pair (`Batch.target_sample`, `chosen`, `rejected`, `pair_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import torch

from kubetune.data.tokenize import TokenizedData

IGNORE = -100
OPEN_ROWS = 8  # rows kept open while packing: more = fuller rows, same determinism
BUCKET_FLOOR = 128  # the shortest bucket: shorter rows cost little more padded to it
# Consecutive packed rows ordered by length (module docstring). Wider windows balance the
# ranks better (bench/experiments/step_rows.py) and move rows further from their shuffled place.
ROW_WINDOW = 16


def shape_buckets(max_seq_len: int) -> tuple[int, ...]:
    """The row lengths an HPU batch is padded to: powers of two from 128, and max_seq_len.

    Packed rows are nearly always close to max_seq_len (they pad to it at no cost); the short
    ones (an epoch's last rows, eval, data.packing=false) waste at most half their bucket,
    while the shapes, and so the compiled graphs, stay at log2(max_seq_len / 128) + 2 at most
    (6 for 4096).
    """
    buckets = []
    n = min(BUCKET_FLOOR, max_seq_len)
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return (*buckets, max_seq_len)


def flat_rows(device_type: str, pipeline_stages: int) -> bool:
    """Whether a micro-batch's rows go end to end as one row (module docstring): on a CPU,
    except between pipeline stages, whose micro-batches keep the training shape."""
    return device_type == "cpu" and pipeline_stages == 1


def static_shapes(device_type: str, max_seq_len: int) -> tuple[int, ...]:
    """The buckets for a device whose graphs compile per input shape (HPU); () elsewhere."""
    return shape_buckets(max_seq_len) if device_type == "hpu" else ()


def pack_rows(
    lengths: npt.NDArray[np.integer[Any]], order: npt.NDArray[np.integer[Any]], max_seq_len: int
) -> list[list[int]]:
    """Greedy best-fit packing of samples (in `order`) into rows of <= max_seq_len tokens."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, list[int]]] = []  # (free tokens, sample indices)
    for i in order:
        n = int(lengths[i])
        best = -1
        for j, (free, _) in enumerate(open_rows):
            if n <= free and (best < 0 or free < open_rows[best][0]):
                best = j
        if best >= 0:
            free, members = open_rows[best]
            members.append(int(i))
            open_rows[best] = (free - n, members)
            continue
        if len(open_rows) >= OPEN_ROWS:  # close the fullest row to make room
            fullest = min(range(len(open_rows)), key=lambda j: open_rows[j][0])
            rows.append(open_rows.pop(fullest)[1])
        open_rows.append((max_seq_len - n, [int(i)]))
    rows.extend(members for _, members in open_rows)
    return rows


def order_by_length(
    rows: list[list[int]], lengths: npt.NDArray[np.integer[Any]], window: int = ROW_WINDOW
) -> list[list[int]]:
    """`rows` (lists of indices into `lengths`) with each window of `window` consecutive rows
    sorted by tokens, longest first; ties keep their order, and no row leaves its window."""
    tokens = [sum(int(lengths[i]) for i in row) for row in rows]
    out: list[list[int]] = []
    for start in range(0, len(rows), window):
        here = range(start, min(start + window, len(rows)))
        out.extend(rows[i] for i in sorted(here, key=lambda i: -tokens[i]))
    return out


def pair_shapes(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The static shapes of pair data: a row holds up to two samples of the longest bucket."""
    if not buckets:
        return ()
    return (*buckets, *(2 * n for n in buckets if 2 * n > buckets[-1]))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64, restart at 0 for every sample
    targets: torch.Tensor  # [B, T] int64, next-token targets, IGNORE off the response
    cu_seqlens: list[int]  # segment boundaries over the flattened batch
    real_tokens: int  # tokens that are not padding
    target_tokens: int
    # Pair data only (None in SFT batches):
    # [B, T] int64: for each position whose target is not IGNORE, the index (0..S-1, in batch
    # order) of the sample that target belongs to; -1 elsewhere.
    target_sample: torch.Tensor | None = None
    # [P] int64: the sample index (as in target_sample) of each pair's chosen sequence.
    chosen: torch.Tensor | None = None
    # [P] int64: the sample index (as in target_sample) of each pair's rejected sequence.
    rejected: torch.Tensor | None = None
    # [P] int64: each pair's index in its dataset (TokenizedData), for precomputed reference log-probs.
    pair_ids: torch.Tensor | None = None
    # Shared prompts (GRPO's groups): for each attention segment, as seqlens_from_cu(cu_seqlens)
    # lists them, the index of an earlier segment of its row it continues and attends to as a
    # whole (its prompt), or -1. None: every segment attends to itself only.
    prefixes: list[int] | None = None


class PairFields(TypedDict, total=False):
    """Batch's pair-data fields, as Batcher fills them (none for SFT data)."""

    target_sample: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    pair_ids: torch.Tensor


class Batcher:
    """Micro-batches for one data-parallel rank."""

    def __init__(
        self,
        data: TokenizedData,
        *,
        max_seq_len: int,
        micro_batch_size: int,
        packing: bool,
        seed: int,
        pad_id: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        every_row: bool = False,
        buckets: tuple[int, ...] = (),
        flat: bool = False,
    ):
        self.data = data
        self.max_seq_len = max_seq_len
        self.micro_batch_size = micro_batch_size
        self.packing = packing
        self.seed = seed
        self.pad_id = pad_id
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        # Training drops the last rows that cannot go to every rank in equal shares (a step's
        # collectives need the same micro-batches everywhere). Evaluation must score every
        # row: a rank whose share has run out gets an empty micro-batch instead.
        self.every_row = every_row
        # Static shapes (HPU): rows padded to the next of these lengths, and micro-batches to
        # micro_batch_size rows; () keeps each batch's own shape.
        self.buckets = pair_shapes(buckets) if data.pairs else buckets
        self.flat = flat and not buckets  # a micro-batch's rows end to end, as one (module docstring)
        # a row's capacity: pair data packs pairs, whose two samples are each up to max_seq_len
        self.row_tokens = 2 * max_seq_len if data.pairs else max_seq_len
        self._cache: dict[int, list[list[int]]] = {}

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """All rows of an epoch, each a list of sample indices (every rank computes the same list)."""
        if epoch not in self._cache:
            n = len(self.data)  # units: samples, or pairs
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                order = np.arange(n)
            if self.packing:
                rows = pack_rows(self.data.unit_lengths, order, self.row_tokens)
                if self.shuffle:  # training; evaluation's sums do not depend on the order
                    rows = order_by_length(rows, self.data.unit_lengths)
            else:
                rows = [[int(i)] for i in order]
            if self.data.pairs:
                rows = [self.data.unit_samples(row) for row in rows]
            self._cache = {epoch: rows}  # keep one epoch: they are cheap to recompute
        return self._cache[epoch]

    def usable_rows(self, epoch: int, start: int = 0) -> int:
        """Rows this epoch can still give, from row `start`, in equal shares to every rank
        (`every_row`: rounded up, the missing ones empty)."""
        n = len(self.epoch_rows(epoch))
        shares = -(-(n - start) // self.dp_size) if self.every_row else (n - start) // self.dp_size
        return start + shares * self.dp_size

    def micro_batches_left(self, epoch: int, start: int = 0) -> int:
        per_rank = (self.usable_rows(epoch, start) - start) // self.dp_size
        return -(-per_rank // self.micro_batch_size)

    def micro_batch(self, epoch: int, start: int) -> tuple[Batch, int]:
        """The micro-batch of this rank that begins at global row `start` of the epoch.

        Returns the batch and the global row where the next micro-batch begins. Rank r of
        dp takes rows start+r, start+r+dp, ...: consumed rows always form a prefix of the
        epoch, so a checkpoint's `start` is valid for any world size.
        """
        chunk, end = self.rows_at(epoch, start)
        return (self.collate(chunk) if chunk else self.empty()), end

    def rows_at(self, epoch: int, start: int) -> tuple[list[list[int]], int]:
        """This rank's rows (each a list of sample indices) of the micro-batch that begins at
        global row `start`, and the global row where the next one begins."""
        rows = self.epoch_rows(epoch)
        end = min(self.usable_rows(epoch, start), start + self.micro_batch_size * self.dp_size)
        if start >= end:
            raise IndexError(f"row {start} is past the end of epoch {epoch}")
        return [rows[i] for i in range(start + self.dp_rank, min(end, len(rows)), self.dp_size)], end

    def empty(self) -> Batch:
        """A micro-batch of one padding token (of padding in a bucket's shape): no real
        tokens, nothing to score."""
        if self.buckets:
            return self.collate([])
        one = torch.full((1, 1), self.pad_id, dtype=torch.int64)
        no_target = torch.full_like(one, IGNORE)
        pair_fields = self._pair_fields(torch.full_like(one, -1), [])
        return Batch(one, torch.zeros_like(one), no_target, [0, 1], 0, 0, **pair_fields)

    def _pair_fields(self, target_sample: torch.Tensor, samples: list[int]) -> PairFields:
        """The pair fields of a batch holding these samples of the data (in batch order: each
        pair's chosen sample, then its rejected one); {} for SFT data."""
        if not self.data.pairs:
            return {}
        in_batch = torch.arange(len(samples), dtype=torch.int64)
        return {
            "target_sample": target_sample,
            "chosen": in_batch[0::2],
            "rejected": in_batch[1::2],
            "pair_ids": torch.tensor(samples[0::2], dtype=torch.int64) // 2,
        }

    def batch_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """[B, T] of a micro-batch of `rows` rows, the longest `longest` tokens."""
        if not self.buckets:
            return rows, longest
        t = next((n for n in self.buckets if n >= longest), longest)
        return max(rows, self.micro_batch_size), t

    def collate(self, rows: list[list[int]]) -> Batch:
        if self.flat and rows:
            rows = [[i for row in rows for i in row]]
        lengths = [sum(int(self.data.lengths[i]) for i in row) for row in rows]
        b, t = self.batch_shape(len(rows), max(lengths, default=1))
        rows = rows + [[]] * (b - len(rows))  # rows of padding only, to a static batch size
        ids = np.full((b, t), self.pad_id, dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        tgt = np.full((b, t), IGNORE, dtype=np.int64)
        owner = np.full((b, t), -1, dtype=np.int64)  # which sample (in batch order) each target is of
        cu = [0]
        samples: list[int] = []
        for r, row in enumerate(rows):
            cur = 0
            for i in row:
                s_ids, s_tr = self.data.sample(i)
                n = len(s_ids)
                ids[r, cur : cur + n] = s_ids
                pos[r, cur : cur + n] = np.arange(n)
                # target at j is token j+1 when token j+1 is trained on (never across samples)
                nxt = np.where(s_tr[1:], s_ids[1:], IGNORE)
                tgt[r, cur : cur + n - 1] = nxt
                owner[r, cur : cur + n - 1] = np.where(s_tr[1:], len(samples), -1)
                samples.append(i)
                cur += n
                cu.append(r * t + cur)
            if cur < t:  # padding is its own segment: it attends to itself, never to a sample
                pos[r, cur:] = np.arange(t - cur)
                cu.append((r + 1) * t)
        tgt_t = torch.from_numpy(tgt)
        return Batch(
            input_ids=torch.from_numpy(ids),
            position_ids=torch.from_numpy(pos),
            targets=tgt_t,
            cu_seqlens=cu,
            real_tokens=int(sum(lengths)),
            target_tokens=int((tgt_t != IGNORE).sum()),
            **self._pair_fields(torch.from_numpy(owner), samples),
        )
