"""Tokenize rendered rows into (input_ids, trainable-mask) and cache them on disk.

Labels live only on response tokens (and the EOS that closes the response); prompt tokens
are never trained on. The cache is keyed by a hash of the rows, the tokenizer, the template
and the length settings, so any change rebuilds it and an unchanged rerun (or another rank)
reads it back in milliseconds. It is built under a file lock: other processes wait on the
lock, not on a collective with a timeout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kubetune.data.templates import PromptRenderer, Row
from kubetune.errors import DataError
from kubetune.fsutil import atomic_dir, file_lock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_FORMAT = 2  # 2: custom templates naming one placeholder keep the whole question


@dataclass
class TokenizedData:
    """All samples, concatenated: sample i is ids[offsets[i]:offsets[i+1]]."""

    ids: npt.NDArray[np.int32]
    trainable: npt.NDArray[np.bool_]  # this token is a target (response or EOS)
    offsets: npt.NDArray[np.int64]  # len = n + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.trainable[a:b]

    def subset(self, indices: Iterable[int]) -> TokenizedData:
        parts_ids: list[npt.NDArray[np.int32]] = []
        parts_tr: list[npt.NDArray[np.bool_]] = []
        lengths: list[int] = []
        for i in indices:
            ids, tr = self.sample(i)
            parts_ids.append(ids)
            parts_tr.append(tr)
            lengths.append(len(ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lengths)
        ids = np.concatenate(parts_ids) if parts_ids else np.zeros(0, dtype=np.int32)
        trainable = np.concatenate(parts_tr) if parts_tr else np.zeros(0, dtype=bool)
        return TokenizedData(ids, trainable, offsets)


def tokenize_rows(
    rows: list[Row],
    renderer: PromptRenderer,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    truncate: bool,
    key: str = "data.train",
) -> TokenizedData:
    eos = tokenizer.eos_token_id
    # Chat templates already carry their special tokens (BOS etc.); classic templates rely
    # on the tokenizer adding them (e.g. Llama-2's <s>).
    add_special = not renderer.uses_chat_template
    prompts: list[str] = []
    responses: list[str] = []
    for i, row in enumerate(rows):
        try:
            prompt, response = renderer.render(row)
        except (KeyError, ValueError) as e:
            raise DataError(f"{key}: row {i}: cannot render the prompt ({e})") from None
        prompts.append(prompt)
        responses.append(response)
    p_ids: list[list[int]] = tokenizer(prompts, add_special_tokens=add_special)["input_ids"]
    r_ids: list[list[int]] = tokenizer(responses, add_special_tokens=False)["input_ids"]
    all_ids: list[npt.NDArray[np.int32]] = []
    all_tr: list[npt.NDArray[np.bool_]] = []
    lengths: list[int] = []
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        if len(p) >= max_seq_len:
            raise DataError(
                f"data.max_seq_len={max_seq_len} is shorter than the prompt of row {i} of {key} "
                f"({len(p)} tokens); raise data.max_seq_len or shorten the prompt"
            )
        if r and r[-1] == eos:  # never two EOS: some data already ends with it
            r = r[:-1]
        r = list(r) + [eos]
        if len(p) + len(r) > max_seq_len:
            if not truncate:
                raise DataError(
                    f"data.max_seq_len={max_seq_len}: row {i} of {key} has {len(p) + len(r)} tokens; "
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
) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    h.update(json.dumps([template, system_prompt, max_seq_len, truncate, CACHE_FORMAT]).encode())
    return h.hexdigest()[:24]


def load_or_build(cache_dir: Path, key: str, build: Callable[[], TokenizedData]) -> TokenizedData:
    """Read the cached arrays for `key`, or build them (once, under a lock) and cache them."""
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
    return TokenizedData(np.load(final / "ids.npy"), np.load(final / "trainable.npy"), np.load(final / "offsets.npy"))
