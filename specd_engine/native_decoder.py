"""The decoder layers of a flat int4 pass in one native call a pass (native/decoder.c).

Why: the flat pass's products and attention are specd's kernels, but each of its 30 layers also ran ~30
framework operators around them (two RMSNorms, the rotation, casts, SiLU, the residual adds) and the
Python that calls them: a third of a pass on a 2-vCPU Xeon (4.6 of 13.9 ms for one row, 10.1 of 31.3 ms
for 8 sessions × 4 rows; in-process, the verify's runtime, 2026-12-04). Here one call runs every layer:
loops over rows between direct calls of the int4 products (int4_tiles), the prompt tiles and attention
over the store (store_attention), with no operator, tensor or Python frame between them. It is what a
replayed CUDA graph is on a GPU: the host does almost nothing per layer.

Exact by construction as the framework's pass is: every step computes a row alone in a fixed order, so a
row's bits depend on nothing that shares its pass. They are not the framework pass's bits (its RMSNorm
sums in another order, its SiLU has another exp), so a process keeps one of the two for every pass, as it
keeps one instruction set: the decoder serves every flat pass where `unavailable` says it can, and where
prompt rows take a dense weight (quantized.PROMPT_KERNELS) the framework's pass serves them all.
SPECD_DECODER=framework keeps the framework's pass, to compare.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

import torch

from specd_engine import int4_tiles, lean_forward, native, store_attention
from specd_engine.quantized import PRODUCTS, Int4Linear

CHOICES = ("native", "framework")  # SPECD_DECODER: native = one call a pass where it runs

_choice = os.environ.get("SPECD_DECODER", "native")


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + [(name, native.Int4Weight) for name in PRODUCTS] + \
               [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p)]


class _Decoder(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                  "store_slots", "capacity", "bf16_store")] + \
               [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("layer", ctypes.POINTER(_Layer))]


def use(choice: str) -> None:
    """Whether flat passes built from now on run their layers natively (where they can) or by the framework."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"SPECD_DECODER must be one of {', '.join(CHOICES)}, not {choice!r}")
    _choice = choice


def unavailable(lean, store) -> str:
    """Why the native decoder cannot run `lean`'s passes over `store` ("" where it can)."""
    if _choice != "native":
        return f"SPECD_DECODER={_choice}"
    if int4_tiles.unavailable():
        return f"no int4 tiles: {int4_tiles.unavailable()}"
    layer = lean.layers[0]
    products = [getattr(each, name) for each in lean.layers for name in PRODUCTS]
    if not all(isinstance(product, Int4Linear) and product.tiles for product in products):
        return "a product that is not a tile-packed int4 one"
    if lean.embed.weight.dtype != torch.float32 or any(each.input_norm.dtype != torch.float32 for each in lean.layers):
        return "a model that is not float32 (the residual stream it keeps)"
    if layer.head_dim % 2 or layer.intermediate % 32 or layer.qkv.in_features % 32:
        return f"hidden {layer.qkv.in_features}, intermediate {layer.intermediate}, head_dim {layer.head_dim} (needs % 32, % 32, even)"
    return store_attention.unavailable(layer, store.keys[0].device, store.keys[0].dtype)


def _kernel():
    pointer, number = ctypes.c_void_p, ctypes.c_int
    return native.entry("specd_decoder_pass", [ctypes.POINTER(_Decoder), pointer, number] + [pointer] * 5 +
                        [number, pointer, pointer, number, number, number, number, number, pointer, number, pointer, number])


class NativeDecoder:
    """`lean`'s decoder layers over `store` as one native call a pass: the weights' and the store's
    addresses are read once here (neither moves while serving: the store is allocated up front)."""

    def __init__(self, lean, store):
        why = unavailable(lean, store)
        if why:
            raise ValueError(f"the native decoder cannot run here: {why}")
        first = lean.layers[0]
        self.lean, self.store = lean, store
        self._layers = (_Layer * len(lean.layers))(*(
            _Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                   *(native.Int4Weight.of(getattr(layer, name)) for name in PRODUCTS),
                   store.keys[index].data_ptr(), store.values[index].data_ptr())
            for index, layer in enumerate(lean.layers)))
        self._model = _Decoder(len(lean.layers), first.qkv.in_features, first.heads, first.kv_heads, first.head_dim,
                               first.intermediate, store.slots, store.capacity, store.keys[0].dtype == torch.bfloat16,
                               lean.eps, first.scaling, self._layers)

    def forward(self, ids: torch.Tensor, rows, keep_hidden: bool = False, capture: Sequence[int] = (),
                prompt: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """flat_pass.forward_flat's pass (the rows' keys and values written into the store; the final hidden
        state [R, C] after the final norm, and with keep_hidden the captured layers' outputs [R, L, C]) in one
        native call. `prompt`: the rows that are prompt positions, ascending (int32 [P]): they take the prompt
        tiles in products where the model has them, and bfloat16 dot products in attention where
        store_attention.prompt_dots()."""
        lean = self.lean
        x = lean.embed(ids).contiguous()  # [R, C], updated in place
        cos, sin = (part[:, 0].contiguous() for part in lean_forward.rotary_rows(lean.rotary, x, rows.positions))  # [R, D] each
        layers = sorted(index for index in capture if 0 < index <= len(lean.layers)) if keep_hidden else []
        captured = torch.empty((x.shape[0], len(layers), x.shape[1])) if layers else None  # [R, L, C]
        wanted = torch.tensor(layers, dtype=torch.int32) if layers else None
        compact = None if rows.compact is None else rows.compact.contiguous()
        tiles = bool(prompt is not None and len(prompt) and lean.layers[0].qkv.prompt_tiles)
        dots = bool(prompt is not None and len(prompt) and self.store.keys[0].dtype == torch.bfloat16 and store_attention.prompt_dots())
        failed = _kernel()(ctypes.byref(self._model), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
                           rows.slots.data_ptr(), rows.seen.data_ptr(), None if compact is None else compact.data_ptr(),
                           0 if compact is None else compact.shape[1], rows.writes.data_ptr(),
                           prompt.data_ptr() if tiles or dots else None, len(prompt) if tiles or dots else 0, tiles, dots,
                           int4_tiles.code(), store_attention.tiles(), None if wanted is None else wanted.data_ptr(), len(layers),
                           None if captured is None else captured.data_ptr(), torch.get_num_threads())
        if failed:
            raise ValueError(f"the native decoder refused rows of slots {rows.slots.tolist()} seeing {rows.seen.tolist()} of "
                             f"{self.store.slots} slots × {self.store.capacity} columns")
        return lean_forward.rms_norm(x, lean.norm, lean.eps), captured


def prompt_row_numbers(prompt) -> Optional[torch.Tensor]:
    """lean_forward.PromptRows' prompt rows as the ascending int32 row numbers the native call reads (None: none)."""
    if prompt is None:
        return None
    rows = prompt.prompt
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, dtype=torch.int32)
    return rows.to(torch.int32).contiguous()
