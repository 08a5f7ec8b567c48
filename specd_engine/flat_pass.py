"""One flat pass over every session's rows, over a KV store allocated up front.

Why (docs/design/engine-room.md): a pass of the ragged engine makes one attention call per session
and layer (per row and layer for an int4 verify's chain), and every session's cache is its own
buffer that grows. A GPU then waits on the host, and no pass has a fixed shape a CUDA graph could
replay. Here:

- **The store.** Every layer's keys and values live in one buffer [slots, Hkv, capacity, D]
  allocated at start-up; a session holds a slot. Its cache is a view of the slot (`SlotLayer`), so
  rollback, a tree's kept path and the session bookkeeping work as they did on growing buffers, and
  nothing is allocated or copied while serving.
- **Rows.** A pass is a flat batch of rows: each new position of each session (a decode, a chain's
  drafts, a tree's nodes, a prompt chunk) with its slot, the column its keys go to, its rotary
  position and the columns it may see.
- **Attention folded, each row at its own key width** (`fold_rows`, `folded_attention`). A row
  reads the columns it sees padded to whole FOLD_KEY_BLOCKs, its own count whatever shares its pass:
  CPU SDPA rounds a query by its call's key count (past ~256 keys on a 2-vCPU Xeon, a row padded to
  the pass's widest differed from itself alone, and the default target's logits moved by up to 0.28
  beside a session four times as long). Rows of one width, of sessions with one row count (rounded
  up to a power of two), make one call in place over the block of slots they hold, a view of the
  store (no copy): each row a block of query rows (its query heads of one key head, padded to a power
  of two so SDPA's query blocks never split a row), padding rows and idle slots masked to column 0. A
  decode batch of similar contexts, or chains of one draft length, is one call a layer.
- **Exact by construction**, where the start-up probe (`probe_folding`) finds this machine's SDPA
  computing a block of query rows alike alone, among other rows and as one batch entry of several;
  on a CPU the flat pass serves only there. A masked column *between* visible ones is not harmless
  (it moves the later keys' vector lanes), so a tree's node reads its keys compacted (the committed
  columns, its ancestors', its own), gathered, in the order decoding its path holds them. With
  products that score each row alone (int4, int8; specd_engine/quantized.py) a position's logits are
  then the same alone, in a chain, in a tree, beside other sessions and after prompt chunks of any
  size (tests/test_flat_pass.py).
- **Every layer in one native call** where int4 tiles and specd's attention serve (native_decoder,
  native/decoder.c): a pass's layers run no framework operator, a third of a CPU pass's time before.
  Its rounding is its own, so a process keeps it for every pass (`use_native_layers`, after the probe).

Where folding does not serve (a GPU's eager passes, until a device window measures them), `gather`
decides: one call a layer over keys gathered by slot, or a call a session over a broadcast view of its
slot; both pad to the pass's widest row. On a 2-vCPU Xeon the folded pass took 17–19% less than
the ragged one for 32 sessions, 4–5% less for 8, and 3–9% more for one (its padded keys and query
rows); through the services it did not beat the ragged pass (docs/design/engine-room.md), which stays
the CPU default.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specd_common import tree
from specd_common.errors import InvalidArgument, ResourceExhausted
from specd_engine import kv_cache, lean_forward, native_decoder, quantized, store_attention
from specd_engine.passes import PassOutput, keeps_hidden, logit_rows, prompt_positions, prompt_rows
from specd_engine.sessions import Feed
from specd_engine.tuning import PassRuntime

log = logging.getLogger(__name__)

KEY_BLOCK, whole_blocks = kv_cache.KEY_BLOCK, kv_cache.whole_blocks  # a pass's key count is a multiple of KEY_BLOCK
# A folded row reads the keys it sees padded to whole blocks of this many, alone or beside any rows: CPU SDPA
# rounds a query by the key count of its call (one query over 278 keys differed from itself over 320 padded
# to 512 on a 2-vCPU Xeon), so a row's count is its own and rows share a call only where their counts agree.
# Larger shares more calls at concurrency, smaller pads less (a decode row reads 128 more keys on average).
FOLD_KEY_BLOCK = 256


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4  # Linux: the pages of a private anonymous mapping read as zeros again, and leave the resident set


def forget_pages(tensor: torch.Tensor) -> None:
    """Give the whole memory pages inside a contiguous CPU tensor back to the system (Linux): they read as
    zeros when next touched, and until then the process does not hold them. Elsewhere nothing."""
    if _LIBC is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def slot_capacity(kv_tokens: int, slots: int) -> int:
    """Positions a slot holds when `slots` share a budget of `kv_tokens` (0: no budget, the model's
    context), at least one key block."""
    return max(KEY_BLOCK, kv_tokens // slots) if kv_tokens > 0 else 0


class KVStore:
    """Every session's keys and values, allocated once: per layer [slots, Hkv, capacity, D].

    capacity is whole FOLD_KEY_BLOCKs, so a row's padded keys never pass its slot's end."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a KV store needs at least one slot and one column, not {slots} × {capacity}")
        self.slots, self.capacity = slots, whole_blocks(capacity, FOLD_KEY_BLOCK)  # a folded row's keys stay inside
        shape = (slots, kv_heads, self.capacity, head_dim)
        # empty: the memory is the operating system's until a slot's columns are first zeroed (`prepare`), so a
        # CPU verify holds what its sessions reached, not its whole budget
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(layers)]
        self._finite = [0] * slots  # columns of each slot zeroed or written since the store was made
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()  # a slot goes back when its session is collected, on whatever thread that is

    @classmethod
    def for_model(cls, config, slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> "KVStore":
        """A store shaped for a Llama-like `config`."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, slots, capacity, device, dtype)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def kv_dtype(self) -> str:
        """What the store keeps keys and values as, by its --kv-dtype name ("float32", "bfloat16")."""
        return str(self.keys[0].dtype).removeprefix("torch.")

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def claim(self) -> int:
        """A free slot, or RESOURCE_EXHAUSTED when every slot holds a session."""
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"all {self.slots} KV slots hold sessions: end one, or start the verify with a "
                                        "larger --kv-token-budget")
            return self._free.pop()

    def release(self, slot: int) -> None:
        """Give `slot` back, and on a CPU its pages to the system (forget_pages: they read as zeros, finite,
        when a later session reaches them), so a verify holds the memory of the sessions it holds, not
        of every slot's longest past session. The next claim takes the lowest free slot, so the sessions
        held sit in a block of low slots, what a folded attention call spans (Fold)."""
        with self._lock:
            if slot in self._free or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not held")
            for tensor in self.keys + self.values:
                forget_pages(tensor[slot])
            self._free.append(slot)
            self._free.sort(reverse=True)

    def prepare(self, slot: int, columns: int) -> None:
        """Make the first `columns` of `slot` finite before a pass reads them: a masked column still enters
        the attention's arithmetic (an exact zero times its value, which must not be NaN). Zeroes what no
        pass has reached yet, once."""
        start = self._finite[slot]
        if columns > start:
            for tensor in self.keys + self.values:
                tensor[slot, :, start:columns].zero_()
            self._finite[slot] = columns

    def cache(self, slot: int) -> DynamicCache:
        """A DynamicCache whose layers are views of `slot` (SlotLayer), empty."""
        cache = DynamicCache()
        cache.layers = [SlotLayer(self, layer, slot) for layer in range(len(self.keys))]
        return cache


class SlotLayer(kv_cache.GrowingLayer):
    """A GrowingLayer whose buffer is one slot of a KVStore ([1, Hkv, capacity, D] views): appends,
    crops and a tree's kept path write the store in place; it never grows. Its length is a number and
    `keys` / `values` the views of that many columns, made when read: a flat pass reads the store,
    not the views, and making them for every layer of every session after each pass cost 0.57 ms at 8
    sessions (2-vCPU Xeon), a fortieth of the pass, growing with the sessions."""

    def __init__(self, store: KVStore, layer: int, slot: int):
        self.length = 0
        super().__init__()
        self.store, self.slot = store, slot
        self.dtype, self.device = store.keys[layer].dtype, store.keys[layer].device
        self._key_buffer = store.keys[layer][slot : slot + 1]  # [1, Hkv, capacity, D]
        self._value_buffer = store.values[layer][slot : slot + 1]
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self._key_buffer[..., : self.length, :]  # [1, Hkv, length, D]

    @keys.setter
    def keys(self, value: Optional[torch.Tensor]) -> None:
        _only_cleared(value)

    @property
    def values(self) -> torch.Tensor:
        return self._value_buffer[..., : self.length, :]

    @values.setter
    def values(self, value: Optional[torch.Tensor]) -> None:
        _only_cleared(value)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer.crop's contract (remove the last -tokens_to_remove columns) on the length alone."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the columns to remove as a negative count, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the slot's views are the buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """An append outside a flat pass (a copied session): the columns it writes count as the slot's
        own, so a later `prepare` never zeroes them."""
        self.store.prepare(self.slot, self.length + key_states.shape[-2])
        return super().update(key_states, value_states, *args, **kwargs)

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise InvalidArgument(f"{needed} positions pass a KV slot's {self.store.capacity}")

    def _narrow(self, length: int) -> None:
        self.length = length

    def set_length(self, length: int) -> None:
        """The slot holds `length` positions (a flat pass wrote the columns itself)."""
        self._narrow(length)


def _only_cleared(value: Optional[torch.Tensor]) -> None:
    """DynamicLayer's constructor clears keys and values (None); a slot layer's are its slot's columns,
    so any other assignment would detach them from the store."""
    if value is not None:
        raise TypeError("a slot layer's keys and values are its KV slot's columns: set its length instead")


def slot_of(cache: DynamicCache) -> Optional[int]:
    """The store slot a session's cache views (None: a cache of its own)."""
    layer = cache.layers[0] if cache.layers else None
    return layer.slot if isinstance(layer, SlotLayer) else None


@dataclass
class FlatRows:
    """A pass's rows and where each reads and writes, made once for every layer (R rows, K key columns).

    slots [R]: each row's slot; writes [R]: the column its keys and values go to; positions [R]: its
    rotary position; visible [R, K] bool: the columns it attends (True = may see). runs: (first row,
    rows, slot) of each session's consecutive rows, for the per-session attention."""

    slots: torch.Tensor
    writes: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    runs: list[tuple[int, int, int]]
    first_write: int = 0  # the first row's column (a pass of one session writes its consecutive columns from here)
    compact: Optional[torch.Tensor] = None  # [R, K] the columns each row reads, in order, where a tree's node is among them
    folds: Optional[list["Fold"]] = None  # the attention calls of a folded pass (fold_rows); None: gathered or a call a session
    seen: Optional[torch.Tensor] = None  # [R] int32: the columns each row reads, where specd's kernel attends (store_attention)


def query_rows(group: int) -> int:
    """Query rows a row takes in a folded call: its `group` query heads of one key head, padded with zero
    rows to a power of two of at least 4 (lean_forward.padded_query_block). CPU SDPA splits a call's
    query rows into blocks of 32 (64 or 256 in long calls) and a block of one row takes another path (a
    row's heads 30–32 of a call of 33 rounded otherwise); a power of two never straddles a block nor
    leaves a row alone in one, and a 2-core AMD EPYC rounded blocks of 2 by their neighbours."""
    return lean_forward.padded_query_block(group)


@dataclass
class Fold:
    """One attention call: each row one block of query rows (query_rows: its query heads of one key head,
    zero rows after) over `keys` columns, the columns it may not see masked.

    In place (columns None): over a block of the store's slots, [first, first + slots), each slot's rows
    side by side (`rows` of them, padding after); no key is copied. Gathered (columns [F, keys]): each
    row its own batch entry over the columns `columns` of slot `gather_slots` [F], in that order (a
    tree's node, compacted: lean_forward.tree_compaction).

    pass_rows [F]: the pass's rows this call answers; at [F]: each one's row in [slots × rows]; mask
    [slots, 1, rows · query rows, keys]: additive, a padding row (and an idle slot's) seeing column 0
    only; view: the pass's rows are this call's rows in order (no scatter, no gather)."""

    first: int
    slots: int
    rows: int
    keys: int
    pass_rows: torch.Tensor
    at: torch.Tensor
    mask: torch.Tensor
    view: bool
    columns: Optional[torch.Tensor] = None
    gather_slots: Optional[torch.Tensor] = None


def fold_rows(runs: Sequence[tuple[int, int, int, int, bool]], visible: torch.Tensor, compact: Optional[torch.Tensor],
              group: int, device: torch.device) -> list[Fold]:
    """A pass's attention in as few calls as keep every row's arithmetic its own (probe_folding). runs:
    each session's (first row, rows, slot, cached columns, a tree?); visible [R, K] and, where a tree is
    among them, compact [R, K]: flat_rows's, K whole FOLD_KEY_BLOCKs. A row reads the columns it sees
    padded to whole FOLD_KEY_BLOCKs; rows of one width and sessions of one row count (rounded up to a
    power of two) share a call in place over their slots' block: a decode batch of similar contexts,
    or chains of one draft length, is one call a layer. A tree's rows read their keys compacted,
    gathered, a call a width. `group`: query heads a key head."""
    width = lambda seen: whole_blocks(seen, FOLD_KEY_BLOCK)  # noqa: E731
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    padded = query_rows(group)
    in_place: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (keys, rows) → (first row, rows, slot, first seen)
    gathered: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}  # keys → (row, slot, columns, visible)
    for first, n, slot, cached, is_tree in runs:
        if is_tree:  # a tree's rows: each its compacted columns, those it sees first
            for row in range(first, first + n):
                keys = width(int(visible[row].sum()))
                gathered.setdefault(keys, []).append((row, slot, compact[row, :keys], visible[row, :keys]))
            continue
        row = 0
        while row < n:  # a chain's or chunk's rows see cached + 1, cached + 2, ...: runs of one width
            keys = width(cached + row + 1)
            count = min(n, keys - cached) - row
            in_place.setdefault((keys, 1 << (count - 1).bit_length()), []).append((first + row, count, slot, cached + row + 1))
            row += count
    folds = []
    total = sum(n for _, n, _, _, _ in runs)
    for (keys, size), members in sorted(in_place.items()):
        low = min(slot for _, _, slot, _ in members)
        slots = max(slot for _, _, slot, _ in members) - low + 1
        seen = torch.ones((slots, size), dtype=torch.long)  # [slots, rows]: columns each row sees (padding: one)
        pass_rows, at = [], []
        for start, count, slot, first_seen in members:
            seen[slot - low, :count] = torch.arange(first_seen, first_seen + count)
            pass_rows += range(start, start + count)
            at += range((slot - low) * size, (slot - low) * size + count)
        visible = torch.arange(keys)[None, None, :] < seen[:, :, None]  # [slots, rows, K]
        mask = lean_forward.additive_mask(visible).repeat_interleave(padded, dim=1)[:, None]  # [slots, 1, rows · padded, K]
        view = slots * size == total and pass_rows == at == list(range(total))
        folds.append(Fold(low, slots, size, keys, as_long(pass_rows), as_long(at), mask.to(device), view))
    for keys, members in sorted(gathered.items()):
        sees = torch.stack([row_sees for _, _, _, row_sees in members])  # [F, K]
        mask = lean_forward.additive_mask(sees)[:, None, None, :].expand(-1, 1, padded, -1).contiguous()  # [F, 1, padded, K]
        folds.append(Fold(0, len(members), 1, keys, as_long([row for row, _, _, _ in members]), as_long(list(range(len(members)))),
                          mask.to(device), False, torch.stack([columns for _, _, columns, _ in members]).to(device),
                          as_long([slot for _, slot, _, _ in members])))
    return folds


def flat_rows(parts: Sequence[tuple[int, int, int, Optional[list[int]], Optional[torch.Tensor]]],
              device: torch.device, fold_group: int = 0, native: bool = False) -> FlatRows:
    """The rows of a pass from each session's part: (slot, cached columns, new rows, positions or None,
    mask or None). A part's rows go to columns cached .. cached + n - 1 and see the cached columns;
    among themselves causally, or by `mask` (bool [n, cached + n], a tree: its ancestors). Positions
    default to the columns (a chain, a prompt chunk); a tree's are root + depth. fold_group: query heads
    a key head, where attention folds (fold_rows); 0: it does not. native: specd's kernel attends
    (store_attention), which reads each row's count of columns (seen) instead of its mask."""
    # every row's keys, a multiple of KEY_BLOCK; folded, of FOLD_KEY_BLOCK, which then holds each row's own width
    keys = whole_blocks(max(cached + n for _, cached, n, _, _ in parts), FOLD_KEY_BLOCK if fold_group else KEY_BLOCK)
    slots, writes, positions, runs, trees, at = [], [], [], [], [], 0
    for slot, cached, n, part_positions, mask in parts:
        columns = list(range(cached, cached + n))
        slots += [slot] * n
        writes += columns
        positions += part_positions if part_positions is not None else columns
        runs.append((at, n, slot))
        if mask is not None:
            trees.append((at, cached, n, mask))
        at += n
    # a chain's or a chunk's row sees every column up to its own: one comparison for all of them
    visible = torch.arange(keys)[None, :] <= torch.tensor(writes)[:, None]  # [R, K]
    compact = None
    if trees:  # a tree's node reads its keys compacted (lean_forward.tree_compaction)
        compact = torch.arange(keys).repeat(len(writes), 1)  # [R, K]: column j of row r's keys
        for first, cached, n, mask in trees:
            compact[first : first + n], visible[first : first + n] = lean_forward.tree_compaction(cached, mask, keys)
    folds = None
    if fold_group:
        tree_rows = {first for first, _, _, _ in trees}
        folds = fold_rows([(first, n, slot, writes[first], first in tree_rows) for first, n, slot in runs], visible, compact,
                          fold_group, device)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    seen = visible.sum(dim=1, dtype=torch.int32) if native else None  # [R]: compacted first where a tree's node reads
    return FlatRows(as_long(slots), as_long(writes), as_long(positions), visible.to(device), runs, writes[0],
                    None if compact is None else compact.to(device), folds, seen)


@torch.inference_mode()
def forward_flat(lean: lean_forward.LeanLlama, store: KVStore, ids: torch.Tensor, rows: FlatRows, gather: bool,
                 keep_hidden: bool = False, capture: Sequence[int] = (),
                 prompt: Optional[lean_forward.PromptRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One pass of the lean model over the rows' tokens ids [R]: writes their keys and values into the
    store and returns the final hidden state [R, C] (after the final norm) and, when keep_hidden and
    layers are captured, their outputs [R, L, C]. gather: one attention call a layer over all rows
    (keys gathered by slot), else one a session (module docstring); where rows.folds, a call a Fold.
    `prompt`: the rows that are prompt positions, whose products may take a dense weight."""
    x = lean.embed(ids)  # [R, C]
    cos, sin = lean_forward.rotary_rows(lean.rotary, x, rows.positions)  # [R, 1, D] each
    mask = rows.visible[:, None, None, :]  # [R, 1, 1, K]
    captured = []
    for index, layer in enumerate(lean.layers):
        attend = lambda q, k, v, index=index, layer=layer: _attend(layer, store, index, q, k, v, rows, mask, gather)  # noqa: E731
        x = lean._layer(layer, x, cos, sin, attend, prompt)
        if index + 1 in capture and keep_hidden:
            captured.append(x)
    hidden = lean_forward.rms_norm(x, lean.norm, lean.eps)  # [R, C]
    return hidden, torch.stack(captured, dim=1) if captured else None


def _attend(layer: lean_forward.LeanLayer, store: KVStore, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rows: FlatRows, mask: torch.Tensor, gather: bool) -> torch.Tensor:
    """q [R, Hq, D], k and v [R, Hkv, D]: the rows' keys and values written into the store, then each
    row one query over its slot's first K columns. Returns [R, Hq, D]."""
    keys, values = store.keys[index], store.values[index]  # [S, Hkv, capacity, D]
    if rows.seen is not None:  # specd's kernel writes them (rounded as .to(keys.dtype) would) and attends, one call
        return store_attention.attend(layer, keys, values, q, rows.slots, rows.seen, rows.compact, (k, v, rows.writes))
    k, v = k.to(keys.dtype), v.to(values.dtype)  # a bfloat16 store rounds them as it keeps them (store_dtype)
    if len(rows.runs) == 1 and not gather:  # one session's rows: consecutive columns of one slot, a plain copy
        _, n, slot = rows.runs[0]
        first = rows.first_write
        keys[slot, :, first : first + n] = k.transpose(0, 1)  # [Hkv, n, D]
        values[slot, :, first : first + n] = v.transpose(0, 1)
    else:
        keys[rows.slots, :, rows.writes] = k  # [R, Hkv, D] into (slot, column) pairs
        values[rows.slots, :, rows.writes] = v
    if rows.folds is not None:
        return folded_attention(layer, keys, values, q, rows.folds)
    width = mask.shape[-1]
    if rows.compact is not None:  # a tree's nodes: each row's keys in the order decoding its path would hold them
        index = (rows.slots[:, None], slice(None), rows.compact)
        return lean_forward.row_attention(layer, q, keys[index].transpose(1, 2), values[index].transpose(1, 2), mask)
    if gather:
        return lean_forward.row_attention(layer, q, keys[:, :, :width].index_select(0, rows.slots),
                                          values[:, :, :width].index_select(0, rows.slots), mask)
    out = [lean_forward.row_attention(layer, q[first : first + n], keys[slot : slot + 1, :, :width].expand(n, -1, -1, -1),
                                      values[slot : slot + 1, :, :width].expand(n, -1, -1, -1), mask[first : first + n])
           for first, n, slot in rows.runs]
    return torch.cat(out) if len(out) > 1 else out[0]  # [R, Hq, D]


# (visible keys, rows beside it) the folding probe tries first: short and long rows, a decode batch's and
# a chain's rows, a prompt chunk past SDPA's query blocks of 32 and 64; then FOLD_PROBE_RANDOM drawn
# ones (a kernel that rounds a row by its neighbours does it in many rows, so a dozen find it where a
# served answer shows it only at a near-tie)
FOLD_PROBE_CASES = ((1, 2), (63, 8), (64, 11), (300, 64), (700, 70), (1500, 17))
FOLD_PROBE_RANDOM = 12


def fold_probe_cases(generator: torch.Generator) -> list[tuple[int, int]]:
    """FOLD_PROBE_CASES and FOLD_PROBE_RANDOM drawn ones: up to 2,048 visible keys, 1–40 rows."""
    draw = lambda high: int(torch.randint(high, (1,), generator=generator))  # noqa: E731
    return list(FOLD_PROBE_CASES) + [(1 + draw(2048), 1 + draw(40)) for _ in range(FOLD_PROBE_RANDOM)]


def probe_folding(layer: lean_forward.LeanLayer, device: torch.device) -> bool:
    """Whether this machine's SDPA gives a row the same bits folded (folded_attention) as alone: its
    block of query rows (query_rows) over its own keys (whole FOLD_KEY_BLOCKs) alone, against the same
    block among other rows' blocks (masks of their own) as one batch entry of three, at every thread
    count up to the current one. The CPU kernel computes each query row on its own, so it should where
    no block of query rows is cut otherwise; a kernel or BLAS that rounds a row by its neighbours
    would make a row's logits depend on what shares its pass, so the start-up checks instead of
    trusting (the ragged pass then serves a CPU)."""
    threads, heads = torch.get_num_threads(), query_rows(layer.heads // layer.kv_heads)
    generator = torch.Generator().manual_seed(0)
    random = lambda *shape: torch.randn(shape, generator=generator).to(device)  # noqa: E731
    try:
        for count in range(1, threads + 1):
            torch.set_num_threads(count)
            for visible, rows in fold_probe_cases(generator):
                keys = whole_blocks(visible, FOLD_KEY_BLOCK)
                key_states, value_states = random(3, layer.kv_heads, keys, layer.head_dim), random(3, layer.kv_heads, keys, layer.head_dim)
                query = random(1, layer.kv_heads, heads, layer.head_dim)
                seen = lean_forward.additive_mask(torch.arange(keys, device=device) < visible)  # [K]
                alone = F.scaled_dot_product_attention(query, key_states[1:2], value_states[1:2], attn_mask=seen[None, None, None],
                                                       scale=layer.scaling)
                for place in (0, rows - 1):
                    blocks = random(3, layer.kv_heads, rows * heads, layer.head_dim)
                    blocks[1, :, place * heads : (place + 1) * heads] = query[0]
                    others = torch.randint(1, keys + 1, (3, rows, 1), generator=generator).to(device).repeat_interleave(heads, dim=1)
                    masks = lean_forward.additive_mask(torch.arange(keys, device=device) < others)  # [3, rows · heads, K]
                    masks[1, place * heads : (place + 1) * heads] = seen
                    folded = F.scaled_dot_product_attention(blocks, key_states, value_states, attn_mask=masks[:, None], scale=layer.scaling)
                    if not torch.equal(folded[1:2, :, place * heads : (place + 1) * heads], alone):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def folded_attention(layer: lean_forward.LeanLayer, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor,
                     folds: Sequence[Fold]) -> torch.Tensor:
    """The rows' attention q [R, Hq, D] → [R, Hq, D], a call a Fold over the store's keys and values
    [S, Hkv, capacity, D]: a row's query heads become its key heads' blocks of query rows, padded with
    zero rows (query_rows), and a slot's rows sit side by side in each block."""
    heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
    group = heads // kv_heads
    padded = query_rows(group)
    rows_of = q.view(q.shape[0], kv_heads, group, dim)  # [R, Hkv, g, D]
    if padded > group:
        rows_of = F.pad(rows_of, (0, 0, 0, padded - group))  # [R, Hkv, p, D]
    out = None if len(folds) == 1 and folds[0].view else q.new_empty(q.shape)
    for fold in folds:
        slots, size = fold.slots, fold.rows
        queries = rows_of if fold.view else rows_of.new_zeros((slots * size, kv_heads, padded, dim)).index_copy_(
            0, fold.at, rows_of.index_select(0, fold.pass_rows))  # [slots · rows, Hkv, p, D]
        blocks = queries.view(slots, size, kv_heads, padded, dim).transpose(1, 2).reshape(slots, kv_heads, size * padded, dim)
        if fold.columns is None:  # in place: a view of the slots' block
            span = slice(fold.first, fold.first + slots)
            read_keys, read_values = keys[span, :, : fold.keys], values[span, :, : fold.keys]  # [slots, Hkv, K, D]
        else:  # a tree's rows: their compacted columns, gathered
            index = (fold.gather_slots[:, None], slice(None), fold.columns)
            read_keys, read_values = keys[index].transpose(1, 2), values[index].transpose(1, 2)  # [F, Hkv, K, D]
        read_keys, read_values = read_keys.to(q.dtype), read_values.to(q.dtype)  # a bfloat16 store's, widened
        attended = F.scaled_dot_product_attention(blocks, read_keys, read_values, attn_mask=fold.mask, scale=layer.scaling)
        attended = attended.view(slots, kv_heads, size, padded, dim).transpose(1, 2).reshape(slots * size, kv_heads, padded, dim)
        attended = attended[:, :, :group].reshape(slots * size, heads, dim)  # [slots · rows, Hq, D]
        if out is None:
            return attended
        out.index_copy_(0, fold.pass_rows, attended if fold.view else attended.index_select(0, fold.at))
    return out


GRAPH_ROWS = (8, 32, 128)  # a CUDA pass's rows are padded to the first of these that holds them; more run eagerly
GRAPH_MIN_KEYS = 512  # a graph's key columns: a power of two from this (padding keys costs a GPU little)


class GraphedPasses:
    """forward_flat on CUDA replayed as CUDA graphs, one per (rows, key columns) shape, captured the
    first time a shape is met (SGLang's `can_run`: a pass larger than every shape runs eagerly).

    Every shape's inputs live in buffers allocated once; a pass copies its rows in and replays. Padding
    rows write to a spare slot of their own and are dropped. A row's arithmetic then depends on its
    shape only, not on what shares the pass, so every pass of up to GRAPH_ROWS[0] rows has the same
    shape. Features of captured layers and a tree's compacted keys are not graphed: such a pass runs
    eagerly."""

    def __init__(self, lean: lean_forward.LeanLlama, store: KVStore, spare_slot: int):
        self.lean, self.store, self.spare = lean, store, spare_slot
        store.prepare(spare_slot, store.capacity)
        self.graphs: dict[tuple[int, int], tuple] = {}
        # one memory pool for every shape's graph (they replay one at a time), as vLLM and SGLang share theirs
        self.pool = torch.cuda.graph_pool_handle() if store.keys[0].device.type == "cuda" else None

    def shape_for(self, rows: int, keys: int) -> Optional[tuple[int, int]]:
        """(rows, key columns) of the graph a pass replays in: rows padded to GRAPH_ROWS, keys to a power
        of two from GRAPH_MIN_KEYS (a few graphs per context length, not one per 64 keys), or None."""
        size = next((size for size in GRAPH_ROWS if rows <= size), None)
        width = min(max(GRAPH_MIN_KEYS, 1 << (keys - 1).bit_length()), self.store.capacity)
        return None if size is None or keys > width else (size, width)

    def run(self, ids: torch.Tensor, rows: FlatRows) -> Optional[torch.Tensor]:
        """The final hidden state [R, C] of the pass replayed in its shape's graph (None: no shape holds it)."""
        count, keys = rows.visible.shape
        shape = self.shape_for(count, keys)
        if shape is None or rows.compact is not None:  # a tree's pass reads compacted keys: eagerly
            return None
        for _, _, slot in rows.runs:  # the graph reads its width of every row's slot
            self.store.prepare(slot, shape[1])
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(*shape)
        graph, inputs, hidden = self.graphs[shape]
        static_ids, static_rows = inputs
        static_ids[:count] = ids
        static_rows.slots[:count] = rows.slots
        static_rows.writes[:count] = rows.writes
        static_rows.positions[:count] = rows.positions
        static_rows.visible[:count, :keys] = rows.visible
        static_rows.visible[:count, keys:] = False
        static_ids[count:], static_rows.slots[count:], static_rows.writes[count:] = 0, self.spare, 0
        static_rows.positions[count:], static_rows.visible[count:] = 0, False
        static_rows.visible[count:, 0] = True  # a padding row sees one column of the spare slot
        graph.replay()
        return hidden[:count].clone()  # the shape's output buffer is the next replay's: features kept from it must not change

    def _capture(self, size: int, keys: int) -> tuple:
        device = self.store.keys[0].device
        ids = torch.zeros(size, dtype=torch.long, device=device)
        padding = FlatRows(torch.full((size,), self.spare, dtype=torch.long, device=device),
                           torch.zeros(size, dtype=torch.long, device=device), torch.zeros(size, dtype=torch.long, device=device),
                           torch.zeros((size, keys), dtype=torch.bool, device=device), [])
        padding.visible[:, 0] = True
        if device.type != "cuda":  # the CPU replays the same buffers eagerly (tests check the padding there)
            hidden = forward_flat(self.lean, self.store, ids, padding, gather=True)[0]
            return _EagerReplay(lambda: hidden.copy_(forward_flat(self.lean, self.store, ids, padding, gather=True)[0])), \
                (ids, padding), hidden
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks; it writes the spare slot only
            for _ in range(2):
                forward_flat(self.lean, self.store, ids, padding, gather=True)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, _ = forward_flat(self.lean, self.store, ids, padding, gather=True)
        return graph, (ids, padding), hidden


class _EagerReplay:
    """A captured pass's stand-in off CUDA: replay() runs it again over the same buffers."""

    def __init__(self, run):
        self.replay = run


class FlatPasses:
    """The pass engine over the store (passes.py): every feed's rows in one flat pass, each row
    attending its own slot, replayed as a CUDA graph where a captured shape holds it; the LM head only
    over the rows whose logits are wanted. CausalLM.use_flat_pass starts it after a probe."""

    def __init__(self, lean: lean_forward.LeanLlama, store: KVStore, device: torch.device, runtime: PassRuntime, gather: bool,
                 fold: bool = False, int4: bool = False, native: bool = False):
        self.lean, self.store, self.device, self.runtime, self.gather = lean, store, device, runtime, gather
        # attention folded into a call a row count (fold_rows), where this machine's SDPA keeps a row's bits (probe_folding)
        self.fold, self.int4 = fold, int4
        self.native = native  # attention by specd's kernel over the store in place, a call a layer (store_attention)
        self.prompt_kernel: Optional[str] = None  # prompt rows' dense products (quantized.choose_prompt_kernel); None: int4
        # fixed-shape passes replayed as CUDA graphs on a GPU, padding rows in a spare slot
        self.graphs = GraphedPasses(lean, store, store.claim()) if device.type == "cuda" else None
        self.decoder: Optional[native_decoder.NativeDecoder] = None  # every layer in one native call a pass (use_native_layers)

    @torch.inference_mode()
    def run(self, feeds: Sequence[Feed], starts: Sequence[int], captured: Sequence[int]) -> PassOutput:
        slots = [slot_of(feed.session.cache) for feed in feeds]
        if None in slots:
            raise ValueError("a flat pass needs every session in a store slot (made after use_flat_pass)")
        layer = self.lean.layers[0]
        rows = flat_rows([(slot, start, len(feed.tokens), feed.positions, feed.mask)
                          for feed, slot, start in zip(feeds, slots, starts)], self.device,
                         layer.heads // layer.kv_heads if self.fold else 0, self.native)
        for slot in slots:
            self.store.prepare(slot, rows.visible.shape[1])
        ids = torch.tensor([token for feed in feeds for token in feed.tokens], dtype=torch.long, device=self.device)  # [R]
        keep, wanted = keeps_hidden(feeds), logit_rows(feeds)
        with self.runtime.pass_of(len(ids), trial=len(feeds) == 1):
            hidden = layers = None
            if self.graphs is not None and not (keep and captured):  # a graph keeps no layer's outputs
                hidden = self._replay(ids, rows)  # [R, H] or None
            if hidden is None:
                # several sessions decoding one row each: gathering their keys costs less than a call a session,
                # on a CPU too; one session reads a view of its slot (no copy)
                if self.native_layers:  # prompt rows may take the prompt tiles, and dot products in attention
                    hidden, layers = self.decoder.forward(ids, rows, keep, captured, native_decoder.prompt_row_numbers(prompt_positions(feeds)))
                else:
                    prompt = prompt_rows(feeds, self.prompt_kernel)
                    gather = self.gather or len(ids) == len(feeds) > 1
                    hidden, layers = forward_flat(self.lean, self.store, ids, rows, gather, keep, captured, prompt)  # [R, H], [R, L, H] or None
            logits = self.lean.lm_head(hidden[wanted]).float() if wanted else None  # [W, V]
        for feed, start in zip(feeds, starts):
            for layer in feed.session.cache.layers:
                layer.set_length(start + len(feed.tokens))
        return PassOutput(hidden, layers, logits)

    def use_native_layers(self) -> str:
        """Run every pass's layers in one native call from now on where that runs here (native_decoder), and
        say why not where it does not ("" where it does)."""
        why = "" if self.native and self.int4 else "the decoder serves int4 products with specd's attention"
        why = why or native_decoder.unavailable(self.lean, self.store)
        self.decoder = None if why else native_decoder.NativeDecoder(self.lean, self.store)
        return why

    @property
    def native_layers(self) -> bool:
        """Whether passes run their layers in one native call (native_decoder): where it runs, unless prompt rows
        take a dense weight, which only the framework's pass multiplies by (then it serves every pass)."""
        return self.decoder is not None and self.native and self.prompt_kernel in (None, quantized.PROMPT_TILES)

    @property
    def positional_prompts(self) -> bool:
        """A prompt row's bits depend on its position alone (CausalLM.prescores): int4's per-row products,
        and attention by specd's kernel or folded where this machine keeps a row's bits so (its keys padded,
        its neighbours any)."""
        return (self.native or self.fold) and self.int4

    def _replay(self, ids: torch.Tensor, rows: FlatRows) -> Optional[torch.Tensor]:
        """The pass replayed as a CUDA graph ([R, H]), or None where no captured shape holds it. A shape
        that fails to capture turns graphs off, with the reason in the log: passes then run eagerly."""
        try:
            return self.graphs.run(ids, rows)
        except Exception:  # noqa: BLE001: a serving verify keeps serving, eagerly
            log.exception("CUDA graphs are off: capturing a flat pass of %d rows failed", len(ids))
            self.graphs = None
            return None


def why_not_by_default(lm) -> str:
    """Why `--forward auto` keeps the ragged pass for `lm` ("" where the flat pass serves by default): on a
    CPU with int4 products and specd's attention kernel, where every row's bits are its own by
    construction and a pass costs less at every size measured (docs/design/engine-room.md, "Attention
    over the store in place"). Elsewhere the ragged pass measured as fast or faster (a GPU's eager
    passes, float32's GEMMs that round a row by its neighbours)."""
    if lm.lean is None or lm.loaded.device.type != "cpu" or lm.weights != "int4":
        return "the flat pass serves by default only an int4 lean model on a CPU"
    return store_attention.unavailable(lm.lean.layers[0], lm.loaded.device, lm.lean.embed.weight.dtype)


def serve_flat(lm, slots: int, capacity: int = 0, gather: Optional[bool] = None, kv_dtype: str = "auto") -> bool:
    """Make `lm` (a CausalLM with the lean forward) serve every pass as one flat pass over a KV store
    allocated now: `slots` sessions at once, each up to `capacity` positions (0: the model's context
    and a tree's nodes); gather: one attention call a layer (default: on a GPU; the CPU gathers slower
    than it calls). Sessions made before keep their own caches and must end first. A probe (a
    prompt, then a chain, twice: a CUDA graph's capture and its replay) must score as the ragged pass
    does (lean_forward.logits_disagree), or the ragged pass keeps serving and the log says why;
    returns whether the flat pass serves. On a CPU, attention by specd's kernel where it runs
    (store_attention), else only where this machine folds attention (probe_folding): rows padded to the
    pass's widest would round by their neighbours' key counts. kv_dtype: what the store keeps (store_dtype);
    the probe runs over a store of the model's dtype, as the ragged pass's caches hold it, and a bfloat16
    store takes its place after it (its rounding is the kernel's tested contract, not the probe's)."""
    if lm.lean is None:
        raise ValueError("the flat pass needs the lean forward (a Llama-shaped target that agrees with transformers)")
    why_not_native = store_attention.unavailable(lm.lean.layers[0], lm.loaded.device, lm.lean.embed.weight.dtype)
    native = not why_not_native and lm.loaded.device.type == "cpu" and gather is not True
    dtype = store_dtype(lm, native, kv_dtype)
    fold = not native and lm.run(probe_folding, lm.lean.layers[0], lm.loaded.device)
    if not native and not fold and lm.loaded.device.type == "cpu":
        log.warning("model passes: ragged; this machine's attention rounds a row by the rows folded beside it "
                    "(flat_pass.probe_folding), and a flat pass must fold to be exact on a CPU")
        return False
    ragged, max_length, nodes = lm.passes, lm.max_length, tree.MAX_TREE_NODES + 1
    if ragged.prompt_kernel is not None:
        lm.use_prompt_kernel(None)
    tiles, ragged.tiles = ragged.tiles, False  # the reference: the ragged pass attending prompt rows one by one
    reference = lm.run(probe, lm)  # (the model thread: torch work on the caller's thread starts a second OpenMP team)
    try:
        capacity = min(capacity or max_length + nodes, max_length + nodes)
        def serve_store(dtype: torch.dtype) -> None:
            lm.store = lm.run(KVStore.for_model, lm.loaded.model.config, slots, capacity, lm.loaded.device, dtype)
            lm.max_length = min(max_length, lm.store.capacity - nodes)
            lm.passes = FlatPasses(lm.lean, lm.store, lm.loaded.device, lm.tuning,
                                   lm.loaded.device.type == "cuda" if gather is None else gather, fold, lm.weights == "int4", native)

        serve_store(lm.lean.embed.weight.dtype)
        rounding = torch.bfloat16 if lm.weights == "int4" else lm.lean.embed.weight.dtype  # int4 rounds inputs to bfloat16
        why = lm.run(lambda: lean_forward.logits_disagree(probe(lm), reference, rounding) or lean_forward.logits_disagree(probe(lm), reference, rounding))
        if not why and dtype != lm.store.keys[0].dtype:
            serve_store(dtype)  # the probe's sessions have ended: their slots went back with them
        if not why:  # like the bfloat16 store, its rounding is its tests' contract (native_decoder), not the probe's
            lm.passes.use_native_layers()
    except Exception as error:  # noqa: BLE001: the ragged pass serves instead, and the log says why
        why = repr(error)
    if why:
        lm.store, lm.passes, lm.max_length, ragged.tiles = None, ragged, max_length, tiles
        log.warning("model passes: ragged; the flat pass failed its start-up probe: %s", why)
        return False
    unit = " (AMX's tile unit)" if lm.store.kv_dtype == "bfloat16" and store_attention.tiles() else ""
    calls = (f"one attention call a layer by specd's kernel{unit}, in place" + (", every layer in one native call" if lm.passes.decoder else "")
             if lm.passes.native else
             "one attention call a layer and row count, in place" if lm.passes.fold else
             "one attention call a layer" if lm.passes.gather else "one attention call a session and layer")
    log.info("model passes: flat over a %s KV store of %d slots × %d positions (%.0f MiB), %s",
             lm.store.kv_dtype, slots, lm.store.capacity, lm.store.bytes() / 2**20, calls)
    return True


def store_dtype(lm, native: bool, kv_dtype: str = "auto") -> torch.dtype:
    """What the KV store keeps keys and values as: float32 or bfloat16 where `kv_dtype` names it (bfloat16
    only where specd's kernel attends, `native`), and for auto bfloat16 where that kernel attends an int4
    model's store, else the model's own dtype. Decoding reads every cached key and value each pass, and at long
    contexts that traffic sets attention's time (8 sessions at 1,000 positions read 369 MB of a float32
    store a pass); int4's products already round their inputs to bfloat16, and a key or value kept in
    bfloat16 is rounded once, where it is written, so a row's bits still depend on nothing beside it."""
    if kv_dtype == "bfloat16" and not native:
        raise ValueError("a bfloat16 KV store needs specd's attention kernel (an AVX-512 CPU, not --gather); "
                         "start the verify with --kv-dtype auto or float32")
    if kv_dtype != "auto":
        return getattr(torch, kv_dtype)
    return torch.bfloat16 if native and lm.weights == "int4" else lm.lean.embed.weight.dtype


def probe(lm) -> torch.Tensor:
    """Logits [1 + PROBE_STEP, V] of a short prompt's next position and then of a chain after it."""
    ids = [token % lm.vocab_size for token in range(1, lean_forward.PROBE_PROMPT + lean_forward.PROBE_STEP + 1)]
    session = lm.new_session(ids[: lean_forward.PROBE_PROMPT])
    return torch.cat([lm.forward(session), lm.forward(session, ids[lean_forward.PROBE_PROMPT :])])
