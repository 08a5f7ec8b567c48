"""A lean forward pass for Llama-architecture models: transformers' math, fewer tensor operations.

Why: the default target (SmolLM2-135M, 30 decoder layers) streams 540 MB of float32 weights a pass,
~20 ms at the ~27 GB/s a 2-core Intel Xeon VM reads; transformers' LlamaForCausalLM took 32 ms there
for one position, the rest spent between the matrix products: ~45 small operations a layer (an
RMSNorm of five, three projections where one fused one does, mask and rotary set-up per pass,
module and hook plumbing). This forward runs each layer over the pass's rows [T, C] as an RMSNorm,
one fused q/k/v product, one rotation of q and k together (four operations), the cache append,
SDPA, the output product, an RMSNorm, one fused gate/up product and the down product. Measured there (`scripts/lean_forward_bench.py`,
docs/benchmarks/lean_forward_s40b.json: 200 positions cached, each forward in its own process, the
faster weight layout of each), a pass over 1 / 2 / 4 / 8 positions took 27.8 / 29.3 / 36.9 / 49.2 ms
against transformers' 31.9 / 34.5 / 44.6 / 55.5: 11–17% less.

Same math, same order: the fused products compute every output from the same row of weights as
the separate ones, rotary uses transformers' own embedding module, attention the same SDPA call
with the same scale; on the default target the logits came out bit-identical to transformers' (48
greedy tokens of three prompts, the same report). CausalLM still checks a probe at start-up
(`disagreement`, lm.lean_forward_for) and keeps transformers' forward where they differ.

Supported: LlamaForCausalLM-shaped models (model_type llama; no attention or MLP bias; SiLU MLP;
full attention in every layer). `unsupported(model)` says why another is not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specd_engine import int4_tiles, kv_cache, quantized
from specd_engine.quantized import Int4Linear

log = logging.getLogger(__name__)


def unsupported(model: torch.nn.Module) -> str:
    """Why `model` cannot run the lean forward ("" when it can)."""
    config = model.config
    if getattr(config, "model_type", "") != "llama":
        return f"model_type {getattr(config, 'model_type', '?')!r} is not llama"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "projections with biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(config, "layer_types", None) and any(kind != "full_attention" for kind in config.layer_types):
        return "layers that are not full attention"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        return "not a LlamaForCausalLM layout (model.model.layers, model.lm_head)"
    return ""


class LeanLayer(torch.nn.Module):
    """One decoder layer's weights for the lean pass: q/k/v and gate/up fused, o and down shared
    with transformers' layer (the same tensors, no copy)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused([attention.q_proj, attention.k_proj, attention.v_proj])  # [(Hq + 2 Hkv) D, C]
        self.o = attention.o_proj
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])  # [2 I, C]
        self.down = mlp.down_proj
        self.input_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        # transformers' own linears (plain attributes, not submodules): release_originals drops their weights
        self._originals = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
                           mlp.down_proj)
        self.heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.intermediate = mlp.gate_proj.out_features
        self.query_block = self.heads // self.kv_heads  # a row's queries a key head in row_attention (padded where a probe says)

    def release_originals(self) -> None:
        """Drop transformers' references to this layer's linear weights (its forward cannot run after):
        where the lean pass keeps only a copied layout (rows, prepacked), they would hold a second,
        unused copy of every weight."""
        for linear in self._originals:
            linear.weight = None


def _fused(linears: Sequence[torch.nn.Linear]) -> torch.nn.Linear:
    """One bias-free Linear whose output is the given linears' outputs side by side; the originals'
    weights become views of its weight, so the model holds each weight once."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum out, in]
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)  # no init of a weight replaced at once
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    start = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)  # a view: no second copy
        start += rows
    return fused


class LeanLlama(torch.nn.Module):
    """The lean forward over a loaded Llama model (shares its weights; see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.layers = torch.nn.ModuleList(LeanLayer(layer) for layer in base.layers)
        self.norm = base.norm.weight
        self.lm_head = model.lm_head
        self.eps = model.config.rms_norm_eps
        self.query_per_call = False  # padded segments: one SDPA call a row, where batching queries changes bits

    def release_originals(self) -> None:
        """LeanLayer.release_originals for every layer: transformers' forward cannot run after."""
        for layer in self.layers:
            layer.release_originals()

    @torch.inference_mode()
    @torch.inference_mode()
    def forward_ragged(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: Sequence[Segment],
                       keep_hidden: bool = False, capture: Sequence[int] = (),
                       prompt: Optional[PromptRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One pass over several sessions' new tokens concatenated (input_ids, position_ids [T]): every
        linear layer streams its weights once for all T rows; attention runs per session over its own
        cache, in place (no gather into a padded batch, no scatter back). Returns the final hidden state
        [T, C] (after the final norm; the caller takes the LM head of the rows it needs) and, when
        keep_hidden and layers are captured, their outputs [T, L, C]. `prompt`: the rows that are prompt
        positions, whose products may take a dense weight (product)."""
        x = self.embed(input_ids)  # [T, C]
        cos, sin = rotary_rows(self.rotary, x, position_ids)  # [T, 1, D] each
        masks = [key_width_groups(s, input_ids.device, self.query_per_call) if s.padded else
                 attention_mask_for(None if s.mask is None else s.mask[None, None], s.n, s.cache.get_seq_length(), input_ids.device)
                 for s in segments]  # padded: key_width_groups; else None (causal) or bool [1, 1, n, cached + n]; once a pass
        captured = []
        for index, layer in enumerate(self.layers):
            x = self._layer(layer, x, cos, sin, lambda q, k, v: _attend_each(layer, index, q, k, v, segments, masks), prompt)
            if index + 1 in capture and keep_hidden:
                captured.append(x)
        hidden = rms_norm(x, self.norm, self.eps)  # [T, C]
        return hidden, torch.stack(captured, dim=1) if captured else None

    def _layer(self, layer: LeanLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
               prompt: Optional[PromptRows] = None) -> torch.Tensor:
        """A pass's rows x [T, C] through one decoder layer; attend(q [T, Hq, D], k and v [T, Hkv, D])
        appends k and v to the cache(s) and returns the attention output [T, Hq, D]. Rows, not [B, n]
        batches: every tensor a layer makes is a plain 2-D or 3-D one, without the views, transposes
        and casts of the batched layout (with rms_norm's steps, 170 aten operators a layer of an int4
        decoding pass against 189: test_lean_forward's budget). `prompt`: the rows whose products may
        take a dense weight."""
        rows = x.shape[0]
        heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
        qkv = product(layer.qkv, rms_norm(x, layer.input_norm, self.eps), prompt).to(x.dtype)  # [T, (Hq + 2 Hkv) D]
        qk = rotate(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), cos, sin)  # [T, Hq + Hkv, D]: one rotation for both
        attended = attend(qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))  # [T, Hq, D]
        x = x + product(layer.o, attended.reshape(rows, heads * dim), prompt)  # (a bfloat16 product is promoted exactly)
        gate, up = product(layer.gate_up, rms_norm(x, layer.post_norm, self.eps), prompt).to(x.dtype).split(layer.intermediate, dim=-1)  # [T, I] each
        return x + product(layer.down, F.silu(gate) * up, prompt)


def rotary_rows(rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of rows at `positions` [T] (x [T, C] gives the dtype and device): cos and
    signed_sin [T, 1, D], broadcast over a row's heads (rotate)."""
    cos, sin = rotary(x[None], positions[None])  # [1, T, D] each
    return cos[0].unsqueeze(1), signed_sin(sin[0]).unsqueeze(1)


@dataclass(frozen=True)
class PromptRows:
    """The rows of a ragged pass that are prompt positions, and the others (None: there are none)."""

    prompt: torch.Tensor | slice  # [P] long, or a slice where they are consecutive (row_index)
    other: Optional[torch.Tensor | slice]  # [T - P] long or a slice


def row_index(rows: Sequence[int], device: Optional[torch.device] = None) -> torch.Tensor | slice:
    """Rows (ascending, distinct) as an index: a slice where they are consecutive (a view), else a long
    tensor (a gather). A pass's rounds come before its prompt chunks, so its prompt rows and other rows
    are usually consecutive, and products then need not gather and scatter them (4 rounds beside a
    64-row prompt chunk: 106 ms a pass against 119 on a 2-vCPU Xeon, engine-room.md)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)


def product(linear: torch.nn.Module, h: torch.Tensor, prompt: Optional[PromptRows]) -> torch.Tensor:
    """linear(h) for rows h [T, C] → [T, out]: an int4 product in the kernel's bfloat16 (the caller's add
    or cast makes it h's dtype exactly, one operator fewer), with the prompt rows through the linear's
    own prompt product where it has one (quantized.Int4Linear.prompt_product: where a block of prompt
    rows costs less so than by the int4 kernel). A row's product depends only on whether it is a prompt
    position, never on what shares its pass: both kernels compute each row on its own."""
    if prompt is None or not getattr(linear, "separate_prompt_rows", False):
        return linear.rows(h) if isinstance(linear, Int4Linear) else linear(h)
    if prompt.other is None:
        return linear.prompt_product(h)
    out = h.new_empty((h.shape[0], linear.out_features))  # [T, out]
    out[prompt.prompt] = linear.prompt_product(h[prompt.prompt])
    out[prompt.other] = linear.rows(h[prompt.other]).to(h.dtype)
    return out


@dataclass
class Segment:
    """One session's part of a ragged pass: `n` new positions at [start, start + n) of the pass's
    concatenated tokens, attending to its own cache (appended to in place) and to each other by
    `mask` (bool [n, cached + n], True = may attend: a tree) or causally (None)."""

    cache: DynamicCache
    start: int
    n: int
    mask: Optional[torch.Tensor] = None
    padded: bool = False  # each row one query over its own keys padded to whole key blocks (_sdpa_padded)
    prompt_rows: int = 0  # padded: the first rows are prompt positions, attended in whole tiles (prompt_tiles)


def _attend_each(layer: LeanLayer, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 segments: Sequence[Segment], masks: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """Attention of a ragged pass: q [T, Hq, D], k and v [T, Hkv, D]; each segment's keys and values go
    to its own cache and its queries attend to that cache alone. Returns [T, Hq, D]. The layouts a
    segment reads are views made once for the pass's rows and its outputs are joined once: the
    operators a session adds to a layer are its cache append and its attention call (at 8 and 32
    sessions each per-session operator is 240 and 960 a pass)."""
    new_keys, new_values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, T, D] views
    outs = []
    for segment, mask in zip(segments, masks):
        rows = slice(segment.start, segment.start + segment.n)
        cache_layer = segment.cache.layers[index]
        keys, values = cache_layer.update(new_keys[:, :, rows], new_values[:, :, rows])  # [1, Hkv, cached + n, D]
        if segment.padded:
            outs.append(_sdpa_padded(layer, q[rows], cache_layer, mask))  # [n, Hq, D]
        else:
            outs.append(_sdpa(layer, q[rows].transpose(0, 1)[None], keys, values, mask)[0].transpose(0, 1))  # [n, Hq, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _sdpa(layer: LeanLayer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """transformers' attention call: q [B, Hq, n, D] over keys/values [B, Hkv, m, D] → [B, Hq, n, D]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling,
                                          is_causal=mask is None and q.shape[2] > 1, enable_gqa=layer.heads != layer.kv_heads)


def tree_compaction(cached: int, mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows that see the `cached` committed columns and, among the new ones, those `mask` allows
    (bool [r, cached + n]: some of a tree's pending tokens and nodes), the columns each reads in decoding
    order (committed, its ancestors', its own; then column 0, masked) [r, width], and which of those it
    sees (a prefix) [r, width]. A masked column between visible ones would move the later keys' vector
    lanes and change the row's bits, so a tree's node reads its keys compacted."""
    rows = mask.shape[0]
    columns = torch.zeros((rows, width), dtype=torch.long)
    visible = torch.zeros((rows, width), dtype=torch.bool)
    for row in range(rows):
        seen = torch.cat([torch.arange(cached), cached + mask[row, cached:].nonzero()[:, 0]])
        columns[row, : len(seen)] = seen
        visible[row, : len(seen)] = True
    return columns, visible


@dataclass
class KeyWidthGroup:
    """A segment's rows that read the same number of key columns (_sdpa_padded): one SDPA call, each row
    its own query (a batch entry), or (tile) the rows as one block of queries."""

    rows: slice | torch.Tensor  # which of the segment's rows: consecutive ones (a view), else [g] long
    mask: torch.Tensor  # float [g, 1, 1, K], a tile's [1, 1, g, K]: additive_mask of the columns each sees (a prefix); K whole blocks
    columns: Optional[torch.Tensor]  # [g, K] long: a tree's compacted columns; None: the cache's first K
    tile: bool = False  # a prompt tile (prompt_tiles): the rows are one query block


PROMPT_TILE = 16  # prompt positions [16 i, 16 i + 16) attend in one call, always together (prompt_tiles)


def prompt_tiles(cached: int, rows: int, device: Optional[torch.device] = None) -> list[KeyWidthGroup]:
    """The groups of a prefill chunk's first `rows` rows, prompt positions from `cached` on: tiles of the
    positions [PROMPT_TILE·i, PROMPT_TILE·(i + 1)) (the last one cut where the prompt rows end), each one
    SDPA call with the tile's rows as a block of queries over the keys up to its end, padded to whole
    key blocks, causally masked. A row then reads the keys once for the tile instead of once for
    itself: a 64-row chunk at ~1,000 cached positions took ~1.7–1.8 ms a layer in tiles against 11.4 ms
    a row at a time (2-vCPU Xeon, in-process, 2026-11-28). A block's rows may round by each other, so
    a tile is always the same call: chunks are cut at tile boundaries (CausalLM.prefill_feed), and a
    tile's rows and keys are the prompt's alone, whatever shares the pass or how the prompt was cut."""
    if cached % PROMPT_TILE:
        raise ValueError(f"a prefill chunk's prompt rows start at position {cached}, inside a tile of {PROMPT_TILE}: "
                         "chunks must be cut at tile boundaries (CausalLM.prefill_feed)")
    made = []
    for first in range(0, rows, PROMPT_TILE):
        last = min(first + PROMPT_TILE, rows)
        seen = torch.arange(cached + first + 1, cached + last + 1)  # [r]: a row sees the keys up to its own
        width = kv_cache.whole_blocks(int(seen[-1]), kv_cache.ROW_KEY_BLOCK)
        mask = additive_mask(torch.arange(width)[None, :] < seen[:, None]).to(device)[None, None]  # [1, 1, r, K]
        made.append(KeyWidthGroup(slice(first, last), mask, None, tile=True))
    return made


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """bool [..., K] (True = may attend) as SDPA's additive float mask (0 there, -inf elsewhere), made once
    for every layer instead of converted by each layer's call."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def key_width_groups(segment: "Segment", device: Optional[torch.device] = None, alone: bool = False) -> list[KeyWidthGroup]:
    """A segment's rows grouped by the keys each reads: the ones it sees (the cache's first cached + i + 1,
    or a tree node's committed and ancestors' columns compacted), padded to whole blocks of
    kv_cache.ROW_KEY_BLOCK columns. The width is the row's own, never the pass's: a row reads the
    same K columns alone, in a chain of any length, as a tree's node and in a prompt chunk of any size,
    so its SDPA call is the same call with the same inputs, whatever kernel and BLAS the machine has (a
    width taken from the pass's longest row gave one row different bits in different passes on a 2-core
    AMD EPYC). `alone`: a group a row, for a machine whose SDPA rounds a query by the batch beside it
    (queries_batch_alike). Made once a pass, for every layer."""
    cached, n = segment.cache.get_seq_length(), segment.n
    tiles = prompt_tiles(cached, segment.prompt_rows, device) if segment.prompt_rows else []
    if segment.mask is None:
        seen = torch.arange(cached + 1, cached + n + 1)  # [n]
    else:
        seen = cached + segment.mask[:, cached:].sum(dim=1).cpu()  # [n]: committed, ancestors, own
    widths = [kv_cache.whole_blocks(count, kv_cache.ROW_KEY_BLOCK) for count in seen.tolist()]
    groups: dict[int, list[int]] = {}
    for row, width in enumerate(widths[segment.prompt_rows :], start=segment.prompt_rows):  # a chain's rows: one width, or two across a block boundary
        groups.setdefault(row if alone else width, []).append(row)
    made = tiles
    for rows in groups.values():
        width = widths[rows[0]]
        mask = additive_mask(torch.arange(width)[None, :] < seen[rows][:, None]).to(device)[:, None, None, :]  # [g, 1, 1, K]
        columns = None if segment.mask is None else tree_compaction(cached, segment.mask[rows].cpu(), width)[0].to(device)
        made.append(KeyWidthGroup(row_index(rows, device), mask, columns))
    return made


def queries_batch_alike(layer: LeanLayer, device: torch.device, widths: Sequence[int] = (64, 576, 2048),
                        batches: Sequence[int] = (3, 16)) -> bool:
    """Whether this machine's SDPA gives a row over padded keys (row_attention) the same bits in a batch
    of rows as alone, at every thread count up to the current one. The CPU kernel computes each (row,
    key head) on its own, so it should; a BLAS or kernel that splits work by the batch would make a
    row's logits depend on what shares its pass, so the start-up probe checks instead of trusting."""
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    try:
        for count in range(1, threads + 1):
            torch.set_num_threads(count)
            for width in widths:
                keys, values = (torch.randn((1, layer.kv_heads, width, layer.head_dim), generator=generator).to(device) for _ in range(2))
                queries = torch.randn((max(batches), layer.heads, layer.head_dim), generator=generator).to(device)
                mask = additive_mask(torch.arange(width, device=device) < width - 5)[None, None, None, :]  # [1, 1, 1, K]

                def attend(b: int) -> torch.Tensor:  # [b, Hq, D]
                    return row_attention(layer, queries[:b], keys.expand(b, -1, -1, -1), values.expand(b, -1, -1, -1), mask.expand(b, -1, -1, -1))
                alone = torch.cat([row_attention(layer, queries[b : b + 1], keys, values, mask) for b in range(max(batches))])
                if not all(torch.equal(attend(b), alone[:b]) for b in batches):
                    return False
    finally:
        torch.set_num_threads(threads)
    return True


def padded_query_block(group: int) -> int:
    """A row's `group` query heads of one key head padded with zero rows to a power of two of at least 4:
    a block of 3 rows (the default target's) is split unevenly across 2 threads by a 2-core AMD EPYC's
    SDPA and rounds by the rows batched beside it; blocks of 4 gave the same bits alone and in batches
    of 2–16 at 1 and 2 threads there (2026-12-01). A block of 2 rounded by its batch at one thread."""
    return max(4, 1 << (group - 1).bit_length())


def choose_query_block(layer: LeanLayer, device: torch.device) -> bool:
    """Set the layer's query_block to the first of (its query heads a key head as they are, padded_query_block)
    under which batching rows changes no bits (queries_batch_alike); False where neither does (the
    caller then gives each row its own call)."""
    group = layer.heads // layer.kv_heads
    for block in dict.fromkeys((group, padded_query_block(group))):
        layer.query_block = block
        if queries_batch_alike(layer, device):
            return True
    layer.query_block = group
    return False


def row_attention(layer: LeanLayer, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows' attention, each row its own batch entry: queries [g, Hq, D] over keys and values [g (or
    1), Hkv, K, D] with an additive mask [g, 1, 1, K] → [g, Hq, D]. A row's query heads that share a
    key head are that head's block of queries ([g, Hkv, Hq/Hkv, D]: grouped-query attention packed),
    so SDPA reads each key head once for them and multiplies a block instead of one query at a time:
    55.6 against 35.2 µs for a row over 200 keys, 146 against 64 for a chain's 4 rows (the default
    target's 9 query and 3 key heads, 2-vCPU Xeon, 2 threads). The block is padded with zero rows to
    layer.query_block where the start-up probe needs it (choose_query_block). The packing is the row's
    own, the same alone, in a chain, as a tree's node or beside other sessions, so a row's bits still are too."""
    count, kv_heads, group = queries.shape[0], layer.kv_heads, layer.heads // layer.kv_heads
    blocks = queries.view(count, kv_heads, group, layer.head_dim)  # [g, Hkv, Hq/Hkv, D]
    if layer.query_block > group:
        blocks = F.pad(blocks, (0, 0, 0, layer.query_block - group))  # [g, Hkv, block, D]: zero queries after
    keys, values = keys.to(queries.dtype), values.to(queries.dtype)  # a bfloat16 store's, widened (flat_pass.store_dtype)
    attended = F.scaled_dot_product_attention(blocks, keys, values, attn_mask=mask, scale=layer.scaling)
    if layer.query_block > group:
        attended = attended[:, :, :group]
    return attended.reshape(count, layer.heads, layer.head_dim)


def _sdpa_padded(layer: LeanLayer, q: torch.Tensor, cache_layer, groups: Sequence[KeyWidthGroup]) -> torch.Tensor:
    """A segment's rows (q [n, Hq, D]), each one query over its own keys padded to whole key blocks
    (key_width_groups; read from the growing buffer past the cache's length, zeros or earlier finite
    values, all masked; a tree's compacted): one SDPA call per group. Returns [n, Hq, D]."""
    out = None if len(groups) == 1 else torch.empty_like(q)
    gqa = layer.heads != layer.kv_heads
    for group in groups:
        count, width = group.mask.shape[0], group.mask.shape[-1]
        if group.tile:  # a prompt tile: its rows one block of queries over a view of the buffer
            attended = F.scaled_dot_product_attention(q[group.rows].transpose(0, 1)[None], cache_layer._key_buffer.narrow(2, 0, width),
                                                      cache_layer._value_buffer.narrow(2, 0, width), attn_mask=group.mask,
                                                      scale=layer.scaling, enable_gqa=gqa)[0].transpose(0, 1)  # [r, Hq, D]
        else:
            if group.columns is None:  # a view of the buffer, broadcast to every row: no copy
                keys, values = cache_layer._key_buffer.narrow(2, 0, width), cache_layer._value_buffer.narrow(2, 0, width)  # [1, Hkv, K, D]
                if count > 1:  # (a lone row's plain view: broadcasting costs a single query ~30% more in SDPA)
                    keys, values = keys.expand(count, -1, -1, -1), values.expand(count, -1, -1, -1)  # [g, Hkv, K, D]
            else:
                keys = cache_layer._key_buffer[0][:, group.columns].transpose(0, 1)  # [g, Hkv, K, D]
                values = cache_layer._value_buffer[0][:, group.columns].transpose(0, 1)
            attended = row_attention(layer, q if count == q.shape[0] else q[group.rows], keys, values, group.mask)  # [g, Hq, D]
        if out is None:
            return attended
        out[group.rows] = attended
    return out


def pack_int4(lean: LeanLlama, device: torch.device) -> None:
    """The lean layers' products in 4-bit groups and the LM head in 8 bits (quantized.py), in place; and
    where this machine's attention rounds a query by the queries batched beside it (a start-up probe,
    queries_batch_alike), each verify row gets its own attention call (exact, slower)."""
    packed, head = quantized.quantize_layers(lean.layers), "float32"
    try:
        lean.lm_head, head = quantized.Int8Linear(lean.lm_head.weight), "8 bits a weight"
    except ValueError as why:
        log.warning("the LM head stays float32: %s", why)
    log.info("weights: %d of %d decoder products in 4-bit groups (%s inputs), the LM head in %s, bfloat16 inputs", packed,
             len(quantized.PRODUCTS) * len(lean.layers), int4_tiles.input_precision(), head)
    if not choose_query_block(lean.layers[0], device):
        lean.query_per_call = True
        log.warning("this machine's attention rounds a query by the queries batched beside it: each row of a "
                    "verify pass gets its own attention call (exact, slower)")
    for layer in lean.layers:
        layer.query_block = lean.layers[0].query_block
    if lean.layers[0].query_block > lean.layers[0].heads // lean.layers[0].kv_heads:
        log.info("a row's attention pads its query heads to %d a key head: batched rows keep their bits", lean.layers[0].query_block)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of x [..., C], transformers' own steps (normalised in float32, cast back, then
    scaled). In float32 they are six calls (eight aten operators), in place where they can be:
    F.rms_norm's CPU composite runs ~20 operators (two copies of x among them) for the same bits, and
    a pass makes 61 of these calls."""
    if x.dtype == torch.float32:
        return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated: what `rotate` multiplies the half-swapped x by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, x·cos + rotate_half(x)·sin, in four operations:
    rotate_half(x) = (−x₂, x₁) and (x₂, x₁)·(−s₁, s₂) equals (−x₂·s₁, x₁·s₂) exactly (a sign flip is
    exact in floating point), so x·cos + roll(x, D/2)·signed_sin(sin) gives the same bits. x [B, h, n, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def attention_mask_for(mask: Optional[torch.Tensor], n: int, past: int, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """The bool mask [B, 1, n, past + n] SDPA gets (True = may attend), or None for plain causal
    attention (SDPA's is_causal when past = 0, nothing to mask for one position).

    mask: None; a bool [B, 1, n, past + n] (used as it is); or a padding mask [B, past + n] (nonzero =
    a real position), combined with causality among the n new positions."""
    if mask is not None and mask.dim() == 4:
        return mask.bool()
    causal = None
    if (n > 1 and past > 0) or mask is not None:
        causal = torch.ones((n, past + n), dtype=torch.bool, device=device).tril(past)  # [n, past + n], on the pass's device
    if mask is None:
        return None if causal is None else causal[None, None]
    return causal.to(mask.device)[None, None] & mask.bool()[:, None, None, :]  # [B, 1, n, past + n]


PROBE_PROMPT, PROBE_STEP = 8, 3  # tokens of the agreement probe: a prefill, then a verify-like pass


@torch.inference_mode()
def disagreement(lean: LeanLlama, model: torch.nn.Module, new_cache: Callable[[], DynamicCache]) -> str:
    """Where the lean forward and transformers' disagree on a probe (a short prompt, then a pass over
    a few more positions with the cache), "" where they agree: the same argmax at every position and
    logits within rounding (1e-4 of their scale in float32, 2e-2 in half precision)."""
    vocab = model.config.vocab_size
    ids = torch.arange(1, PROBE_PROMPT + PROBE_STEP + 1, device=model.device).remainder(vocab)[None]  # [1, n]
    ours, theirs = new_cache(), new_cache()
    for fed in (ids[:, :PROBE_PROMPT], ids[:, PROBE_PROMPT:]):
        past, n = ours.get_seq_length(), fed.shape[1]
        positions = torch.arange(past, past + n, device=fed.device)  # [n]
        mine = lean.lm_head(lean.forward_ragged(fed[0], positions, [Segment(ours, 0, n)])[0]).float()[None]  # [1, n, V]
        reference = model(input_ids=fed, past_key_values=theirs, use_cache=True).logits.float()  # [1, n, V]
        why = logits_disagree(mine, reference, next(model.parameters()).dtype)
        if why:
            return why
    return ""


def logits_disagree(mine: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> str:
    """Why two passes' logits [..., n, V] of the same positions disagree ("" when they agree): another
    argmax at some position, or a difference past rounding (1e-4 of their scale in float32, 2e-2 in
    half precision)."""
    relative = 1e-4 if dtype == torch.float32 else 2e-2
    tolerance = relative * max(1.0, reference.abs().max().item())
    difference = (mine - reference).abs().max().item()
    if difference > tolerance or not torch.equal(mine.argmax(-1), reference.argmax(-1)):
        return f"logits differ by {difference:.3g} (tolerance {tolerance:.3g}) over {mine.shape[-2]} positions"
    return ""
