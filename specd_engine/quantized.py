"""4-bit weights for the target's linear layers on a CPU (`--weights int4` on the verify).

Why: a float32 pass of the default target streams 540 MB of weights, and on a 2-core CPU that is
most of a pass (~40 ms; llama.cpp reads the same model's Q4_1 file, ~85 MB, in ~10 ms:
docs/design/cpu-vs-llama-cpp.md). PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the
one gpt-fast and torchao use) reads 4-bit weights in groups of 32 along the input with a bfloat16
scale and zero each, and takes bfloat16 activations. The decoder's products over 1 / 4 / 8 rows
took 5.2 / 7.7 / 13.7 ms against 39 / 49 / 44 ms in float32 on that CPU.

The LM head (a Q8_0 embedding in the default GGUF) goes to 8 bits a weight with a scale per
vocabulary row (`_weight_int8pack_mm`): 3.2 ms a row against 10.5 in float32 there.

What it changes: the served model. Weights are rounded to 4 bits a group (a Q4_1 GGUF's weights,
which are already 4-bit groups of 32, come back as they were: each block's min and max are among
its values), the LM head's to 8 bits, and each product's input and output to bfloat16 (the logits
too, as bfloat16 GPU serving has them); the residual stream, norms and attention stay float32.
Greedy output equals this verify's own target-only decoding, not transformers' float32. That
needs every position's logits to be the same however passes are cut: both kernels compute each
row on its own; every row attends as one query over the keys it sees padded to a width of its own
(lean_forward.key_width_groups), the same call in a pass and a prompt chunk of any size (a start-up
probe checks that batching queries changes no bits, else a row a call); every pass runs on one thread count
(autotune.one_thread_count: SDPA splits long key ranges by threads). docs/design/cpu-vs-llama-cpp.md.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

log = logging.getLogger(__name__)

GROUP = 32  # weights a scale and zero cover, along the input (a GGUF Q4_1 block)
LEVELS = 15  # 4 bits: q in 0..15
ROWS_MULTIPLE = 16  # the kernel packs output rows in sixteens


def unsupported(weight: torch.Tensor) -> str:
    """Why a [out, in] weight cannot be packed ("" when it can)."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (the int4 kernel here is the CPU one)"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no CPU int4 kernel"
    out_features, in_features = weight.shape
    if in_features % GROUP or out_features % ROWS_MULTIPLE:
        return f"a [{out_features}, {in_features}] weight (needs in % {GROUP} == 0 and out % {ROWS_MULTIPLE} == 0)"
    return ""


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float → (q [N, K] int32 in 0..15, scale [N, K/G], zero [N, K/G]) with
    weight ≈ (q - 8) · scale + zero per group of G inputs: the group's min maps to 0 and its max
    to 15, so a group that already holds 16 evenly spaced levels (a Q4_1 block) is kept as it is."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)  # [N, K/G, G]
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)  # [N, K/G, 1]
    scale = (high - low) / LEVELS
    step = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every q is 0
    q = torch.round((groups - low) / step).clamp(0, LEVELS).to(torch.int32)  # [N, K/G, G]
    return q.reshape(n, k), scale[..., 0], (low + (LEVELS + 1) // 2 * scale)[..., 0]


class Int4Linear(torch.nn.Module):
    """y = x Wᵀ (no bias) with W in 4-bit groups (quantize_groups): [..., in] float → [..., out] in x's dtype."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        reason = unsupported(weight)
        if reason:
            raise ValueError(f"cannot pack {reason}")
        self.out_features, self.in_features = weight.shape
        q, scale, zero = quantize_groups(weight.detach())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # [N, K/2] uint8
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # [K/G, N, 2]: the kernel's layout
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)  # [M, out]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by, in float32 (tests and error reports)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).float().t()


class Int8Linear(torch.nn.Module):
    """y = x Wᵀ (no bias) with W in 8 bits and one scale per output row, bfloat16 inputs (the LM head:
    a Q8_0 embedding in the default GGUF, which 4 bits would coarsen): [..., in] → [..., out] in x's dtype."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if weight.device.type != "cpu" or self.in_features % GROUP or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            raise ValueError(f"cannot pack a [{self.out_features}, {self.in_features}] {weight.device.type} weight in 8 bits "
                             f"(needs the CPU and in % {GROUP} == 0)")
        rows = weight.detach().float()
        scale = rows.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [N]
        self.register_buffer("weight8", torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight8, self.scales)  # [M, out]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


PRODUCTS = ("qkv", "o", "gate_up", "down")  # a LeanLayer's linear products


def quantize_layers(layers: Sequence[torch.nn.Module]) -> int:
    """Replace each lean decoder layer's products (PRODUCTS) by Int4Linear where their shapes allow,
    then drop the float32 weights (transformers' forward cannot run after). Returns how many were
    packed; the others keep their float32 weights (a log line says which and why)."""
    packed = 0
    for index, layer in enumerate(layers):
        kept = []
        for name in PRODUCTS:
            reason = unsupported(getattr(layer, name).weight)
            if reason:
                log.warning("layer %d's %s stays float32: %s", index, name, reason)
                kept.append(name)
                continue
            setattr(layer, name, Int4Linear(getattr(layer, name).weight))
            packed += 1
        if not kept:  # o and down are transformers' own modules: released only when neither serves
            layer.release_originals()
    return packed
