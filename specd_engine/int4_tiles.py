"""specd's own int4 product on CPUs: every row of a pass through one weight tile at once.

Why: PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) computes each row on its own, so its
cost grows with the rows of a pass: over the default target's 30 layers of distinct weights on a
2-vCPU Xeon, 7.1 ms for one row, 14.4 for eight, 87.5 for 64. `native/int4_tiles.c` unpacks each
16 × 32 weight tile once and multiplies it by every row: in Intel AMX's tile unit (7.4, 7.9 and
20.6 ms there), or, on a CPU with AVX-512 BF16 and no AMX (AMD Zen 4 and later), by VDPBF16PS with
each row's input pair broadcast, eight rows a weight register. The 8-bit LM head takes the same path
(`product8`; PyTorch's `_weight_int8pack_mm` 1.1 ms for one row and 13.9 for 32, the AMX tiles 1.0
and 3.3). A row's arithmetic is the same whatever rows share the call, at any row count and thread
count, so a position's logits stay its own in any pass and prompt rows need no dense copy of the
weights (docs/design/engine-room.md, "specd's own int4 product").

A prompt chunk's hundreds of rows are where that kernel's per-row work (each group's scale applied to
each row's sum) dominates: on AMX, `prompt_product` dequantizes a block's weights to bfloat16 once for
all of them and sums all of K in the tile unit (~2.3x cheaper at 512 rows on a 2-vCPU Xeon), with bits
of its own; quantized.choose_prompt_kernel measures whether prompt rows take it.

The C file is compiled with specd's other native kernels (native.py); OpenMP binds to the runtime
torch already loaded, so its threads are torch's. The instruction set is the best the CPU runs (ISAS, in order); where it
runs neither or there is no compiler, Int4Linear keeps PyTorch's kernel: `unavailable()` says why.
`use("torch")` (the verify's --int4-kernel) picks PyTorch's kernel anyway, for comparisons.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Optional

import torch

from specd_engine import native

log = logging.getLogger(__name__)

# instruction set → what its code executes, as /proc/cpuinfo names it; the first this CPU runs serves
ISAS = {"amx": native.TILE_FLAGS, "avx512-vnni": ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"),
        "avx512-bf16": ("avx512f", "avx512bw", "avx512_bf16")}
ENTRY_POINTS = {"amx": ("specd_int4_mm", "specd_int8_mm"), "avx512-vnni": ("specd_int4_mm_vnni", "specd_int8_mm_avx512"),
                "avx512-bf16": ("specd_int4_mm_avx512", "specd_int8_mm_avx512")}
CODES = {"amx": 0, "avx512-bf16": 1, "avx512-vnni": 2}  # what the native calls take (native/tiles.h, int4_kernel_for)
PROMPT_ENTRY_POINTS = {"amx": "specd_int4_prompt_mm"}  # prompt_product: where the tile unit sums all of K
KERNELS = ("auto", "tiles", "torch")  # --int4-kernel: auto = tiles where this machine runs them
TILE_OUT, TILE_IN = 16, 32  # a weight tile: outputs × inputs (one 4-bit group)

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_reason: Optional[str] = None  # why the tiles cannot serve here ("" once they can)
_runnable: list[str] = []  # the instruction sets this process runs, best first (ISAS' order)
_isa: Optional[str] = None  # the one products take
_choice = os.environ.get("SPECD_INT4_KERNEL", "auto")
_isa_asked = os.environ.get("SPECD_INT4_ISA", "")  # an instruction set of ISAS instead of the best this CPU runs (to compare)


def use(kernel: str) -> None:
    """Which int4 kernel products packed from now on take: auto (tiles where available), tiles (an error
    where unavailable) or torch."""
    global _choice
    if kernel not in KERNELS:
        raise ValueError(f"--int4-kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
    if kernel == "tiles" and unavailable():
        raise ValueError(f"--int4-kernel tiles: {unavailable()}")
    _choice = kernel


def chosen() -> bool:
    """Whether a product packed now takes the tiles."""
    return _choice != "torch" and not unavailable()


def identity() -> str:
    """The tiles' build and instruction set, for keys of cached timings (an edit of the source changes it)."""
    return f"{native.identity()}-{instruction_set()}"


def unavailable() -> str:
    """Why this process cannot run the tile kernel ("" when it can); decided once."""
    _load()
    return _reason or ""


def instruction_set() -> str:
    """The instruction set the tile products run on here (ISAS), or "" where they cannot run."""
    _load()
    return _isa or ""


def code() -> int:
    """The instruction set products take, as the native decoder's and heads' calls name it (CODES)."""
    return CODES[instruction_set()]


def input_precision() -> str:
    """What the 4-bit products round their inputs to here: 8-bit groups on AVX-512 VNNI, else bfloat16."""
    return "8-bit" if instruction_set() == "avx512-vnni" else "bfloat16"


def runnable_instruction_sets() -> list[str]:
    """Every instruction set of ISAS this process runs, best first (tests compare them)."""
    _load()
    return list(_runnable)


def use_instruction_set(isa: str) -> str:
    """Products from now on run on `isa` (one of runnable_instruction_sets()); returns the one before."""
    global _isa
    if isa not in runnable_instruction_sets():
        raise ValueError(f"this process cannot run the int4 tiles on {isa!r} (runs: {', '.join(_runnable) or 'none'})")
    before, _isa = _isa, isa
    return before


@contextlib.contextmanager
def instruction_set_as(isa: Optional[str]):
    """Products inside the block run on `isa` (use_instruction_set), the one before after it; None: as they are."""
    before = use_instruction_set(isa) if isa else None
    try:
        yield
    finally:
        if before:
            use_instruction_set(before)


def _load() -> None:
    global _library, _reason, _isa
    with _lock:
        if _reason is not None:
            return
        _library, _reason = _loaded_library()
        if _isa_asked and _isa_asked not in _runnable:
            raise ValueError(f"SPECD_INT4_ISA={_isa_asked}: this process runs {', '.join(_runnable) or 'none of ISAS'}")
        _isa = _isa_asked or (_runnable[0] if _runnable else None)
        if _reason:
            log.info("int4 products: PyTorch's kernel (%s)", _reason)


def _loaded_library() -> tuple[Optional[ctypes.CDLL], str]:
    runs = {isa: not native.missing_cpu_flags(flags) for isa, flags in ISAS.items()}
    if not any(runs.values()):
        return None, f"this CPU lacks {', '.join(native.missing_cpu_flags(ISAS['avx512-bf16']))} (and AMX)"
    library, why = native.load()
    if library is None:
        return None, why
    runs["amx"] = runs["amx"] and native.tile_unit()  # where the OS withholds the tile state, AVX-512 BF16 still runs
    for isa, (int4_mm, int8_mm) in ENTRY_POINTS.items():
        getattr(library, int4_mm).restype = getattr(library, int8_mm).restype = None
        getattr(library, int4_mm).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        getattr(library, int8_mm).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    for prompt_mm in PROMPT_ENTRY_POINTS.values():
        getattr(library, prompt_mm).restype = None
        getattr(library, prompt_mm).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
    _runnable[:] = [isa for isa, ok in runs.items() if ok]
    if not _runnable:
        return None, "the kernel refused this process the AMX tile state, and the CPU lacks AVX-512 BF16"
    return library, ""


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 with scale, zero [N, K/32] (quantized.quantize_groups) → the kernel's layout
    (native/int4_tiles.c): nibbles [N·K/2] uint8 by tiles, scale and zero [N/16, K/32, 16] bfloat16."""
    n, k = q.shape
    blocks, groups = n // TILE_OUT, k // TILE_IN
    # input 32g + 8c + 2j + p of output 16b + o → word 2o + p of chunk c, nibble j
    levels = q.to(torch.int32).view(blocks, TILE_OUT, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4).reshape(blocks, groups, 4, 32, 4)
    words = levels[..., 0] | levels[..., 1] << 4 | levels[..., 2] << 8 | levels[..., 3] << 12  # [B, G, 4, 32]
    nibbles = words.to(torch.int16).contiguous().view(torch.uint8).reshape(-1)  # little-endian words

    def by_tile(values: torch.Tensor) -> torch.Tensor:  # [N, K/32] → [N/16, K/32, 16]
        return values.to(torch.bfloat16).view(blocks, TILE_OUT, groups).permute(0, 2, 1).contiguous()

    return nibbles, by_tile(scale), by_tile(zero)


def unpack(nibbles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse for the levels: nibbles → q [N, K] uint8."""
    words = nibbles.view(torch.int16).to(torch.int32).view(n // TILE_OUT, k // TILE_IN, 4, 32) & 0xFFFF
    levels = torch.stack([(words >> shift) & 15 for shift in (0, 4, 8, 12)], dim=-1)  # [B, G, 4, 32, 4]
    return levels.view(n // TILE_OUT, k // TILE_IN, 4, TILE_OUT, 2, 4).permute(0, 3, 1, 2, 5, 4).reshape(n, k).to(torch.uint8)


def pack8(q: torch.Tensor) -> torch.Tensor:
    """8-bit weights q [N, K] int8 → the kernel's layout (specd_int8_mm): [N·K] int8, by tiles of 16 outputs
    × 32 inputs in the tile unit's pair order."""
    n, k = q.shape
    return q.view(n // TILE_OUT, TILE_OUT, k // TILE_IN, TILE_IN // 2, 2).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def product8(x: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] → [M, N] through 8-bit weights (pack8) with a float32 scale [N] an output; float32 or
    bfloat16 as x (rounded to bfloat16 either way)."""
    return _multiply(getattr(_library, ENTRY_POINTS[_isa][1]), x, (weights, scale), out_features)


def product(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] → [M, N] through the packed weight (pack), on torch's thread count: float32 or bfloat16 as x,
    rounded to bfloat16 either way (float32 rows are rounded to bfloat16 first, as the cast before PyTorch's
    kernel rounds them: the casts around a product cost a pass's ~180 operators otherwise)."""
    return _multiply(getattr(_library, ENTRY_POINTS[_isa][0]), x, (nibbles, scale, zero), out_features)


def prompt_kernel() -> bool:
    """Whether prompt_product runs here: on the instruction set products take now (PROMPT_ENTRY_POINTS)."""
    return instruction_set() in PROMPT_ENTRY_POINTS


def prompt_product(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int) -> torch.Tensor:
    """Prompt rows x [P, K] → [P, N] through the packed weight (pack) dequantized to bfloat16, as
    quantized.Int4Linear.dequantized() gives it, with all of K summed in the tile unit: a block's weights
    are unpacked once for a chunk's hundreds of rows, and no row pays the 4-bit groups' per-group adds
    (native/int4_tiles.c, specd_int4_prompt_mm). Rounding as product's; a row's bits are its own at any
    row count, but they are not product's. Where prompt_kernel()."""
    return _multiply(getattr(_library, PROMPT_ENTRY_POINTS[_isa]), x, (nibbles, scale, zero), out_features)


def _multiply(kernel, x: torch.Tensor, weight: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """kernel(x, *weight, out, M, K, N, threads, floats) for rows x [M, K]: contiguous float32 (rounded to
    bfloat16 in the kernel, as torch's cast rounds) or else bfloat16; out [M, N] in that dtype."""
    rows = x if x.dtype == torch.float32 else x.to(torch.bfloat16)
    rows = rows.contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=rows.dtype)
    if rows.shape[0]:
        kernel(rows.data_ptr(), *(tensor.data_ptr() for tensor in weight), out.data_ptr(), rows.shape[0], rows.shape[1],
               out_features, torch.get_num_threads(), rows.dtype == torch.float32)
    return out
