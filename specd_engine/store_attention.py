"""Attention over the KV store in place by specd's own kernel (native/attention.c): every row of a flat
pass in one call a layer, each row over exactly the keys it sees.

Why: on a CPU, PyTorch's SDPA serves a flat pass either a call a session (~90 µs for the default
target's 3 key heads over ~500 keys on a 2-vCPU AMD EPYC: 65% of an 8-session decoding pass) or
folded, rows padded to shared key widths, where its rounding depends on the query rows and keys of the
call (flat_pass.probe_folding). The kernel reads a row's keys where its slot holds them (a tree's node:
its compacted columns), in a fixed order, so a row's bits are its own alone, in a chain, as a tree's
node, beside any sessions and on any thread count, with no padding and no probe. It serves where the
CPU runs AVX-512 (the 16-lane code) and the store is float32 or bfloat16 (STORE_DTYPES); elsewhere the
flat pass keeps SDPA.

Where the CPU has Intel AMX, a bfloat16 store's scores and value sums come from the tile unit
(native/attention.c, tile_scores and tile_values): each query and each softmax weight split exactly into
three bfloat16 parts, so the results are float32's to float32 rounding, up to 16 queries a tile instead
of a key and a query a 16-lane sum. Its rounding is fixed too, but differs from the 16-lane code's, so a
process keeps one kernel (`tiles()`; SPECD_ATTENTION_KERNEL=lanes, or `use("lanes")`, for the 16-lane
code everywhere, to compare).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from specd_engine import native

CPU_FLAGS = ("avx512f",)  # what the compiled code executes, as /proc/cpuinfo names it
MAX_GROUP = 16  # query heads a key head the kernel takes (native/attention.c)
STORE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads keys and values as (queries are float32)

KERNELS = ("auto", "lanes")  # SPECD_ATTENTION_KERNEL: auto = the tile unit where the CPU has AMX
PROMPT_KERNELS = ("dots", "lanes")  # SPECD_PROMPT_ATTENTION: dots = prompt rows by bfloat16 dot products where they run
DOT_FLAGS = ("avx512_bf16", "avx512bw")  # what dots_run executes (VDPBF16PS, VPERMW)

_function = None  # specd_attend_rows, once loaded
_choice = os.environ.get("SPECD_ATTENTION_KERNEL", "auto")
_prompt_choice = os.environ.get("SPECD_PROMPT_ATTENTION", "dots")


def use(kernel: str) -> None:
    """Which code a bfloat16 store's attention takes from now on: auto (the tile unit where this CPU has
    AMX) or lanes (the 16-lane code everywhere)."""
    global _choice
    if kernel not in KERNELS:
        raise ValueError(f"the attention kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
    _choice = kernel


def tiles() -> bool:
    """Whether a bfloat16 store's scores and value sums come from the tile unit in this process."""
    return _choice == "auto" and native.tile_unit()


def use_for_prompts(kernel: str) -> None:
    """Which code prompt rows over a bfloat16 store take from now on: dots (bfloat16 dot products where the CPU
    has AVX-512 BF16 and attention does not take the tile unit) or lanes (the code generated rows take)."""
    global _prompt_choice
    if kernel not in PROMPT_KERNELS:
        raise ValueError(f"the prompt attention kernel must be one of {', '.join(PROMPT_KERNELS)}, not {kernel!r}")
    _prompt_choice = kernel


def prompt_dots() -> bool:
    """Whether prompt rows over a bfloat16 store take bfloat16 dot products in this process (native/attention.c,
    dots_run): their queries and softmax weights rounded to bfloat16, every sum in float32, a row's bits its own."""
    return _prompt_choice == "dots" and not tiles() and not native.missing_cpu_flags(DOT_FLAGS)


def identity() -> str:
    """The kernel's build and its code (tiles or lanes, and prompt dots), for keys of cached timings."""
    return f"{native.identity()}-{'tiles' if tiles() else 'lanes'}{'-dots' if prompt_dots() else ''}"


def unavailable(layer, device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernel cannot attend a store of `dtype` on `device` for this layer's shape ("" when it can)."""
    if device.type != "cpu" or dtype not in STORE_DTYPES:
        return f"a {dtype} store on {device.type} (the kernel reads float32 or bfloat16 on a CPU)"
    group = layer.heads // layer.kv_heads
    if layer.head_dim % 16 or group > MAX_GROUP or layer.heads % layer.kv_heads:
        return f"{layer.heads} query heads over {layer.kv_heads} key heads of {layer.head_dim} (needs D % 16 == 0, ≤ {MAX_GROUP} a key head)"
    missing = native.missing_cpu_flags(CPU_FLAGS)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return native.load()[1]


def _kernel():
    """specd_attend_rows from the native library, its argument types declared once."""
    global _function
    if _function is None:
        function = native.load()[0].specd_attend_rows
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 6 + [ctypes.c_float] + \
            [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4
        _function = function
    return _function


def attend(layer, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, slots: torch.Tensor, seen: torch.Tensor,
           columns: Optional[torch.Tensor], new: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
           prompt: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [R, Hq, D] float32 over the store's keys and values [S, Hkv, capacity, D] (STORE_DTYPES): row r over the first
    seen[r] (int32) columns of slot slots[r] (int64), or over columns[r, :seen[r]] (int64 [R, K]) where a
    tree's node reads compacted keys → [R, Hq, D]. With `new` = (k, v [R, Hkv, D] float32, writes [R] int64),
    the rows' keys and values are first written into column writes[r] of their slots, rounded as
    `.to(keys.dtype)` rounds them: one call a layer instead of four ops. `prompt` (bool [R]): the rows that are
    prompt positions, which take bfloat16 dot products where prompt_dots() (the native decoder's prompt rows do).
    Call unavailable() first."""
    if keys.dtype != values.dtype or keys.dtype not in STORE_DTYPES:
        raise ValueError(f"store attention reads keys and values of one of {STORE_DTYPES}, not {keys.dtype} and {values.dtype}")
    q = q.contiguous()
    out = torch.empty_like(q)
    if columns is not None:
        columns = columns.contiguous()
    k = v = writes = None
    if new is not None:
        k, v, writes = (part.contiguous() for part in new)
        if k.dtype != torch.float32 or v.dtype != torch.float32 or k.shape != v.shape or k.shape[0] != q.shape[0]:
            raise ValueError(f"new keys and values must be float32 [R, Hkv, D], got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    flags = prompt.to(torch.uint8).contiguous() if prompt is not None and prompt_dots() else None  # [R]
    failed = _kernel()(q.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(), seen.data_ptr(),
                       None if columns is None else columns.data_ptr(), 0 if columns is None else columns.shape[1],
                       out.data_ptr(), q.shape[0], layer.heads, layer.kv_heads, keys.shape[0], keys.shape[2], layer.head_dim,
                       layer.scaling, keys.dtype == torch.bfloat16, torch.get_num_threads(), tiles(),
                       None if k is None else k.data_ptr(), None if v is None else v.data_ptr(),
                       None if writes is None else writes.data_ptr(), None if flags is None else flags.data_ptr())
    if failed:
        raise ValueError(f"store attention refused rows of slots {slots.tolist()} seeing {seen.tolist()} of "
                         f"{keys.shape[0]} slots × {keys.shape[2]} columns")
    return out
