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

import collections
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
    def plan(self, slots: int, capacity: int, max_slots: int | None = None) -> tuple[int, int]:
        """The shape (slots, positions) the cache must have to hold `slots` sequences of up to
        `capacity` positions: never smaller than now; where the budget allows, slots double (up
        to `max_slots`) and positions round up to GROW_TOKENS, so that growing, which copies the
        whole cache, happens a few times per load change instead of at every admission."""
        need = max(slots, self.slots)
        rounded = max(self.capacity, -(-capacity // GROW_TOKENS) * GROW_TOKENS)
        for cand_slots, cand_capacity in (
            (min(max(need, 2 * self.slots), max_slots or need), rounded),
            (need, rounded),
            (need, max(self.capacity, capacity)),
        ):
            if need <= cand_slots and cand_slots * cand_capacity <= self.budget_tokens:
                return cand_slots, cand_capacity
        return need, max(self.capacity, capacity)

    def fits(self, slots: int, capacity: int) -> bool:
        planned_slots, planned_capacity = self.plan(slots, capacity)
        return planned_slots * planned_capacity <= self.budget_tokens

    def reserve(self, slots: int, capacity: int, max_slots: int | None = None) -> None:
        """Grow to the planned shape for `slots` x `capacity`; the caller checked `fits`."""
        slots, capacity = self.plan(slots, capacity, max_slots)
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
    rows, columns = valid.nonzero(as_tuple=True)
    return rows, columns


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
        # one query per sequence: plain matmuls beat SDPA's flash kernel at this size (its
        # per-call set-up costs more than the few KFLOPs of each head)
        grouped = query.reshape(b, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(grouped, key.transpose(-1, -2)) * (scaling or dim**-0.5)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), value)
        return out.reshape(b, 1, heads, dim), None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=heads != kv_heads
    )
    return out.transpose(1, 2), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    return ATTENTION_NAME


class PrefixCache:
    """K/V of prompt prefixes seen before, reused instead of recomputed (vLLM's automatic prefix
    caching, over the slot cache). Chat prompts share long prefixes: the template's header and
    system prompt are the same for every request, and a conversation resends its history.

    Prompts are cut into blocks of BLOCK tokens; a block is known by the hash of its tokens,
    the blocks before it and the adapter (an adapter changes K and V from the first layer on).
    A new sequence copies the K/V of its longest known chain of blocks into its slot and reads
    only the rest of its prompt. Least recently used blocks leave when `budget_tokens` is full.
    """

    BLOCK = 16

    def __init__(self, cache: SlotCache, budget_tokens: int) -> None:
        self.cache = cache
        self.max_blocks = max(0, budget_tokens // self.BLOCK)
        self.blocks: collections.OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self.hits = 0  # prompt tokens served from here, for the log and tests

    def _chain(self, tokens: list[int], adapter: int, limit: int) -> list[int]:
        keys, parent = [], hash(("adapter", adapter))
        for start in range(0, limit - self.BLOCK + 1, self.BLOCK):
            parent = hash((parent, *tokens[start : start + self.BLOCK]))
            keys.append(parent)
        return keys

    def restore(self, tokens: list[int], adapter: int, slot: int) -> int:
        """Copy the longest known prefix of `tokens` (never the last token: its logits are
        needed) into `slot`; returns how many tokens were restored."""
        if not self.max_blocks:
            return 0
        found = 0
        for i, key in enumerate(self._chain(tokens, adapter, len(tokens) - 1)):
            block = self.blocks.get(key)
            if block is None:
                break
            self.blocks.move_to_end(key)
            span = slice(i * self.BLOCK, (i + 1) * self.BLOCK)
            for layer in range(self.cache.layers):
                self.cache.k[layer][slot, :, span] = block[0][layer]
                self.cache.v[layer][slot, :, span] = block[1][layer]
            found = (i + 1) * self.BLOCK
        self.hits += found
        return found

    def remember(self, tokens: list[int], adapter: int, slot: int) -> None:
        """Keep the full blocks of a prompt whose K/V now sit in `slot`."""
        if not self.max_blocks:
            return
        for i, key in enumerate(self._chain(tokens, adapter, len(tokens))):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            span = slice(i * self.BLOCK, (i + 1) * self.BLOCK)
            k = torch.stack([self.cache.k[layer][slot, :, span] for layer in range(self.cache.layers)])
            v = torch.stack([self.cache.v[layer][slot, :, span] for layer in range(self.cache.layers)])
            self.blocks[key] = (k, v)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)
