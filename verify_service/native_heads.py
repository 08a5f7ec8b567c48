"""The Medusa heads' proposals in one native call (specd_engine/native/heads.c), their products in 4 bits.

Why: asking for proposals is what a speculating round pays beyond its verified positions, and on a CPU
it was a large share of a cheap pass: 2.27 ms for the default heads' three beside a 6.4 ms one-row pass,
1.19 ms for one head (served, 2-vCPU Xeon, 2026-12-04). A quarter of that was the ~40 framework
operators a head runs between its products, the rest the products' bytes. Here every head runs in one
call with no operator between its products: its residual blocks in 8 bits as the framework serves them,
its product over the heads' vocabulary (most of a proposal's bytes) in 4-bit groups (the target's int4
kernel; ~40% fewer bytes than 8 bits), each head's best columns by those scores rescored in float32
(RESCORED), as the framework's reduced precisions are. The verify measures it against the
framework's proposal for each row count at start-up (MedusaHeads.tune_product) and uses the faster.

Its proposals are not bit for bit the framework's (4-bit weights, another exp): a proposal is a draft
the target judges, so a different one costs acceptance at most, never exactness; the tests bound how
often they differ. A row's proposals are its own at any row count, as the framework's are.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from specd_engine import int4_tiles, native
from specd_engine.quantized import GROUP, ROWS_MULTIPLE, Int4Linear, Int8Linear

RESCORED = 8  # a head's best columns by its 4-bit scores, rescored in float32 (4 sufficed on 65 held-out rows; 8 for margin)


class _Block(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("inputs", ctypes.c_int)]


class _Heads(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("heads", "layers", "hidden", "draft_vocab", "chained", "rescored")] + \
               [("block", ctypes.POINTER(_Block)), ("product", native.Int4Weight), ("rows", ctypes.c_void_p),
                ("embedding", ctypes.c_void_p), ("vocab_ids", ctypes.c_void_p)]


def unavailable(heads) -> str:
    """Why `heads` (MedusaHeads) cannot propose natively here ("" where they can)."""
    if int4_tiles.unavailable():
        return f"no int4 tiles: {int4_tiles.unavailable()}"
    config = heads.config
    if heads.head_columns.device.type != "cpu":
        return f"heads on {heads.head_columns.device.type}"
    if config.hidden_size % GROUP or config.draft_vocab_size % ROWS_MULTIPLE:
        return f"hidden {config.hidden_size}, draft vocabulary {config.draft_vocab_size} (needs % {GROUP}, % {ROWS_MULTIPLE})"
    return ""


def _kernel():
    pointer, number = ctypes.c_void_p, ctypes.c_int
    return native.entry("specd_heads_propose", [ctypes.POINTER(_Heads), pointer, pointer] + [number] * 5 + [pointer, pointer])


def tiled_block(heads, index: int, layer: int) -> Int8Linear:
    """Head index's block `layer` in 8 bits on specd's tiles: the framework's packing (MedusaHeads.packed_blocks)
    where it already holds one, else packed the same way."""
    packed = heads.packed_blocks.get((index, layer))
    return packed if packed is not None and packed.tiles else Int8Linear(heads.heads[index][layer].linear.weight.detach().float(), tiles=True)


class NativeHeads:
    """`heads`' blocks (8 bits) and product (4 bits) packed once, and their proposals in one call (module docstring)."""

    def __init__(self, heads):
        why = unavailable(heads)
        if why:
            raise ValueError(f"the Medusa heads cannot propose natively here: {why}")
        config = heads.config
        self.heads = heads
        self.blocks = [[tiled_block(heads, index, layer) for layer in range(config.num_layers)] for index in range(config.num_heads)]
        self.biases = [[block.linear.bias.detach().float().contiguous() for block in head] for head in heads.heads]
        self.product = Int4Linear(heads.head_columns.T, tiles=True)  # [V', H] rows
        self.rows = heads.rescoring if heads.rescoring is not None else heads.head_columns.T.contiguous()  # [V', H] float32, shared
        self.embedding = heads.embedding.contiguous() if config.next_token_input else torch.zeros(1, config.hidden_size)
        self.vocab_ids = heads.vocab_ids.contiguous()
        self._blocks = (_Block * (len(self.blocks) * config.num_layers))(*(
            _Block(packed.weight8_tiles.data_ptr(), packed.tile_scales.data_ptr(), bias.data_ptr(), packed.in_features)
            for packed_head, bias_head in zip(self.blocks, self.biases) for packed, bias in zip(packed_head, bias_head)))
        self._model = _Heads(len(self.blocks), config.num_layers, config.hidden_size, config.draft_vocab_size,
                             config.chained_input, RESCORED, self._blocks, native.Int4Weight.of(self.product), self.rows.data_ptr(),
                             self.embedding.data_ptr(), self.vocab_ids.data_ptr())

    def ranked(self, features: torch.Tensor, next_tokens: Optional[torch.Tensor], candidates: int,
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MedusaHeads.ranked's answer for rows features [N, H] (already fused) whose next tokens are
        next_tokens [N]: token ids and confidences [N, depth, candidates] from the first `depth` heads."""
        features = features.float().contiguous()
        rows = features.shape[0]
        tokens = torch.zeros(rows, dtype=torch.long) if next_tokens is None else next_tokens.long().contiguous()
        ids = torch.empty((rows, depth, candidates), dtype=torch.long)
        probs = torch.empty((rows, depth, candidates))
        failed = _kernel()(ctypes.byref(self._model), features.data_ptr(), tokens.data_ptr(), rows, depth, candidates,
                           int4_tiles.code(), torch.get_num_threads(), ids.data_ptr(), probs.data_ptr())
        if failed:
            raise ValueError(f"the native Medusa heads refused {rows} row(s) × {candidates} candidates of a "
                             f"{self.heads.config.draft_vocab_size}-token vocabulary, or ran out of memory")
        return ids, probs
