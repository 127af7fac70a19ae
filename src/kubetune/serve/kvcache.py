"""The KV cache of the native engine: one slot per running sequence, and the attention that reads it.

Each layer keeps K and V as [slots, kv_heads, capacity, head_dim]. Sequences that are
decoding occupy slots 0..n-1, so a decode step attends over a view of the first n slots
(no gather, no copy); sequences still reading their prompt (chunked prefill) occupy slots
from the top. When a sequence finishes, the last decoding sequence moves into its slot,
and when a prompt is read its sequence moves down to the end of the decoding range: one copy
of one sequence's cache per event, never per step.

The cache plugs into transformers' own model code as its `cache` (the model calls
`update(k, v, layer_idx)` in every attention layer), and `slot_attention` is registered as
an attention implementation: the model code, rotary embeddings and projections stay
transformers'. The memory of the cache is bounded by a budget in bytes: both dimensions
grow on demand and never past it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

ATTENTION_NAME = "kubetune_slots"
GROW_TOKENS = 256  # capacity grows in steps of this many positions


@dataclass
class Rows:
    """The rows of one forward: for each, its slot, the position of its first new token and how many."""

    slots: torch.Tensor  # [b]
    starts: torch.Tensor  # [b]
    counts: torch.Tensor  # [b]
    decode: bool  # every row has one new token and the slots are 0..b-1
    fresh: bool  # every row starts at position 0 (a first prefill chunk): no cached keys to read

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.counts


class SlotCache:
    """K/V per layer in slots; `update` is what transformers' attention layers call."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, budget_bytes: int) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.token_bytes = 2 * layers * kv_heads * head_dim * dtype.itemsize
        self.budget_tokens = max(1, budget_bytes // self.token_bytes)
        self.slots = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows: Rows | None = None

    # --- memory -------------------------------------------------------------------------
    def plan(self, slots: int, capacity: int) -> tuple[int, int]:
        """The shape (slots, positions) the cache must have to hold `slots` sequences of up to
        `capacity` positions: never smaller than now, positions rounded up to GROW_TOKENS
        where the budget allows (so that growing is rare)."""
        slots = max(slots, self.slots)
        rounded = max(self.capacity, -(-capacity // GROW_TOKENS) * GROW_TOKENS)
        if slots * rounded <= self.budget_tokens:
            return slots, rounded
        return slots, max(self.capacity, capacity)

    def fits(self, slots: int, capacity: int) -> bool:
        planned_slots, planned_capacity = self.plan(slots, capacity)
        return planned_slots * planned_capacity <= self.budget_tokens

    def reserve(self, slots: int, capacity: int) -> None:
        """Grow to the planned shape for `slots` x `capacity`; the caller checked `fits`."""
        slots, capacity = self.plan(slots, capacity)
        if slots == self.slots and capacity == self.capacity:
            return
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        for store in (self.k, self.v):
            for i in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype)
                if store and self.capacity:
                    grown[: self.slots, :, : self.capacity] = store[i]
                if len(store) < self.layers:
                    store.append(grown)
                else:
                    store[i] = grown
        self.slots, self.capacity = slots, capacity

    @property
    def allocated_bytes(self) -> int:
        return self.slots * self.capacity * self.token_bytes

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy one sequence's cache from slot `src` to slot `dst`."""
        if src != dst and length:
            for store in (self.k, self.v):
                for t in store:
                    t[dst, :, :length] = t[src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the caches of slots `a` and `b` (the right side is gathered, i.e. copied, first)."""
        if a != b and length:
            for store in (self.k, self.v):
                for t in store:
                    t[[a, b], :, :length] = t[[b, a], :, :length]

    # --- the transformers Cache interface used by the model's forward -------------------
    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows
        assert rows is not None, "set the rows of the forward first"
        k_store, v_store = self.k[layer_idx], self.v[layer_idx]
        if rows.decode:
            n = key.shape[0]
            arange = torch.arange(n)
            k_store[arange, :, rows.starts] = key[:, :, 0]
            v_store[arange, :, rows.starts] = value[:, :, 0]
            length = int(rows.ends.max())
            return k_store[:n, :, :length], v_store[:n, :, :length]
        # prefill chunks: write the valid tokens of each row into its slot
        b_idx, j_idx = _valid(rows.counts, key.shape[2])
        k_store[rows.slots[b_idx], :, rows.starts[b_idx] + j_idx] = key[b_idx, :, j_idx]
        v_store[rows.slots[b_idx], :, rows.starts[b_idx] + j_idx] = value[b_idx, :, j_idx]
        if rows.fresh:
            return key, value
        length = int(rows.ends.max())
        return k_store[rows.slots, :, :length], v_store[rows.slots, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    # --- masks --------------------------------------------------------------------------
    def mask(self, rows: Rows, width: int) -> torch.Tensor:
        """[b, 1, width, keys] bool: a row's query j sees keys 0 .. start+j (its own sequence only)."""
        keys = int(rows.ends.max()) if not rows.fresh else width
        key_pos = torch.arange(keys)
        query_pos = rows.starts[:, None] + torch.arange(width)[None, :]  # [b, width]
        return (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]


def _valid(counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) indices of the real tokens of right-padded rows."""
    valid = torch.arange(width)[None, :] < counts[:, None]
    return valid.nonzero(as_tuple=True)


def slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA over the slot cache. A decode step puts each key/value head's query heads on the
    query axis ([b, kv_heads, group, d]), so grouped-query attention needs no copy of K/V."""
    b, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    if width == 1:
        grouped = query.reshape(b, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, heads, dim), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=heads != kv_heads
    )
    return out.transpose(1, 2), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    return ATTENTION_NAME
