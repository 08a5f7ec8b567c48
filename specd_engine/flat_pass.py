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
- **One attention call per layer** over all rows: each row is one query over the first `keys`
  columns of its slot (gathered by slot index), `keys` a multiple of KEY_BLOCK, the columns it may
  not see masked.
- **Exact by construction.** A row's attention reads only its own slot, and CPU SDPA gives one
  query the same bits over any key count that is a multiple of the vector width (8 floats on AVX2)
  with the columns past its own masked: masked keys add exact zeros, whole masked blocks rescale by
  exactly 1 (checked over 1–2,000 visible keys padded to 8–2,100; an unpadded count that is no such
  multiple differs in the last bits). A masked column *between* visible ones is not harmless (it
  moves the later keys' vector lanes), so a tree's node reads its keys compacted (`compact`: the
  committed columns, its ancestors', its own), in the order decoding its path holds them. So a row's
  bits do not depend on what shares its pass. With products that score
  each row alone (int4, int8; specd_engine/quantized.py) a position's logits are then the same alone,
  in a chain, in a tree, beside other sessions and after prompt chunks of any size
  (tests/test_flat_pass.py).

Gathering keys by slot copies rows × Hkv × keys × D a layer: microseconds on a GPU, and on the
CPU of the engine-room measurements more than the calls it saves. So `gather` may be off: then the
rows of one session share one call over a broadcast view of their slot (no copy), one call per
session, with the same bits (the same kernel over the same values).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from specd_common import tree
from specd_common.errors import InvalidArgument, ResourceExhausted
from specd_engine import kv_cache, lean_forward
from specd_engine.passes import PassOutput, keeps_hidden, logit_rows
from specd_engine.sessions import Feed
from specd_engine.tuning import PassRuntime

log = logging.getLogger(__name__)

KEY_BLOCK, whole_blocks = kv_cache.KEY_BLOCK, kv_cache.whole_blocks  # a pass's key count is a multiple of KEY_BLOCK


def slot_capacity(kv_tokens: int, slots: int) -> int:
    """Positions a slot holds when `slots` share a budget of `kv_tokens` (0: no budget, the model's
    context), at least one key block."""
    return max(KEY_BLOCK, kv_tokens // slots) if kv_tokens > 0 else 0


class KVStore:
    """Every session's keys and values, allocated once: per layer [slots, Hkv, capacity, D].

    capacity is whole key blocks, so a row's padded keys never pass its slot's end."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a KV store needs at least one slot and one column, not {slots} × {capacity}")
        self.slots, self.capacity = slots, whole_blocks(capacity)
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
        with self._lock:
            if slot in self._free or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not held")
            self._free.append(slot)

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
    crops and a tree's kept path write the store in place; it never grows."""

    def __init__(self, store: KVStore, layer: int, slot: int):
        super().__init__()
        self.store, self.slot = store, slot
        self.dtype, self.device = store.keys[layer].dtype, store.keys[layer].device
        self._key_buffer = store.keys[layer][slot : slot + 1]  # [1, Hkv, capacity, D]
        self._value_buffer = store.values[layer][slot : slot + 1]
        self.is_initialized = True
        self._narrow(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the slot's views are the buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """An append outside a flat pass (a copied session): the columns it writes count as the slot's
        own, so a later `prepare` never zeroes them."""
        self.store.prepare(self.slot, self.get_seq_length() + key_states.shape[-2])
        return super().update(key_states, value_states, *args, **kwargs)

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise InvalidArgument(f"{needed} positions pass a KV slot's {self.store.capacity}")

    def set_length(self, length: int) -> None:
        """The slot holds `length` positions (a flat pass wrote the columns itself)."""
        self._narrow(length)


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


def flat_rows(parts: Sequence[tuple[int, int, int, Optional[list[int]], Optional[torch.Tensor]]],
              device: torch.device) -> FlatRows:
    """The rows of a pass from each session's part: (slot, cached columns, new rows, positions or None,
    mask or None). A part's rows go to columns cached .. cached + n - 1 and see the cached columns;
    among themselves causally, or by `mask` (bool [n, cached + n], a tree: its ancestors). Positions
    default to the columns (a chain, a prompt chunk); a tree's are root + depth."""
    keys = whole_blocks(max(cached + n for _, cached, n, _, _ in parts))
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
        compact = compact.to(device)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return FlatRows(as_long(slots), as_long(writes), as_long(positions), visible.to(device), runs, writes[0], compact)


@torch.inference_mode()
def forward_flat(lean: lean_forward.LeanLlama, store: KVStore, ids: torch.Tensor, rows: FlatRows, gather: bool,
                 keep_hidden: bool = False, capture: Sequence[int] = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One pass of the lean model over the rows' tokens ids [R]: writes their keys and values into the
    store and returns the final hidden state [R, C] (after the final norm) and, when keep_hidden and
    layers are captured, their outputs [R, L, C]. gather: one attention call a layer over all rows
    (keys gathered by slot), else one a session (module docstring)."""
    x = lean.embed(ids)  # [R, C]
    cos, sin = lean_forward.rotary_rows(lean.rotary, x, rows.positions)  # [R, 1, D] each
    mask = rows.visible[:, None, None, :]  # [R, 1, 1, K]
    captured = []
    for index, layer in enumerate(lean.layers):
        attend = lambda q, k, v, index=index, layer=layer: _attend(layer, store, index, q, k, v, rows, mask, gather)  # noqa: E731
        x = lean._layer(layer, x, cos, sin, attend)
        if index + 1 in capture and keep_hidden:
            captured.append(x)
    hidden = lean_forward.rms_norm(x, lean.norm, lean.eps)  # [R, C]
    return hidden, torch.stack(captured, dim=1) if captured else None


def _attend(layer: lean_forward.LeanLayer, store: KVStore, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rows: FlatRows, mask: torch.Tensor, gather: bool) -> torch.Tensor:
    """q [R, Hq, D], k and v [R, Hkv, D]: the rows' keys and values written into the store, then each
    row one query over its slot's first K columns. Returns [R, Hq, D]."""
    keys, values = store.keys[index], store.values[index]  # [S, Hkv, capacity, D]
    if len(rows.runs) == 1 and not gather:  # one session's rows: consecutive columns of one slot, a plain copy
        _, n, slot = rows.runs[0]
        first = rows.first_write
        keys[slot, :, first : first + n] = k.transpose(0, 1)  # [Hkv, n, D]
        values[slot, :, first : first + n] = v.transpose(0, 1)
    else:
        keys[rows.slots, :, rows.writes] = k  # [R, Hkv, D] into (slot, column) pairs
        values[rows.slots, :, rows.writes] = v
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

    def __init__(self, lean: lean_forward.LeanLlama, store: KVStore, device: torch.device, runtime: PassRuntime, gather: bool):
        self.lean, self.store, self.device, self.runtime, self.gather = lean, store, device, runtime, gather
        # fixed-shape passes replayed as CUDA graphs on a GPU, padding rows in a spare slot
        self.graphs = GraphedPasses(lean, store, store.claim()) if device.type == "cuda" else None

    @torch.inference_mode()
    def run(self, feeds: Sequence[Feed], starts: Sequence[int], captured: Sequence[int]) -> PassOutput:
        slots = [slot_of(feed.session.cache) for feed in feeds]
        if None in slots:
            raise ValueError("a flat pass needs every session in a store slot (made after use_flat_pass)")
        rows = flat_rows([(slot, start, len(feed.tokens), feed.positions, feed.mask)
                          for feed, slot, start in zip(feeds, slots, starts)], self.device)
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
                gather = self.gather or len(ids) == len(feeds) > 1
                hidden, layers = forward_flat(self.lean, self.store, ids, rows, gather, keep, captured)  # [R, H], [R, L, H] or None
            logits = self.lean.lm_head(hidden[wanted]).float() if wanted else None  # [W, V]
        for feed, start in zip(feeds, starts):
            for layer in feed.session.cache.layers:
                layer.set_length(start + len(feed.tokens))
        return PassOutput(hidden, layers, logits)

    def _replay(self, ids: torch.Tensor, rows: FlatRows) -> Optional[torch.Tensor]:
        """The pass replayed as a CUDA graph ([R, H]), or None where no captured shape holds it. A shape
        that fails to capture turns graphs off, with the reason in the log: passes then run eagerly."""
        try:
            return self.graphs.run(ids, rows)
        except Exception:  # noqa: BLE001: a serving verify keeps serving, eagerly
            log.exception("CUDA graphs are off: capturing a flat pass of %d rows failed", len(ids))
            self.graphs = None
            return None


def serve_flat(lm, slots: int, capacity: int = 0, gather: Optional[bool] = None) -> bool:
    """Make `lm` (a CausalLM with the lean forward) serve every pass as one flat pass over a KV store
    allocated now: `slots` sessions at once, each up to `capacity` positions (0: the model's context
    and a tree's nodes); gather: one attention call a layer (default: on a GPU; the CPU gathers slower
    than it calls). Sessions made before keep their own caches and must end first. A probe (a
    prompt, then a chain, twice: a CUDA graph's capture and its replay) must score as the ragged pass
    does (lean_forward.logits_disagree), or the ragged pass keeps serving and the log says why;
    returns whether the flat pass serves. A flat pass scores prompt rows in int4, a row at a time."""
    if lm.lean is None:
        raise ValueError("the flat pass needs the lean forward (a Llama-shaped target that agrees with transformers)")
    ragged, max_length, nodes = lm.passes, lm.max_length, tree.MAX_TREE_NODES + 1
    if ragged.prompt_kernel is not None:
        lm.use_prompt_kernel(None)
    tiles, ragged.tiles = ragged.tiles, False  # the reference: the ragged pass attending prompt rows one by one
    reference = probe(lm)
    try:
        capacity = min(capacity or max_length + nodes, max_length + nodes)
        lm.store = lm.run(KVStore.for_model, lm.loaded.model.config, slots, capacity, lm.loaded.device, lm.lean.embed.weight.dtype)
        lm.max_length = min(max_length, lm.store.capacity - nodes)
        lm.passes = FlatPasses(lm.lean, lm.store, lm.loaded.device, lm.tuning, lm.loaded.device.type == "cuda" if gather is None else gather)
        dtype = torch.bfloat16 if lm.weights == "int4" else lm.lean.embed.weight.dtype  # int4 rounds inputs to bfloat16
        why = lean_forward.logits_disagree(probe(lm), reference, dtype) or lean_forward.logits_disagree(probe(lm), reference, dtype)
    except Exception as error:  # noqa: BLE001: the ragged pass serves instead, and the log says why
        why = repr(error)
    if why:
        lm.store, lm.passes, lm.max_length, ragged.tiles = None, ragged, max_length, tiles
        log.warning("model passes: ragged; the flat pass failed its start-up probe: %s", why)
        return False
    log.info("model passes: flat over a KV store of %d slots × %d positions (%.0f MiB), %s", slots, lm.store.capacity,
             lm.store.bytes() / 2**20, "one attention call a layer" if lm.passes.gather else "one attention call a session and layer")
    return True


def probe(lm) -> torch.Tensor:
    """Logits [1 + PROBE_STEP, V] of a short prompt's next position and then of a chain after it."""
    ids = [token % lm.vocab_size for token in range(1, lean_forward.PROBE_PROMPT + lean_forward.PROBE_STEP + 1)]
    session = lm.new_session(ids[: lean_forward.PROBE_PROMPT])
    return torch.cat([lm.forward(session), lm.forward(session, ids[lean_forward.PROBE_PROMPT :])])
