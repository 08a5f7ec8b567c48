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

On a CPU with Intel AMX or AVX-512 BF16 the products take specd's own kernel instead (int4_tiles.py):
the same groups, unpacked once a tile for every row of a pass, so rows cost a fraction of PyTorch's
per-row work and prompt rows need no dense copy. Each row's bits are its own there too.

Prompt rows (a prefill's positions but the prompt's last) may take the same weights dequantized to
bfloat16, where the start-up measurement finds a block of PROMPT_BLOCK rows cheaper that way
(choose_prompt_kernel): with the tile kernel on AMX, by int4_tiles.prompt_product (PROMPT_TILES: the
4-bit weight dequantized a block at a time for every prompt row of the pass, all of K summed in the
tile unit, no second copy of the weights); with PyTorch's int4 kernel, which computes every row on its
own at ~1.8 ms a row for the default target here, by a GEMM over a dense copy in bfloat16 or float32
(PROMPT_KERNELS), every call PROMPT_BLOCK rows. Either way a prompt row has the same bits in any
chunk and beside any rows, and generated tokens are always scored in int4: speculation and
target-only decoding read the same prompt cache. docs/design/engine-room.md.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from specd_engine import int4_tiles
from specd_engine.kv_cache import whole_blocks

log = logging.getLogger(__name__)

GROUP = 32  # weights a scale and zero cover, along the input (a GGUF Q4_1 block)
LEVELS = 15  # 4 bits: q in 0..15
ROWS_MULTIPLE = 16  # the kernel packs output rows in sixteens
PROMPT_BLOCK = 64  # prompt rows a dense product takes at once (prompt_product): a fixed GEMM shape
PROMPT_KERNELS = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # dense weights prompt rows may take
PROMPT_MARGIN = 1.25  # a dense prompt product must beat int4 by this much: it keeps a second copy of the weights
PROMPT_TILES = "tiles"  # prompt rows by int4_tiles.prompt_product: the 4-bit weight dequantized in the kernel, no copy


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
    """y = x Wᵀ (no bias) with W in 4-bit groups (quantize_groups): [..., in] float → [..., out] in x's dtype.
    Prompt rows may take the same weight dequantized (use_dense, prompt_product)."""

    dense: Optional[torch.Tensor] = None  # [out, in]: the weight for prompt rows, where a GEMM is faster (None: int4)
    prompt_tiles = False  # prompt rows by int4_tiles.prompt_product (use_prompt_tiles)

    def __init__(self, weight: torch.Tensor, tiles: Optional[bool] = None):
        """tiles: multiply by specd's own tile kernel (int4_tiles) or PyTorch's; None: as int4_tiles.chosen()."""
        super().__init__()
        reason = unsupported(weight)
        if reason:
            raise ValueError(f"cannot pack {reason}")
        self.out_features, self.in_features = weight.shape
        self.tiles = int4_tiles.chosen() if tiles is None else tiles
        if self.tiles and int4_tiles.unavailable():
            raise ValueError(f"cannot use the int4 tiles: {int4_tiles.unavailable()}")
        q, scale, zero = quantize_groups(weight.detach())
        if self.tiles:
            nibbles, tile_scale, tile_zero = int4_tiles.pack(q, scale, zero)
            self.register_buffer("nibbles", nibbles)  # [N·K/2] uint8, by tiles
            self.register_buffer("tile_scale", tile_scale)  # [N/16, K/32, 16] bfloat16
            self.register_buffer("tile_zero", tile_zero)
            return
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # [N, K/2] uint8
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # [K/G, N, 2]: the kernel's layout
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] → [M, out] rounded to bfloat16: the tiles give it in x's dtype (float32 or bfloat16),
        PyTorch's kernel in bfloat16 (a caller that adds it to float32 rows needs no cast: the promotion is
        exact). Either kernel gives a row the same bits whatever rows share the call."""
        if self.tiles:
            return int4_tiles.product(x, self.nibbles, self.tile_scale, self.tile_zero, self.out_features)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)

    def use_dense(self, dtype: Optional[torch.dtype], slots: Optional[torch.Tensor] = None) -> None:
        """Keep this weight dequantized in `dtype` too, for prompt rows (prompt_product); None drops it.
        slots: weight_slots of this shape, when the caller already read them."""
        self.prompt_tiles = False
        self.dense = None if dtype is None else prompt_weight(self.dequantized(dtype, slots))  # [out, in]

    def use_prompt_tiles(self, on: bool) -> None:
        """Prompt rows through int4_tiles.prompt_product from now on (on), or not; drops a dense weight."""
        if on and not (self.tiles and int4_tiles.prompt_kernel()):
            raise ValueError("the prompt tiles need a tile-packed product on AMX (int4_tiles.prompt_kernel)")
        self.prompt_tiles, self.dense = on, None

    @property
    def separate_prompt_rows(self) -> bool:
        """Whether prompt rows take their own product here (prompt_product), not int4's."""
        return self.prompt_tiles or self.dense is not None

    def prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, in] (prompt rows) → [P, out] in x's dtype, rounded to bfloat16 like the int4 kernel's
        output: by the tile kernel dequantizing the 4-bit weight (use_prompt_tiles: any row count, a row's
        bits its own), or by the dense weight (use_dense) in blocks of exactly PROMPT_BLOCK rows (the last
        padded with zeros): a GEMM's row may round differently with the row count, so every call has the
        same count and a row's bits are its own in any chunk. Where 4 bits a weight make the CPU kernel compute-bound
        (~1.8 ms a row for the default target's 30 layers here), a GEMM over many rows is several times cheaper."""
        if self.prompt_tiles:
            return int4_tiles.prompt_product(x, self.nibbles, self.tile_scale, self.tile_zero, self.out_features)
        return dense_product(x, self.dense)

    def dequantized(self, dtype: torch.dtype = torch.float32, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The weight [out, in] this layer holds: (q - 8) · scale + zero per group, rounded to bfloat16, in
        `dtype` (slots: as unpack_levels). PyTorch's kernel multiplies by exactly these (a test checks its
        product by the identity, which took ~4 s for the default target's 210 products at every start); the
        tile kernel by the same groups unrounded (int4_tiles)."""
        n, k = self.out_features, self.in_features
        if self.tiles:
            q = int4_tiles.unpack(self.nibbles, n, k).view(n, k // GROUP, GROUP)
            scale_zero = torch.stack([self.tile_scale, self.tile_zero], dim=-1).float().permute(0, 2, 1, 3).reshape(n, k // GROUP, 2)
        else:
            q = unpack_levels(self.packed, n, k, slots).view(n, k // GROUP, GROUP)
            scale_zero = self.scales_zeros.float().transpose(0, 1)  # [N, K/G, 2]
        weight = (q.float() - (LEVELS + 1) // 2) * scale_zero[..., :1] + scale_zero[..., 1:]  # [N, K/G, G]
        return weight.to(torch.bfloat16).to(dtype).view(n, k)


def weight_slots(out_features: int, in_features: int) -> torch.Tensor:
    """Where each weight of a packed [N, K] weight lies: [N·K] (row-major) indexes into nibbles(packed).
    The CPU packing interleaves rows and inputs in blocks that depend on the instruction set torch was
    built for, so the order is read from the packing itself: each probe packs 4 bits of every weight's
    own index, and a slot's digits spell the index it holds. Up to ~0.2 ms a thousand weights: a pass
    over many products reads them once a shape (slots_by_shape) and drops them after."""
    count = out_features * in_features
    index = torch.arange(count)
    held = torch.zeros(count, dtype=torch.int64)  # slot → the weight it holds
    for shift in range(0, max(count - 1, 1).bit_length(), 4):
        digits = ((index >> shift) & LEVELS).to(torch.int32).reshape(out_features, in_features)
        held |= nibbles(torch.ops.aten._convert_weight_to_int4pack_for_cpu(digits, 1)).to(torch.int64) << shift
    slots = torch.empty_like(held)
    slots[held] = index
    return slots


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [...] → their 4-bit halves [2·numel] uint8, low nibble first."""
    return torch.stack([packed & LEVELS, packed >> 4], dim=-1).reshape(-1)


def unpack_levels(packed: torch.Tensor, out_features: int, in_features: int,
                  slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """_convert_weight_to_int4pack_for_cpu's inverse: packed [N, K/2] uint8 → q [N, K] uint8 in 0..15
    (slots: weight_slots of this shape, read here when not given)."""
    slots = weight_slots(out_features, in_features) if slots is None else slots
    return torch.index_select(nibbles(packed), 0, slots).view(out_features, in_features)


def slots_by_shape(products: Sequence[Int4Linear]) -> dict[tuple[int, int], torch.Tensor]:
    """weight_slots of every shape among `products`, for one pass over all of them: the tables are
    start-up work (~27 MiB of indexes for the default target), freed with the caller's dict."""
    return {shape: weight_slots(*shape) for shape in {(product.out_features, product.in_features) for product in products}}


def dense_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [P, in] · weight [out, in]ᵀ in blocks of PROMPT_BLOCK rows (Int4Linear.prompt_product) → [P, out];
    weight as prompt_weight made it (oneDNN's prepacked layout, or plain)."""
    count = x.shape[0]
    padded = F.pad(x.to(weight.dtype), (0, 0, 0, whole_blocks(count, PROMPT_BLOCK) - count))  # [P', in]: zero rows after
    blocks = [_dense_block(padded[start : start + PROMPT_BLOCK], weight) for start in range(0, padded.shape[0], PROMPT_BLOCK)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:count].to(torch.bfloat16).to(x.dtype)


def _dense_block(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One block of PROMPT_BLOCK rows [B, in] through a prompt weight → [B, out]."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
    return F.linear(rows, weight)


def prompt_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense prompt weight [out, in] as the GEMM reads it fastest: in bfloat16 on a CPU whose oneDNN
    runs bfloat16, reordered once into oneDNN's blocked layout for PROMPT_BLOCK rows, else as it is.
    F.linear reorders the weight on every call: the default target's 120 products of a 64-row block
    took 50 ms against 28–35 prepacked, with the same bits (2-vCPU Xeon with AMX, 2026-11-29)."""
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.ops.mkldnn._reorder_linear_weight(weight, PROMPT_BLOCK)
    return weight


def int4_products(layers: Sequence[torch.nn.Module]) -> list[Int4Linear]:
    """The lean layers' products that are packed in 4 bits."""
    return [getattr(layer, name) for layer in layers for name in PRODUCTS if isinstance(getattr(layer, name, None), Int4Linear)]


def products_kernel(layers: Sequence[torch.nn.Module]) -> str:
    """Which kernel the layers' int4 products take, for keys of cached timings: the tiles' build, "torch",
    or "" where none is int4."""
    products = int4_products(layers)
    if not products:
        return ""
    return int4_tiles.identity() if products[0].tiles else "torch"


def prompt_rows_alike(linear: Int4Linear) -> bool:
    """Whether a prompt row's dense product is the same bits alone, first in a block and at another offset
    beside other rows (a start-up probe: the GEMM is called at one shape, but its rows are trusted only
    once checked)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((PROMPT_BLOCK + 5, linear.in_features), generator=generator)
    alone = linear.prompt_product(x[:1])
    moved = torch.cat([x[1:38], x[:1], x[38:]])  # row 0 at offset 37
    return torch.equal(linear.prompt_product(x)[:1], alone) and torch.equal(linear.prompt_product(moved)[37:38], alone)


def choose_prompt_kernel(layers: Sequence[torch.nn.Module], threads: int, measure) -> Optional[str]:
    """Which dense weight prompt rows take (PROMPT_KERNELS), or None for int4 alone: a block of PROMPT_BLOCK
    rows through every product in each, timed interleaved (`measure`: autotune.Measure, cached by a service)
    at `threads`; the fastest must beat int4 by PROMPT_MARGIN and pass prompt_rows_alike. The chosen
    weights stay in place. On a CPU with bfloat16 matrix units (AMX) a bfloat16 GEMM takes a row for a
    fraction of int4's cost; on one without, int4 usually stays."""
    products = int4_products(layers)
    if not products:
        return None
    if products[0].tiles:
        return _choose_prompt_tiles(layers, products, threads, measure)

    slots: dict = {}  # slots_by_shape, read once for the timing and the weights kept, if either needs them

    def runs() -> dict:
        if not slots:
            slots.update(slots_by_shape(products))
        inputs = {product.in_features: torch.randn(PROMPT_BLOCK, product.in_features) for product in products}
        made = {(threads, "int4"): lambda: [product(inputs[product.in_features]) for product in products]}
        for name, dtype in PROMPT_KERNELS.items():
            weights = [prompt_weight(product.dequantized(dtype, slots[product.out_features, product.in_features])) for product in products]
            made[(threads, name)] = lambda weights=weights: [dense_product(inputs[w.shape[1]], w) for w in weights]
        return made

    timed = measure("prompt product", runs, 3)
    if not timed:
        return None
    seconds = {kernel: value for (_, kernel), value in timed.items()}
    best = min(PROMPT_KERNELS, key=lambda kernel: seconds[kernel])
    log.info("prompt rows' products, a block of %d rows: %s", PROMPT_BLOCK,
             ", ".join(f"{kernel} {value * 1e3:.1f} ms" for kernel, value in seconds.items()))
    if seconds["int4"] < PROMPT_MARGIN * seconds[best]:
        return None
    return _adopt_where_alike(layers, products, best, slots)


def _choose_prompt_tiles(layers: Sequence[torch.nn.Module], products: list[Int4Linear], threads: int, measure) -> Optional[str]:
    """With the tile kernel: PROMPT_TILES where it runs here and a block of PROMPT_BLOCK prompt rows through
    every product is cheaper by it than by the tile kernel's own products (no margin: it keeps no copy of the
    weights), timed interleaved; else None. The int4 tiles take a few rows for little more than one, but a
    prompt chunk's rows each pay the 4-bit groups' adds there."""
    if not int4_tiles.prompt_kernel():
        return None

    def runs() -> dict:
        inputs = {product.in_features: torch.randn(PROMPT_BLOCK, product.in_features) for product in products}
        return {(threads, "int4"): lambda: [product.rows(inputs[product.in_features]) for product in products],
                (threads, PROMPT_TILES): lambda: [int4_tiles.prompt_product(inputs[product.in_features], product.nibbles, product.tile_scale,
                                                                            product.tile_zero, product.out_features) for product in products]}

    timed = measure("prompt product", runs, 3)
    if not timed:
        return None
    seconds = {kernel: value for (_, kernel), value in timed.items()}
    log.info("prompt rows' products, a block of %d rows: %s", PROMPT_BLOCK,
             ", ".join(f"{kernel} {value * 1e3:.1f} ms" for kernel, value in seconds.items()))
    if seconds["int4"] <= seconds[PROMPT_TILES]:
        return None
    return _adopt_where_alike(layers, products, PROMPT_TILES)


def _adopt_where_alike(layers: Sequence[torch.nn.Module], products: list[Int4Linear], kernel: str,
                       slots: Optional[dict[tuple[int, int], torch.Tensor]] = None) -> Optional[str]:
    """Prompt rows through `kernel` from now on, unless a row's bits there depend on its neighbours
    (prompt_rows_alike): then int4 stays, and the log says why."""
    use_prompt_kernel(layers, kernel, slots)
    if not prompt_rows_alike(products[0]):
        log.warning("prompt rows through %s here round a row by its neighbours: they stay in int4", kernel)
        return use_prompt_kernel(layers, None)
    return kernel


def use_prompt_kernel(layers: Sequence[torch.nn.Module], kernel: Optional[str],
                      slots: Optional[dict[tuple[int, int], torch.Tensor]] = None) -> Optional[str]:
    """Give every int4 product the dense weight of `kernel` (PROMPT_KERNELS) for prompt rows, or the prompt
    tiles (PROMPT_TILES: tile-packed products only), or neither (None). slots: slots_by_shape of these
    products, when the caller already read them."""
    products = int4_products(layers)
    if kernel is None or kernel == PROMPT_TILES:
        for product in products:
            product.use_prompt_tiles(kernel == PROMPT_TILES)
        return kernel
    slots = slots or slots_by_shape(products)
    for product in products:
        product.use_dense(PROMPT_KERNELS[kernel], slots[product.out_features, product.in_features])
    return kernel


class Int8Linear(torch.nn.Module):
    """y = x Wᵀ (no bias) with W in 8 bits and one scale per output row, bfloat16 inputs (the LM head:
    a Q8_0 embedding in the default GGUF, which 4 bits would coarsen): [..., in] → [..., out] in x's dtype."""

    def __init__(self, weight: torch.Tensor, tiles: Optional[bool] = None):
        """tiles: multiply by specd's tile kernel (int4_tiles.product8; needs out % 16 == 0) or PyTorch's;
        None: as int4_tiles.chosen() where the shape allows."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if weight.device.type != "cpu" or self.in_features % GROUP or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            raise ValueError(f"cannot pack a [{self.out_features}, {self.in_features}] {weight.device.type} weight in 8 bits "
                             f"(needs the CPU and in % {GROUP} == 0)")
        self.tiles = int4_tiles.chosen() and self.out_features % ROWS_MULTIPLE == 0 if tiles is None else tiles
        if self.tiles and (int4_tiles.unavailable() or self.out_features % ROWS_MULTIPLE):
            raise ValueError(f"cannot use the int4 tiles: {int4_tiles.unavailable() or f'{self.out_features} outputs (needs out % {ROWS_MULTIPLE} == 0)'}")
        rows = weight.detach().float().contiguous()  # a transposed view (the Medusa heads' columns) packs as rows
        scale = rows.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [N]
        levels = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("scales", scale.to(torch.bfloat16))
        if self.tiles:
            self.register_buffer("weight8_tiles", int4_tiles.pack8(levels))  # [N·K] int8, by tiles
            self.register_buffer("tile_scales", self.scales.float())  # [N]: the kernel reads float32
        else:
            self.register_buffer("weight8", levels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if self.tiles:  # rounds float32 rows to bfloat16 itself
            y = int4_tiles.product8(rows, self.weight8_tiles, self.tile_scales, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight8, self.scales)  # [M, out]
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
    log.info("int4 products: %d, multiplied by %s", packed,
             f"specd's tiles on {int4_tiles.instruction_set()} (int4_tiles)" if int4_tiles.chosen() else f"PyTorch's kernel ({int4_tiles.unavailable() or 'asked for'})")
    return packed
