"""A KV cache that appends in place: keys and values are views of buffers with room to spare.

Why: keeping a draft tree's path (CausalLM.settle_tree) gathered every layer's whole cache
(index_select): 4.5 ms at 400 cached positions and 6.8 ms at 800 on the 2-core AMD EPYC VM, paid
by every round after a tree (a 1-position pass is ~46 ms). A GrowingLayer keeps each layer in a
buffer [B, H, capacity, D] with spare columns and `keys`/`values` as the view of its first
`length` columns: a kept path moves only its own columns down (1.3 ms at either length), and an
append writes only the new columns instead of transformers' torch.cat of the whole cache (no
difference measured in whole passes there: 58.2 against 58.7 ms at 400 positions, 61.8 against
59.4 at 800). The buffer grows geometrically (amortized O(1) copies per token).

Cropping (rejected drafts) narrows the view; the next append overwrites the dropped columns.
keep_rows (a draft tree's kept path, CausalLM.settle_tree) moves the kept columns down in place and
narrows, instead of gathering the whole cache. Views handed out earlier are only read within the
pass that received them (attention), so writing past the current length never changes what a reader
still holds.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# a buffer grows to 1.25x what it must hold plus this many columns: at most ~25% + 5.9 MB a session
# more than the positions held for the default target (46 KB a position), inside the half of free
# memory the verify's KV budget leaves unused (autotune.KV_MEMORY_SHARE)
SPARE_COLUMNS = 128
# a flat pass's keys are a multiple of this (flat_pass): of every CPU's vector width (AVX-512: 16 floats)
# and of GPU key tiles; a growing buffer holds the columns up to it, so a padded read stays inside
KEY_BLOCK = 64
# an int4 ragged row reads the keys it sees padded to a multiple of this (lean_forward.key_width_groups);
# any size keeps a row's call its own: smaller pads less, larger lets more rows of a chain share a call
ROW_KEY_BLOCK = 16
assert KEY_BLOCK % ROW_KEY_BLOCK == 0  # a row's padded read never passes the buffer's columns


def whole_blocks(columns: int, block: int = KEY_BLOCK) -> int:
    """`columns` rounded up to whole blocks of `block` columns (at least one)."""
    return max(1, -(-columns // block)) * block


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose appends write into spare buffer columns instead of copying the cache.

    `reserve`: columns its first buffer holds at least: a prompt fed in chunks then lands in one
    buffer instead of growing through ever larger ones, whose freed predecessors fragment the heap
    (a verify holding 4 × 2,000-token prompts peaked ~150 MiB above its KV without it)."""

    def __init__(self, reserve: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reserve = reserve

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))  # [B, H, capacity, D]
        self._value_buffer = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key_states/value_states [B, H, n, D]; returns the whole cache as views [B, H, length + n, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if whole_blocks(length + new) > self._key_buffer.shape[-2]:
            self._grow(length, length + new, key_states, value_states)
        self._key_buffer[..., length : length + new, :] = key_states
        self._value_buffer[..., length : length + new, :] = value_states
        self._narrow(length + new)
        return self.keys, self.values

    @torch.inference_mode()  # the buffers are inference tensors (made in a forward): written in place only in this mode
    def keep_rows(self, first: int, rows: Sequence[int]) -> None:
        """Keep columns [0, first) and then columns `rows` (ascending, each ≥ first), in that order; drop
        every other column: a tree's kept path after the committed positions."""
        moved = [(first + index, row) for index, row in enumerate(rows) if row != first + index]
        if moved:
            target = torch.tensor([to for to, _ in moved], device=self._key_buffer.device)
            source = torch.tensor([row for _, row in moved], device=self._key_buffer.device)
            self._key_buffer[:, :, target] = self._key_buffer[:, :, source]  # the right side is gathered first
            self._value_buffer[:, :, target] = self._value_buffer[:, :, source]
        self._narrow(first + len(rows))

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers with room for `needed` columns and more, holding the first `length` columns."""
        capacity = max(needed + needed // 4 + SPARE_COLUMNS, self.reserve)
        # zeros: a padded row reads columns past the length, masked, and their exact-zero share must not be NaN
        keys = key_states.new_zeros((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_zeros((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def _narrow(self, length: int) -> None:
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]


def growing_cache(config, reserve: int = 0) -> DynamicCache:
    """A DynamicCache for `config`'s model whose full-attention layers are GrowingLayers (other kinds,
    e.g. sliding-window layers, stay as transformers makes them), each with room for `reserve`
    positions at its first append."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.inference_mode()
def copied(cache: DynamicCache, config) -> DynamicCache:
    """A growing cache holding a copy of every layer's keys and values of `cache` (timing passes
    over many sessions start from one prefilled prompt instead of prefilling it once each)."""
    copy = growing_cache(config)
    copy_into(cache, copy)  # an append copies into the new cache's own buffers
    return copy


def keep_rows(cache: DynamicCache, first: int, rows: Sequence[int]) -> None:
    """GrowingLayer.keep_rows on every layer (a gather for any other kind of layer)."""
    keep = None
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.keep_rows(first, rows)
            continue
        if keep is None:
            keep = torch.tensor(list(range(first)) + list(rows), dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(2, keep)  # [B, H, first + len(rows), D]
        layer.values = layer.values.index_select(2, keep)


@torch.inference_mode()
def copy_into(source: DynamicCache, target: DynamicCache) -> None:
    """Append every layer's keys and values of `source` to the empty `target` (a growing cache or a store slot)."""
    for index, layer in enumerate(source.layers):
        target.update(layer.keys, layer.values, index)
