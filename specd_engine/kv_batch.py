"""Packing several sessions' KV caches into one padded batch, and handing each its new keys/values back.

Only for transformers' forward (architectures the lean forward does not serve): the lean forward
runs several sessions as one ragged pass with attention in place in each cache (CausalLM.run_feeds).

Layout: the past is LEFT-padded and the new tokens RIGHT-padded, so every row's new tokens start at
the same cache column P (the longest past). One cache offset and one causal mask then serve the
whole batch; a 2D attention mask hides the padding and explicit position ids give each row its own
positions, so each row's logits equal what that session would get alone (up to float rounding).

    cache columns:  [ pad … pad | past_i (p_i) ][ new_i (n_i) | pad … pad ]
                    <-------- P = max p_i ------><-------- N = max n_i ---->

Only plain DynamicLayer caches are packed (full attention, no sliding window, no offloading);
`is_packable` says when a session must run on its own instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specd_engine.kv_cache import GrowingLayer


@dataclass
class PackedBatch:
    """Model inputs for one ragged batch, and what it takes to split the result again."""

    input_ids: torch.Tensor  # [B, N] long, right-padded
    attention_mask: torch.Tensor  # [B, P + N] long, 0 on padding
    position_ids: torch.Tensor  # [B, N] long, p_i + 0..N-1
    past: DynamicCache  # layers [B, H, P, D], left-padded
    past_length: int  # P
    new_lengths: list[int]  # [B] n_i


def is_packable(cache: DynamicCache) -> bool:
    """True when every layer is a plain growing full-attention layer holding one sequence."""
    if getattr(cache, "offloading", False):
        return False
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, GrowingLayer):
            return False
        if layer.is_initialized and layer.keys.numel() and layer.keys.shape[0] != 1:
            return False
    return True


def pack(caches: Sequence[DynamicCache], fed: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> PackedBatch:
    """One batch from each session's cache and the tokens it feeds this pass (at least one each)."""
    past_lengths = [cache.get_seq_length() for cache in caches]  # 0 before a session's first forward
    new_lengths = [len(tokens) for tokens in fed]
    past_length, new_max = max(past_lengths), max(new_lengths)
    input_ids = torch.full((len(fed), new_max), pad_id, dtype=torch.long)  # [B, N]
    attention_mask = torch.zeros((len(fed), past_length + new_max), dtype=torch.long)  # [B, P + N]
    for row, (tokens, p, n) in enumerate(zip(fed, past_lengths, new_lengths)):
        input_ids[row, :n] = torch.tensor(list(tokens), dtype=torch.long)
        attention_mask[row, past_length - p : past_length + n] = 1
    position_ids = torch.tensor(past_lengths, dtype=torch.long)[:, None] + torch.arange(new_max)[None, :]  # [B, N]
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        past=_pack_past(caches, past_lengths, past_length),
        past_length=past_length,
        new_lengths=new_lengths,
    )


def _pack_past(caches: Sequence[DynamicCache], past_lengths: Sequence[int], past_length: int) -> DynamicCache:
    """A DynamicCache whose layer l holds every session's layer l, left-padded with zeros to P columns."""
    if past_length == 0:
        return DynamicCache()
    template = next(cache for cache, p in zip(caches, past_lengths) if p > 0)
    packed = []
    for layer_index, shape_layer in enumerate(template.layers):
        batch_shape = (len(caches), shape_layer.keys.shape[1], past_length)
        keys = shape_layer.keys.new_zeros(batch_shape + shape_layer.keys.shape[-1:])  # [B, H, P, D]
        values = shape_layer.values.new_zeros(batch_shape + shape_layer.values.shape[-1:])  # [B, H, P, Dv]
        for row, (cache, p) in enumerate(zip(caches, past_lengths)):
            if p:
                layer = cache.layers[layer_index]
                keys[row, :, past_length - p :] = layer.keys[0]  # [H, p, D]
                values[row, :, past_length - p :] = layer.values[0]
        packed.append((keys, values))
    return DynamicCache(ddp_cache_data=packed)


def scatter_new(batch_cache: DynamicCache, batch: PackedBatch, caches: Sequence[DynamicCache]) -> None:
    """Append each row's new keys/values (columns P .. P + n_i of the batch cache) to its own cache."""
    start = batch.past_length
    for layer_index, batch_layer in enumerate(batch_cache.layers):
        for row, (cache, n) in enumerate(zip(caches, batch.new_lengths)):
            keys = batch_layer.keys[row : row + 1, :, start : start + n]  # [1, H, n_i, D]
            values = batch_layer.values[row : row + 1, :, start : start + n]
            cache.update(keys.contiguous(), values.contiguous(), layer_index)
