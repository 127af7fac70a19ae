"""The KV cache of the native engine: one slot per running sequence, and the attention that reads it.

Each layer keeps K and V as [slots, kv_heads, capacity, head_dim]. Sequences that are
decoding occupy slots 0..n-1, so a decode step attends over a view of the first n slots
(no gather, no copy); sequences still reading their prompt (chunked prefill) occupy slots
from the top. When a sequence finishes, the last decoding sequence moves into its slot,
and when a prompt is read its sequence moves down to the end of the decoding range: one copy
of one sequence's cache per event, never per step.

One forward serves a whole engine turn: its tokens are flattened into one row (vLLM's
layout), the new token of every decoding sequence first, then the chunks of prompts being
read. The linear layers see every token of the turn in one matmul, and a prompt arriving
costs its own tokens only, not a second pass over the model's layers.

The cache plugs into transformers' own model code as its `cache` (the model calls
`update(k, v, layer_idx)` in every attention layer), and `slot_attention` is registered as
an attention implementation: the model code, rotary embeddings and projections stay
transformers'. The memory of the cache is bounded by a budget in bytes: both dimensions
grow on demand and never past it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

ATTENTION_NAME = "kubetune_slots"
BATCH_KWARG = "kubetune_batch"  # how the forward hands the Batch to slot_attention
GROW_TOKENS = 256  # capacity grows in steps of this many positions


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens of one sequence in the flat batch: positions start .. start+count-1."""

    slot: int
    start: int
    count: int
    offset: int  # index of its first token in the batch

    def mask(self) -> torch.Tensor | None:
        """[count, start+count] causal mask over the sequence's keys; None when the chunk starts
        the sequence (SDPA's own causal mask then fits)."""
        if self.start == 0:
            return None
        end = self.start + self.count
        return torch.arange(end)[None, :] <= torch.arange(self.start, end)[:, None]


@dataclass
class Batch:
    """The tokens of one forward, flattened: one new token per decoding sequence (slots
    0..decode-1, in order), then the prompt chunks."""

    decode_starts: list[int]  # position of each decoding sequence's new token
    chunks: list[Chunk]
    slots: torch.Tensor = field(init=False)  # [tokens] the slot of each token
    positions: torch.Tensor = field(init=False)  # [tokens] its position in its sequence
    decode_mask: torch.Tensor | None = field(init=False)  # [decode, 1, 1, keys]: keys 0..start
    chunk_masks: list[torch.Tensor | None] = field(init=False)  # per chunk, built once for every layer

    def __post_init__(self) -> None:
        n = len(self.decode_starts)
        starts = torch.tensor(self.decode_starts, dtype=torch.long)
        slots, positions = [torch.arange(n)], [starts]
        for c in self.chunks:
            slots.append(torch.full((c.count,), c.slot, dtype=torch.long))
            positions.append(torch.arange(c.start, c.start + c.count))
        self.slots, self.positions = torch.cat(slots), torch.cat(positions)
        self.chunk_masks = [c.mask() for c in self.chunks]
        self.decode_mask = None
        if n:
            keys = torch.arange(int(starts.max()) + 1)
            self.decode_mask = (keys[None, :] <= starts[:, None])[:, None, None, :]

    @classmethod
    def of(cls, decode_starts: list[int], chunks: list[tuple[int, int, int]]) -> Batch:
        """From the decoding sequences' positions and (slot, start, count) per prompt chunk."""
        placed, offset = [], len(decode_starts)
        for slot, start, count in chunks:
            placed.append(Chunk(slot, start, count, offset))
            offset += count
        return cls(decode_starts, placed)

    @property
    def decode(self) -> int:
        return len(self.decode_starts)

    @property
    def tokens(self) -> int:
        return int(self.slots.shape[0])


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
        self.batch: Batch | None = None  # of the forward in progress

    @classmethod
    def for_config(cls, config: Any, dtype: torch.dtype, budget_bytes: int) -> SlotCache:
        """The cache of a transformers model config. Its `head_dim` where it sets one: some
        models' heads are not hidden_size / num_attention_heads wide (Qwen3, Gemma)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype, budget_bytes)

    # --- memory -------------------------------------------------------------------------
    def plan(self, slots: int, capacity: int, max_slots: int | None = None) -> tuple[int, int]:
        """The shape (slots, positions) the cache must have to hold `slots` sequences of up to
        `capacity` positions: never smaller than now; when more slots are needed they double
        where the budget allows (up to `max_slots`), and positions round up to GROW_TOKENS, so
        that growing, which copies the whole cache, happens a few times per load change instead
        of at every admission (and never while the slots suffice: a stall of seconds, and the
        memory of slots no one uses)."""
        need = max(slots, self.slots)
        doubled = need if need <= self.slots else min(max(need, 2 * self.slots), max_slots or need)
        rounded = max(self.capacity, -(-capacity // GROW_TOKENS) * GROW_TOKENS)
        for cand_slots, cand_capacity in (
            (doubled, rounded),
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
        """Write the batch's new K/V ([1, kv_heads, tokens, dim]) into their slots; the whole
        store goes to slot_attention, which reads each sequence's part."""
        batch = self.batch
        assert batch is not None, "set the batch of the forward first"
        k_store, v_store = self.k[layer_idx], self.v[layer_idx]
        k_store[batch.slots, :, batch.positions] = key[0].transpose(0, 1)
        v_store[batch.slots, :, batch.positions] = value[0].transpose(0, 1)
        return k_store, v_store

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


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
    """Attention of a flat batch over the slot stores (`key`, `value`: [slots, kv_heads,
    capacity, dim]); `query` is [1, heads, tokens, dim]. Returns [1, tokens, heads, dim]."""
    batch: Batch = kwargs[BATCH_KWARG]
    scale = scaling or query.shape[-1] ** -0.5
    parts = []
    if batch.decode:
        parts.append(_decode_attention(query[0, :, : batch.decode], key, value, batch, scale))
    for c, mask in zip(batch.chunks, batch.chunk_masks):
        parts.append(_chunk_attention(query[:, :, c.offset : c.offset + c.count], key, value, c, mask, scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[None], None


def _decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: Batch, scale: float
) -> torch.Tensor:
    """One query per decoding sequence ([heads, n, dim]) over slots 0..n-1. Each key/value
    head's query heads go on the query axis ([n, kv_heads, group, dim]), so grouped-query
    attention needs no copy of K/V, and plain matmuls beat SDPA's flash kernel at this size
    (its per-call set-up costs more than the few KFLOPs of each head)."""
    heads, n, dim = query.shape
    kv_heads = key.shape[1]
    assert batch.decode_mask is not None
    length = batch.decode_mask.shape[-1]
    k, v = key[:n, :, :length], value[:n, :, :length]
    grouped = query.transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~batch.decode_mask, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)
    return out.reshape(n, heads, dim)


def _chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, c: Chunk, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """A prompt chunk ([1, heads, count, dim]) over its sequence's keys 0 .. start+count-1,
    causal: query j sees keys up to start+j (`mask`, or SDPA's own causal mask when the chunk
    starts the sequence). Returns [count, heads, dim]."""
    end = c.start + c.count
    k, v = key[c.slot : c.slot + 1, :, :end], value[c.slot : c.slot + 1, :, :end]
    gqa = query.shape[1] != key.shape[1]
    causal = mask is None
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


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

    def clear(self) -> None:
        """Forget every block (the weights they were computed with have changed)."""
        self.blocks.clear()

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

    def first_unknown(self, tokens: list[int], adapter: int) -> int | None:
        """The key of the first block of `tokens` that `restore` would not find (None: all known)."""
        for key in self._chain(tokens, adapter, len(tokens) - 1) if self.max_blocks else ():
            if key not in self.blocks:
                return key
        return None

    def completed_by(self, tokens: list[int], adapter: int, start: int, end: int) -> set[int]:
        """Keys of the blocks that reading tokens[start:end] completes."""
        if not self.max_blocks:
            return set()
        keys = self._chain(tokens, adapter, end)
        return set(keys[start // self.BLOCK :])

    def remember(self, tokens: list[int], adapter: int, slot: int, written: int) -> None:
        """Keep the full blocks among the first `written` tokens of a prompt, whose K/V now sit
        in `slot` (called after every chunk, so a long prompt shares its head while it is read)."""
        if not self.max_blocks:
            return
        for i, key in enumerate(self._chain(tokens, adapter, written)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            span = slice(i * self.BLOCK, (i + 1) * self.BLOCK)
            k = torch.stack([self.cache.k[layer][slot, :, span] for layer in range(self.cache.layers)])
            v = torch.stack([self.cache.v[layer][slot, :, span] for layer in range(self.cache.layers)])
            self.blocks[key] = (k, v)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)
