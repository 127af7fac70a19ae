"""Tokenize rendered rows into (input_ids, trainable-mask) and cache them on disk.

Labels live only on response tokens (and the EOS that closes the response); prompt tokens
are never trained on. The cache is keyed by a hash of the rows, the tokenizer, the template
and the length settings, so any change rebuilds it and an unchanged rerun (or another rank)
reads it back in milliseconds. It is built under a file lock: other processes wait on the
lock, not on a collective with a timeout.

Preference data (finetune.objective != sft) is the same arrays with `pairs=True`: sample 2k
is pair k's prompt + chosen answer and sample 2k+1 the same prompt + the rejected answer,
each tokenized exactly as an SFT row with that answer would be (the prompt as SFT renders
it, labels on the answer, EOS once, `data.truncate` applied to each). A flag rather than a
second class, so that the cache, `subset` and the `Batcher` keep one code path: the data's
*units* (what `len` counts, what the eval split, `subset` and the epoch's shuffle take) are
samples in SFT data and pairs in pair data, and a pair is never split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kubetune.data.templates import ANSWERS, PromptRenderer, Row, pair_sequences
from kubetune.errors import DataError
from kubetune.fsutil import atomic_dir, file_lock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_FORMAT = 2  # 2: custom templates naming one placeholder keep the whole question
PAIR_FORMAT = 1  # in the keys of pair data only, so that the SFT keys stay what they were


@dataclass
class TokenizedData:
    """All samples, concatenated: sample i is ids[offsets[i]:offsets[i+1]]."""

    ids: npt.NDArray[np.int32]
    trainable: npt.NDArray[np.bool_]  # this token is a target (response or EOS)
    offsets: npt.NDArray[np.int64]  # len = n + 1
    pairs: bool = False  # preference pairs: samples 2k, 2k+1 are pair k's prompt+chosen, prompt+rejected

    def __len__(self) -> int:
        """The units: samples, or pairs in pair data."""
        return self.samples // 2 if self.pairs else self.samples

    @property
    def samples(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """Tokens of each sample."""
        return np.diff(self.offsets)

    @property
    def unit_lengths(self) -> npt.NDArray[np.int64]:
        """Tokens of each unit (a pair: both of its samples)."""
        lengths = self.lengths
        return lengths[0::2] + lengths[1::2] if self.pairs else lengths

    def unit_samples(self, units: Iterable[int]) -> list[int]:
        """The samples of these units, in order (a pair's chosen sample, then its rejected one)."""
        if self.pairs:
            return [s for u in units for s in (2 * int(u), 2 * int(u) + 1)]
        return [int(u) for u in units]

    def sample(self, i: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.trainable[a:b]

    def subset(self, indices: Iterable[int]) -> TokenizedData:
        """These units (samples, or whole pairs), in this order."""
        parts_ids: list[npt.NDArray[np.int32]] = []
        parts_tr: list[npt.NDArray[np.bool_]] = []
        lengths: list[int] = []
        for i in self.unit_samples(indices):
            ids, tr = self.sample(i)
            parts_ids.append(ids)
            parts_tr.append(tr)
            lengths.append(len(ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lengths)
        ids = np.concatenate(parts_ids) if parts_ids else np.zeros(0, dtype=np.int32)
        trainable = np.concatenate(parts_tr) if parts_tr else np.zeros(0, dtype=bool)
        return TokenizedData(ids, trainable, offsets, self.pairs)


def tokenize_rows(
    rows: list[Row],
    renderer: PromptRenderer,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    truncate: bool,
    key: str = "data.train",
) -> TokenizedData:
    texts = [_render(renderer, row, f"{key}: row {i}") for i, row in enumerate(rows)]
    return _encode(texts, renderer, tokenizer, max_seq_len, truncate, lambda i: f"row {i} of {key}")


def tokenize_pairs(
    rows: list[Row],
    renderer: PromptRenderer,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    truncate: bool,
    key: str = "data.train",
) -> TokenizedData:
    """Preference rows (`sources.map_pair_columns`) -> pair data: each answer after the prompt,
    tokenized as the SFT row with that answer."""
    texts = [_render(renderer, seq, f"{key}: row {i}") for i, row in enumerate(rows) for seq in pair_sequences(row)]
    data = _encode(
        texts, renderer, tokenizer, max_seq_len, truncate, lambda s: f"row {s // 2} of {key} ({ANSWERS[s % 2]} answer)"
    )
    return replace(data, pairs=True)


def _render(renderer: PromptRenderer, row: Row, where: str) -> tuple[str, str]:
    try:
        return renderer.render(row)
    except (KeyError, ValueError) as e:
        raise DataError(f"{where}: cannot render the prompt ({e})") from None


def _encode(
    texts: list[tuple[str, str]],
    renderer: PromptRenderer,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    truncate: bool,
    where: Callable[[int], str],
) -> TokenizedData:
    """(prompt, response) texts -> samples; `where(i)` names sample i's row in errors."""
    eos = tokenizer.eos_token_id
    # Chat templates already carry their special tokens (BOS etc.); classic templates rely
    # on the tokenizer adding them (e.g. Llama-2's <s>).
    add_special = not renderer.uses_chat_template
    p_ids: list[list[int]] = tokenizer([p for p, _ in texts], add_special_tokens=add_special)["input_ids"]
    r_ids: list[list[int]] = tokenizer([r for _, r in texts], add_special_tokens=False)["input_ids"]
    all_ids: list[npt.NDArray[np.int32]] = []
    all_tr: list[npt.NDArray[np.bool_]] = []
    lengths: list[int] = []
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        if len(p) >= max_seq_len:
            raise DataError(
                f"data.max_seq_len={max_seq_len} is shorter than the prompt of {where(i)} "
                f"({len(p)} tokens); raise data.max_seq_len or shorten the prompt"
            )
        if r and r[-1] == eos:  # never two EOS: some data already ends with it
            r = r[:-1]
        r = list(r) + [eos]
        if len(p) + len(r) > max_seq_len:
            if not truncate:
                raise DataError(
                    f"data.max_seq_len={max_seq_len}: {where(i)} has {len(p) + len(r)} tokens; "
                    f"raise data.max_seq_len or set data.truncate=true"
                )
            r = r[: max_seq_len - len(p) - 1] + [eos]
        all_ids.append(np.asarray(p + r, dtype=np.int32))
        tr = np.zeros(len(p) + len(r), dtype=bool)
        tr[len(p) :] = True
        all_tr.append(tr)
        lengths.append(len(p) + len(r))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    return TokenizedData(np.concatenate(all_ids), np.concatenate(all_tr), offsets)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())[:: max(1, len(tokenizer) // 4096)]).encode())
    h.update(str((tokenizer.eos_token_id, tokenizer.bos_token_id, len(tokenizer))).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()


def cache_key(
    rows: list[Row],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    system_prompt: str | None,
    max_seq_len: int,
    truncate: bool,
    pairs: bool = False,
) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    h.update(json.dumps([template, system_prompt, max_seq_len, truncate, CACHE_FORMAT]).encode())
    if pairs:  # only here: the keys of SFT data (and so the caches already built) stay the same
        h.update(json.dumps(["pairs", PAIR_FORMAT]).encode())
    return h.hexdigest()[:24]


def load_or_build(cache_dir: Path, key: str, build: Callable[[], TokenizedData], pairs: bool = False) -> TokenizedData:
    """Read the cached arrays for `key`, or build them (once, under a lock) and cache them.
    `pairs`: the arrays are pair data (the key says so too: `cache_key(..., pairs=True)`)."""
    final = Path(cache_dir) / key
    if not (final / "offsets.npy").is_file():
        with file_lock(Path(cache_dir) / f"{key}.lock"):
            if not (final / "offsets.npy").is_file():
                data = build()
                with atomic_dir(final) as tmp:
                    np.save(tmp / "ids.npy", data.ids)
                    np.save(tmp / "trainable.npy", data.trainable)
                    np.save(tmp / "offsets.npy", data.offsets)
                return data
    ids, trainable, offsets = (np.load(final / f"{name}.npy") for name in ("ids", "trainable", "offsets"))
    return TokenizedData(ids, trainable, offsets, pairs)
