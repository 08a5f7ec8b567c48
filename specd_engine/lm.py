"""A causal LM serving many sessions, each with its own KV cache that can be rolled back.

Shared by the verify service (the target) and the model drafter. A session is a TokenSequence
whose cache is a transformers DynamicCache (appending in place: kv_cache.py); `forward` feeds the pending tokens plus any extra
(drafted) tokens in one pass and returns logits for the positions after each.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from transformers import DynamicCache

from specd_common import tree
from specd_engine import autotune, flat_pass, kv_batch, kv_cache, lean_forward, model_thread, quantized
from specd_common.errors import InvalidArgument
from specd_engine.models import LoadedModel, max_sequence_length, model_vocab_size
from specd_common.sequence import TokenSequence
from specd_common.telemetry import model_forward

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt positions per prefill pass when no other session shares it (CausalLM.prefill_feed)


@dataclass
class PendingTree:
    """A scored draft tree whose keys/values sit in the cache after the committed tokens, until
    CausalLM.settle_tree keeps one path of it: cache rows base + i hold node i."""

    base: int  # committed tokens (and cache rows) before the nodes
    tokens: list[int]
    parents: list[int]


@dataclass(frozen=True)
class ScoredRow:
    """What a prefill computed at the prompt's last token (CausalLM.prescores): that row's logits, final
    hidden state and captured layers. The session's next chain or tree reads it as its row 0 instead of
    feeding the token again, so the first round after a prompt needs a pass only for its drafts."""

    logits: torch.Tensor  # [1, V]
    hidden: torch.Tensor  # [1, H]
    layers: Optional[torch.Tensor]  # [1, L, H] (CausalLM.capture_layers), or None


@dataclass
class Feed:
    """One session's part of a pass: the tokens it feeds and what it wants back. A chain feeds its
    pending tokens and drafts (`extra`, which join the sequence); a tree its pending tokens and the
    tree's nodes (`tree`, at `positions`, seeing each other by `mask`); a prefill chunk part of a
    prompt, wanting no logits (its last chunk may keep its last row's: `scores_last`). A round whose
    row 0 a prefill scored (`scored`) feeds only its drafts, maybe none."""

    session: "KVSession"
    tokens: list[int]
    logits: int  # logits of the last `logits` positions come back; 0: none (a prefill chunk)
    extra: list[int] = field(default_factory=list)  # a chain's drafts
    tree: Optional[PendingTree] = None  # a tree's nodes
    positions: Optional[list[int]] = None  # a tree's positions; None: consecutive after the cache
    mask: Optional[torch.Tensor] = None  # a tree's bool [n, cached + n], True = may attend
    scored: Optional[ScoredRow] = None  # a round: its row 0, scored by the prefill (KVSession.scored)
    scores_last: bool = False  # a prefill chunk that ends the prompt and keeps its last row's scores

    @property
    def is_round(self) -> bool:
        """A chain or tree (logits come back), not a prefill chunk."""
        return bool(self.logits) or self.scored is not None


class KVSession(TokenSequence):
    """A TokenSequence whose cached positions live in a DynamicCache.

    With keep_features, every forward also leaves the final hidden state of the positions it read
    in fed_features [n, H] (from position fed_start): what feature drafters are sent; where the model
    captures decoder layers' outputs too (CausalLM.capture_layers), those in fed_layers [n, L, H]. After a tree
    pass (CausalLM.forward_tree) `tree` says which cache rows hold its nodes. After a prefill that scored
    the prompt's last token (CausalLM.prescores), the cache holds every token and `scored` the next
    position's scores, until a round reads them or a commit moves the sequence on."""

    cache: DynamicCache
    keep_features: bool = False
    fed_start: int = 0
    fed_features: Optional[torch.Tensor] = None
    fed_layers: Optional[torch.Tensor] = None
    prefill_parts: Optional[list] = None  # a chunked prefill's (features, layers) so far, joined once the prompt is cached
    tree: Optional[PendingTree] = None
    prefilled_at: float = float("-inf")  # the batcher's clock when its prompt was cached (-inf: not by a batcher)
    prompt_length: int = 0  # positions [0, prompt_length) are the request's prompt: prefilled, they may take dense products
    scored: Optional[ScoredRow] = None  # the next position's scores, from the prefill (no token is pending then)

    def apply_commit(self, prefix_length: int, append: Sequence[int]) -> None:
        """TokenSequence.apply_commit, once no tree's nodes sit in the cache past the committed rows. A
        commit that keeps the sequence as it is keeps the prefill's scored row (and the cache it needs);
        any other drops it."""
        if self.tree is not None:
            raise RuntimeError("a scored draft tree is pending: CausalLM.settle_tree must keep its path before a commit")
        if self.scored is not None and prefix_length == len(self.tokens) and not append:
            return
        self.scored = None
        super().apply_commit(prefix_length, append)


WEIGHTS = ("float", "int4", "auto")  # CausalLM's weights: as loaded, 4-bit products (quantized.py), int4 where it serves


class LayoutSwitch:
    """Which weight layout the next forward's linear layers use (set by CausalLM before each pass;
    passes are serialised by its lock, so one shared attribute is enough)."""

    def __init__(self, layout: str = autotune.PLAIN):
        self.layout = layout


def available_layouts() -> set[str]:
    """The CPU weight layouts this torch build can run (plain, tall, cols and rows always; prepacked
    with oneDNN; mkl with MKL's packed GEMM)."""
    layouts = {autotune.PLAIN, autotune.TALL, autotune.COLS, autotune.ROWS}
    if torch.backends.mkldnn.is_available():
        layouts.add(autotune.PREPACKED)
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        layouts.add(autotune.MKL)
    return layouts


class SwitchableLinear(torch.nn.Module):
    """y = x Wᵀ + b, with W kept in the layouts asked for; `switch.layout` picks per forward:
      plain      PyTorch's linear on the ordinary weight (repacks it on every call for several rows);
      prepacked  oneDNN's blocked layout, reordered once at load (what torch.utils.mkldnn.MkldnnLinear
                 does, without its deprecated TorchScript base);
      mkl        MKL's packed GEMM for one row (a decoding step), packed once at load; other row counts
                 run the plain path;
      tall       for a weight with more rows than columns (out > in: an LM head, an MLP's gate/up) and
                 several input rows, (W xᵀ)ᵀ: the BLAS call then streams the tall weight once for all
                 rows instead of repacking it; other layers, and one row, run the plain path. The
                 result is copied out contiguous: left a transposed view, every later step of a
                 ragged pass read it strided (16 sessions' decoding pass: 285 ms, 120 contiguous);
      cols       (W xᵀ)ᵀ for every weight and several rows (one row: plain);
      rows       x (Wᵀ), Wᵀ copied once at load into its own contiguous [in, out] tensor: for one row a
                 plain GEMV over contiguous output columns (2-core AMD EPYC VM: a decoding step of the
                 default target 45 ms vs 53 with mkl or plain).
    Input and output are ordinary dense tensors [..., in] → [..., out]. Same math; the layouts' float32
    results differ only by summation order (~1e-4 in the logits)."""

    def __init__(self, linear: torch.nn.Linear, switch: LayoutSwitch, keep: set[str]):
        super().__init__()
        self.out_features = linear.out_features
        self.switch = switch
        dense = bool(keep & autotune.DENSE_LAYOUTS)  # MKL's op falls back to (and takes) the plain weight
        self.tall = linear.out_features > linear.in_features
        self.weight = linear.weight if dense else None  # [out, in], shared (tied embeddings stay tied)
        self.bias = linear.bias if dense or autotune.ROWS in keep else None
        packed = autotune.PREPACKED in keep
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn() if packed else None)
        self.register_buffer("packed_bias", linear.bias.detach().to_mkldnn() if packed and linear.bias is not None else None)
        mkl = autotune.MKL in keep
        self.register_buffer("mkl_weight", torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), 1) if mkl else None)
        transposed = linear.weight.detach().t().contiguous() if autotune.ROWS in keep else None  # [in, out]
        self.register_buffer("rows_weight", transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.switch.layout
        if layout == autotune.MKL and self.mkl_weight is not None and x.numel() == x.shape[-1]:  # one row
            y = torch.ops.mkl._mkl_linear(x.reshape(1, -1), self.mkl_weight, self.weight, self.bias, 1)  # [1, out]
            return y.reshape(*x.shape[:-1], self.out_features)
        if layout == autotune.ROWS and self.rows_weight is not None:
            y = torch.matmul(x, self.rows_weight)  # [..., out]
            return y if self.bias is None else y + self.bias
        streams_weight = layout == autotune.COLS or (layout == autotune.TALL and self.tall)  # W xᵀ: one pass over W
        if streams_weight and self.weight is not None and x.numel() > x.shape[-1]:
            rows = x.reshape(-1, x.shape[-1])  # [N, in]
            y = torch.mm(self.weight, rows.t()).t().contiguous()  # [N, out] (W xᵀ [out, N] transposed)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.packed_weight is not None and (layout == autotune.PREPACKED or self.weight is None):
            rows = x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn()  # [N, in]
            y = torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.packed_bias).to_dense()  # [N, out]
            return y.reshape(*x.shape[:-1], self.out_features)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def make_linears_switchable(model: torch.nn.Module, switch: LayoutSwitch, keep: set[str]) -> int:
    """Replace every float32 nn.Linear by a SwitchableLinear keeping the `keep` layouts.

    Why: PyTorch's default CPU linear repacks the weight on every call, which on some CPUs makes a
    pass over 2–5 positions (a verify round) cost nearly as much per row as one-row decoding, and on
    others is the faster choice (specd_engine/autotune.py measures which). CPU float32 only; returns
    how many layers were replaced (0 when only the plain layout is kept or available)."""
    keep = keep & available_layouts()
    if keep <= {autotune.PLAIN}:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, SwitchableLinear(child, switch, keep))
                replaced += 1
    return replaced


def lean_forward_for(loaded: LoadedModel) -> Optional[lean_forward.LeanLlama]:
    """The lean forward for this model (specd_engine/lean_forward.py), or None where transformers'
    forward must serve: an unsupported architecture, or logits that do not agree with transformers'
    on a probe (a warning: the model serves, only slower)."""
    reason = lean_forward.unsupported(loaded.model)
    if reason:
        log.info("model passes: transformers' forward (the lean one does not serve %s)", reason)
        return None
    try:
        lean = lean_forward.LeanLlama(loaded.model)
        disagreement = lean_forward.disagreement(lean, loaded.model, lambda: kv_cache.growing_cache(loaded.model.config))
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:  # another transformers' modules, say
        log.warning("model passes: transformers' forward; the lean one failed its probe: %r", error)
        return None
    if disagreement:
        log.warning("model passes: transformers' forward; the lean one disagrees with it: %s", disagreement)
        return None
    log.info("model passes: the lean forward (specd_engine/lean_forward.py), which agrees with transformers' on a probe")
    return lean


def on_model_thread(method: Callable) -> Callable:
    """Run a CausalLM method on the model's own thread (specd_engine/model_thread.py says why)."""

    @functools.wraps(method)
    def run(self: "CausalLM", *args: Any, **kwargs: Any) -> Any:
        return self.model_thread.run(method, self, *args, **kwargs)

    return run


class CausalLM:
    """Runs one model for many sessions; one forward pass at a time (the device is the bottleneck),
    every one of them, and the start-up measurements, on the process's model thread
    (specd_engine/model_thread.py; `run` puts a caller's own torch work there too)."""

    def __init__(self, loaded: LoadedModel, layouts: set[str] = frozenset({autotune.PLAIN}), lean: bool = True,
                 weights: str = "float"):
        """layouts: on a float32 CPU model, the linear-weight layouts to keep (make_linears_switchable;
        `tune` picks among them per forward size and drops the unused). lean: run passes with
        specd_engine/lean_forward.py where the model is supported and agrees with transformers
        (lean_forward_for), which fuses its q/k/v and gate/up weights in place (the originals become
        views: same values, one copy). weights: "float" as loaded; "int4": the lean decoder layers'
        products in 4-bit groups with bfloat16 inputs (specd_engine/quantized.py; CPU and lean forward
        only, else ValueError); "auto": int4 where that serves, else float. They change loaded.model
        in place, so only the owner of the model (a service) should ask for them."""
        self.loaded = loaded
        self.switch = LayoutSwitch()
        self.model_thread = model_thread.shared()
        self.lean = self.model_thread.run(lean_forward_for, loaded) if lean else None  # None: transformers' forward serves
        if not lean:
            log.info("model passes: transformers' forward (asked for)")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
        if weights == "auto":  # asked for a model stored in 4 bits (specd_app.cli.weights_for)
            missing = self._int4_missing()
            weights = "float" if missing else "int4"
            log.info("weights: auto → %s", f"float ({missing})" if missing else weights)
        self.weights = weights
        if weights == "int4":
            self._pack_int4()
            layouts = {autotune.PLAIN}  # no float32 product is left whose layout could be chosen
        # Layouts are the float32 products' (SwitchableLinear): where none was made switchable (a bfloat16 or
        # int4 model, transformers' linears) the plain weights serve every pass and must stay, so the plain
        # layout is the only one to time and keep (a copied layout timed faster by noise dropped them).
        switchable = loaded.device.type == "cpu" and make_linears_switchable(self._serving_module(), self.switch, set(layouts)) > 0
        self.layouts = (set(layouts) & available_layouts()) or {autotune.PLAIN} if switchable else {autotune.PLAIN}
        self._release_unused_originals()
        self.runtime = autotune.RuntimeChoice(device=str(loaded.device), threads=0, layouts={1: min(self.layouts)}, source="default")
        self.trials: Optional[autotune.ServingTrials] = None  # sizes still settled by timing serving passes (tune)
        self.vocab_size = model_vocab_size(loaded)
        self.max_length = max_sequence_length(loaded)
        self._forward_lock = threading.Lock()
        self._last_hidden: Optional[torch.Tensor] = None  # [B, n, H] of the last forward, when features are kept
        self._keep_hidden = False
        loaded.model.base_model.register_forward_hook(self._capture_last_hidden)
        self.captured_layers: tuple[int, ...] = ()  # decoder layers (1-based) whose outputs are kept with the features
        self._layer_outputs: list[Optional[torch.Tensor]] = []  # [B, n, H] each, of the last forward
        self.store: Optional[flat_pass.KVStore] = None  # set by use_flat_pass: sessions hold slots, passes are flat
        self.gather = False  # flat passes: one attention call a layer over gathered keys (else one a session)
        self.graphs: Optional[flat_pass.GraphedPasses] = None  # flat passes on CUDA: replayed as CUDA graphs
        self.prompt_kernel: Optional[str] = None  # int4: the dense weight prompt rows take (quantized.choose_prompt_kernel)
        self.prompt_tiles = self.weights == "int4"  # a ragged int4 pass attends a prompt's rows in tiles (lean_forward.prompt_tiles)

    def _int4_missing(self) -> str:
        """What int4 products would need and this model lacks ("" when they can serve it)."""
        if self.loaded.device.type == "cpu" and self.lean is not None:
            return ""
        return ("int4 needs the CPU and the lean forward (a Llama-shaped target that agrees with transformers on the "
                f"start-up probe); here: {self.loaded.device.type}, {'lean' if self.lean is not None else 'transformers'} forward")

    def _pack_int4(self) -> None:
        """The lean layers' products in 4 bits (specd_engine/quantized.py), or a clear refusal."""
        missing = self._int4_missing()
        if missing:
            raise ValueError(f"--weights {missing}")
        packed = self.model_thread.run(quantized.quantize_layers, self.lean.layers)
        head = "float32"
        try:
            self.lean.lm_head = self.model_thread.run(quantized.Int8Linear, self.lean.lm_head.weight)
            head = "8 bits a weight"
        except ValueError as why:
            log.warning("the LM head stays float32: %s", why)
        log.info("weights: %d of %d decoder products in 4-bit groups, the LM head in %s, bfloat16 inputs", packed,
                 len(quantized.PRODUCTS) * len(self.lean.layers), head)
        if not self.model_thread.run(lean_forward.queries_batch_alike, self.lean.layers[0], self.loaded.device):
            self.lean.query_per_call = True
            log.warning("this machine's attention rounds a query by the queries batched beside it: each row of a "
                        "verify pass gets its own attention call (exact, slower)")

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Also keep the outputs of decoder layers `layers` (1-based: hidden_states[l] in transformers'
        terms, before the final norm) wherever the final features are kept: what Medusa heads that fuse
        lower layers and EAGLE-3 heads read (verify_service/medusa.py, a session's feature_layers).
        Additive, so a session may ask for layers at run time (call it on the model thread); kept in
        ascending order, the order a pass produces them (`layer_slots` finds them). Hooks on those layers
        alone, for the reason _capture_last_hidden gives."""
        decoder = self.loaded.model.base_model.layers
        if not all(1 <= layer <= len(decoder) for layer in layers):
            raise ValueError(f"layers {list(layers)} are not all among this model's decoder layers 1..{len(decoder)}")
        new = sorted(set(layers) - set(self.captured_layers))
        if not new:
            return
        self.captured_layers = tuple(sorted(set(self.captured_layers).union(new)))
        self._layer_outputs = [None] * len(self.captured_layers)
        for layer in new:
            decoder[layer - 1].register_forward_hook(functools.partial(self._capture_layer, layer))

    def layer_slots(self, layers: Sequence[int]) -> list[int]:
        """Where captured `layers` sit along the L axis of a session's fed_layers [n, L, H]."""
        return [self.captured_layers.index(layer) for layer in layers]

    def _capture_layer(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook on a captured decoder layer: its output (a tensor, or a tuple led by one) [B, n, H]."""
        kept = (output[0] if isinstance(output, tuple) else output) if self._keep_hidden else None
        self._layer_outputs[self.captured_layers.index(layer)] = kept

    def _take_hidden(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The last forward's kept final hidden state [B, n, H] and captured layers' outputs [B, n, L, H]
        (None when not kept or none captured); both cleared, so no pass holds another's activations."""
        hidden, self._last_hidden = self._last_hidden, None
        layers = torch.stack(self._layer_outputs, dim=2) if hidden is not None and self.captured_layers else None
        self._layer_outputs = [None] * len(self.captured_layers)
        return hidden, layers

    def _capture_last_hidden(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the base model: its first output is the final hidden state (after the final
        norm), what feature drafters and Medusa heads read. Why not `output_hidden_states=True`: in
        transformers 5 the first such call installs capture hooks on every decoder layer for good,
        and every later pass pays for them (~1 ms a pass on the 2-core AMD EPYC VM, in every
        session, features asked for or not)."""
        self._last_hidden = output[0] if self._keep_hidden else None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the model's thread: for torch work on its outputs (an argmax over the
        logits, a softmax, heads), which would otherwise start a second OpenMP team on the caller's thread."""
        return self.model_thread.run(fn, *args, **kwargs)

    @on_model_thread
    def tune(self, threads: int = 0, max_threads: int = 0, repeats: int = 5,
             measure: autotune.Measure = autotune.measure_now) -> autotune.RuntimeChoice:
        """Measure this model's forward passes on this machine and adopt the fastest runtime
        (specd_engine/autotune.py): thread count (unless `threads` > 0 fixes it; at most
        `max_threads` > 0) and the weight layout per forward size (among self.layouts). Not on
        CUDA: there the default stands. `measure` takes the timings (a service's may answer from
        its cache: specd_engine/runtime_cache.py)."""
        if self.loaded.device.type != "cpu":
            return self.runtime
        counts = autotune.threads_to_try(threads, max_threads)
        if len(counts) == 1 and len(self.layouts) == 1:
            torch.set_num_threads(counts[0])
            self.runtime = autotune.RuntimeChoice("cpu", counts[0], {1: next(iter(self.layouts))}, source="flags")
            self._choose_prompt_kernel(counts[0], measure)
            return self.runtime
        prompt = [i % self.vocab_size for i in range(1, 33)]  # any ids: the cost does not depend on them
        session = self.new_session(prompt)

        def timed_forward(positions: int, layout: str):
            fixed = autotune.RuntimeChoice("cpu", 0, {1: layout})

            def run() -> None:
                self.runtime = fixed
                self.run_feeds_then_rewind([Feed(session, prompt[:positions], logits=positions)])  # every position's logits, like a verify

            return run

        costs = autotune.measure_forward_costs(timed_forward, counts, sorted(self.layouts), repeats=repeats, measure=measure)
        if not costs:  # no start-up time left to measure: the default runtime stands
            return self.runtime
        choice = autotune.choose_runtime(costs)
        if self.weights == "int4":  # exactness: every pass on one thread count, never trialled on another
            choice, self.trials = autotune.one_thread_count(choice, costs), None
        else:
            self.trials = autotune.ServingTrials.from_costs(choice, costs)
        torch.set_num_threads(choice.threads)
        self._choose_prompt_kernel(choice.threads, measure)
        self.use_only(choice.needs)
        self.runtime = choice
        return choice

    def _choose_prompt_kernel(self, threads: int, measure: autotune.Measure) -> None:
        """int4 weights: measure whether prompt rows' products are cheaper through a dense weight
        (quantized.choose_prompt_kernel) and keep it where they are (on the model's thread, as tune)."""
        if self.weights == "int4" and self.store is None:  # (a flat pass scores every row in int4)
            self.prompt_kernel = quantized.choose_prompt_kernel(self.lean.layers, threads, measure)
            log.info("prompt rows' products: %s", self.prompt_kernel or "int4, as every row's")

    def use_prompt_kernel(self, kernel: Optional[str]) -> None:
        """Prompt rows' products through the dense weight `kernel` (quantized.PROMPT_KERNELS), or int4 (None)."""
        self.prompt_kernel = self.model_thread.run(quantized.use_prompt_kernel, self.lean.layers, kernel)

    def use_only(self, layouts: set[str]) -> None:
        """Drop the weights of layouts no forward will use (frees their memory)."""
        for module in self._serving_module().modules():
            if isinstance(module, SwitchableLinear):
                if not layouts & autotune.DENSE_LAYOUTS:
                    module.weight = None
                    if autotune.ROWS not in layouts:
                        module.bias = None
                if autotune.PREPACKED not in layouts:
                    module.packed_weight = module.packed_bias = None
                if autotune.MKL not in layouts:
                    module.mkl_weight = None
                if autotune.ROWS not in layouts:
                    module.rows_weight = None
        self.layouts &= layouts
        self._release_unused_originals()

    def _release_unused_originals(self) -> None:
        """With the lean forward and no layout that reads the ordinary weights, transformers' decoder
        linears would keep a second copy of each weight alive (the lean pass has its own layouts):
        drop them. transformers' forward cannot run this model after that; nothing here calls it."""
        if self.lean is not None and self.loaded.device.type == "cpu" and not self.layouts & autotune.DENSE_LAYOUTS:
            self.lean.release_originals()

    def use_flat_pass(self, slots: int, capacity: int = 0, gather: Optional[bool] = None) -> bool:
        """Serve every pass as one flat pass over a KV store allocated now (specd_engine/flat_pass.py):
        `slots` sessions at once, each up to `capacity` positions (0: the model's context and a tree's
        nodes); gather: one attention call a layer (default: on a GPU; the CPU gathers slower than it
        calls). Sessions made before keep their own caches and must end first.

        A probe (a prompt, then a chain, twice: a CUDA graph's capture and its replay) must score as
        the ragged pass does (lean_forward.logits_disagree), or the ragged pass keeps serving and the
        log says why; returns whether the flat pass serves."""
        if self.lean is None:
            raise ValueError("the flat pass needs the lean forward (a Llama-shaped target that agrees with transformers)")
        if self.prompt_kernel is not None:  # the flat pass scores prompt rows in int4 too
            self.use_prompt_kernel(None)
        tiles, self.prompt_tiles = self.prompt_tiles, False  # ... and attends them a row at a time
        reference, max_length = self._probe(), self.max_length
        try:
            capacity = min(capacity or max_length + tree.MAX_TREE_NODES + 1, max_length + tree.MAX_TREE_NODES + 1)
            self.store = self.model_thread.run(flat_pass.KVStore.for_model, self.loaded.model.config, slots, capacity,
                                               self.loaded.device, self.lean.embed.weight.dtype)
            self.max_length = min(max_length, self.store.capacity - tree.MAX_TREE_NODES - 1)
            self.gather = self.loaded.device.type == "cuda" if gather is None else gather
            if self.loaded.device.type == "cuda":  # fixed-shape passes replayed as CUDA graphs, padding rows in a spare slot
                self.graphs = flat_pass.GraphedPasses(self.lean, self.store, self.store.claim())
            dtype = torch.bfloat16 if self.weights == "int4" else self.lean.embed.weight.dtype  # int4 rounds inputs to bfloat16
            why = lean_forward.logits_disagree(self._probe(), reference, dtype) or lean_forward.logits_disagree(
                self._probe(), reference, dtype)
        except Exception as error:  # noqa: BLE001: the ragged pass serves instead, and the log says why
            why = repr(error)
        if why:
            self.store, self.graphs, self.max_length, self.prompt_tiles = None, None, max_length, tiles
            log.warning("model passes: ragged; the flat pass failed its start-up probe: %s", why)
            return False
        log.info("model passes: flat over a KV store of %d slots × %d positions (%.0f MiB), %s", slots, self.store.capacity,
                 self.store.bytes() / 2**20, "one attention call a layer" if self.gather else "one attention call a session and layer")
        return True

    def _probe(self) -> torch.Tensor:
        """Logits [1 + PROBE_STEP, V] of a short prompt's next position and then of a chain after it."""
        ids = [token % self.vocab_size for token in range(1, lean_forward.PROBE_PROMPT + lean_forward.PROBE_STEP + 1)]
        session = self.new_session(ids[: lean_forward.PROBE_PROMPT])
        return torch.cat([self.forward(session), self.forward(session, ids[lean_forward.PROBE_PROMPT :])])

    def new_session(self, prompt: Sequence[int], keep_features: bool = False, prefill: bool = True,
                    prompt_length: Optional[int] = None) -> KVSession:
        """A session holding `prompt`, with everything but the last token in its cache, or all of it and
        the next position's scores where the prefill scores the last token (prescores; prefill=False:
        nothing cached yet; the caller prefills it with prefill_feed, e.g. in chunks that share passes
        with other sessions: specd_engine/batching.py). `prompt_length`: how many of its tokens are the
        request's prompt (the rest are generated tokens replayed, which are scored as generated ones:
        _prompt_rows); None: all."""
        if not 0 < len(prompt) < self.max_length:
            raise InvalidArgument(f"prompt has {len(prompt)} tokens; it must be 1..{self.max_length - 1} for this model")
        session = self._session(prompt, self._new_cache(len(prompt)), keep_features)
        session.prompt_length = len(prompt) if prompt_length is None else min(prompt_length, len(prompt))
        while prefill and self.unprefilled(session):
            self.run_feeds([self.prefill_feed(session, PREFILL_CHUNK)])
        return session

    def copy_session(self, session: KVSession) -> KVSession:
        """A new session holding what `session` holds (its tokens and a copy of its cache)."""
        if self.store is None:
            cache = kv_cache.copied(session.cache, self.loaded.model.config)
        else:
            cache = self._new_cache(0)
            self.model_thread.run(kv_cache.copy_into, session.cache, cache)
        copy = self._session(session.tokens, cache, session.keep_features)
        copy.cached, copy.scored = session.cached, session.scored
        return copy

    def _new_cache(self, reserve: int) -> DynamicCache:
        """An empty cache for a new session: a slot of the store when passes are flat (given back when the
        session is collected), else a growing cache with room for `reserve` positions."""
        if self.store is None:
            return kv_cache.growing_cache(self.loaded.model.config, reserve=reserve + kv_cache.SPARE_COLUMNS)
        return self.store.cache(self.store.claim())

    def _session(self, tokens: Sequence[int], cache: DynamicCache, keep_features: bool) -> KVSession:
        """A session of `tokens` over `cache` (which a rollback crops); a store slot goes back with the session."""
        session = KVSession(tokens=list(tokens), max_length=self.max_length, on_crop=lambda n: cache.crop(-n))
        session.cache, session.keep_features = cache, keep_features
        slot = flat_pass.slot_of(cache)
        if slot is not None:
            weakref.finalize(session, self.store.release, slot)
        return session

    @property
    def prescores(self) -> bool:
        """Whether a prefill scores the prompt's last token with the other prompt rows, keeping that row's
        logits for the first round (KVSession.scored): the first token then waits for no pass of its own,
        and a first round with no drafts runs none. Only where a prompt row's bits depend on its
        position alone (int4's ragged pass: per-row products, tiles cut by position, dense blocks of
        fixed size), so the first token is the same however the prompt was chunked and whatever shared
        its passes. Elsewhere (a float32 GEMM rounds a row by the chunk's row count) the first round
        scores the last token as a generated one."""
        return self.prompt_tiles and self.store is None

    def prompt_end(self, session: KVSession) -> int:
        """Positions before this one are prompt rows (they may attend in tiles and take dense products):
        the whole prompt where the prefill scores its last token, else all of it but that token."""
        return session.prompt_length if self.prescores else session.prompt_length - 1

    def prefill_end(self, session: KVSession) -> int:
        """Positions a prefill caches: all of a prompt whose last token it scores (not a replay, whose
        last token is a generated one), else all but the last token."""
        whole = self.prescores and session.prompt_length == len(session.tokens)
        return len(session.tokens) if whole else len(session.tokens) - 1

    def unprefilled(self, session: KVSession) -> int:
        """Prompt positions still to prefill."""
        return max(0, self.prefill_end(session) - session.cached)

    def _prompt_rows_of(self, feed: Feed, start: int) -> int:
        """How many of a feed's first rows are prompt positions (from `start`, its first position): a prefill
        chunk's positions before prompt_end (_prompt_rows); none in any other feed."""
        return 0 if feed.is_round else max(0, min(len(feed.tokens), self.prompt_end(feed.session) - start))

    @property
    def prefill_granule(self) -> int:
        """The prompt positions a pass's prefill chunks are best counted in: a dense prompt product
        computes whole blocks of quantized.PROMPT_BLOCK rows (16 rows cost what 64 do: the rest of the
        block is zeros), and tiles attend PROMPT_TILE rows at a time; 1 where rows cost one by one."""
        if self.prompt_kernel is not None:
            return quantized.PROMPT_BLOCK
        return lean_forward.PROMPT_TILE if self.prompt_tiles else 1

    def prefill_feed(self, session: KVSession, budget: int) -> Feed:
        """The next chunk of at most `budget` prompt positions. Chunks bound a long prompt's activations
        (attention over n positions is heads × n² floats: 137 MiB a matrix for the default target at
        2,000 tokens) and let other sessions' rounds share its passes; the cache and features are
        those of one pass. Where prompt rows attend in tiles (prompt_tiles) a chunk ends at a tile
        boundary, holding at least one tile, so a tile is never cut between passes."""
        start = session.cached
        end = start + min(budget, self.unprefilled(session))
        prompt_end = self.prompt_end(session)  # prompt rows: the positions before it (_prompt_rows)
        if self.prompt_tiles and end < prompt_end:  # whole prompt tiles, at least one (lean_forward.prompt_tiles)
            tile = lean_forward.PROMPT_TILE
            end = min(max(end // tile * tile, (start // tile + 1) * tile), prompt_end)
        return Feed(session, session.tokens[start:end], logits=0, scores_last=end == len(session.tokens))

    def chain_feed(self, session: KVSession, extra: Sequence[int] = ()) -> Feed:
        """A pass over the pending tokens and drafts `extra` (which join the sequence): logits
        [len(extra) + 1, V] after the last committed token and after each draft."""
        self.check_room(session, extra)
        self.settle_tree(session, [])
        fed = session.pending() + list(extra)
        if session.scored is not None:  # row 0 is the prefill's: the pass scores the drafts alone, maybe none
            return Feed(session, fed, logits=len(extra), extra=list(extra), scored=session.scored)
        return Feed(session, fed, logits=min(len(extra) + 1, len(fed)), extra=list(extra))

    def tree_feed(self, session: KVSession, tokens: Sequence[int], parents: Sequence[int]) -> Feed:
        """A pass over the pending tokens and a draft tree (specd_common/tree.py): logits
        [len(tokens) + 1, V] after the last committed token (row 0), then after each node (row 1 + i).

        Each node sees the committed context, its ancestors and itself, at position root + depth, so
        its logits equal those of a chain forward over its path. The nodes' keys/values stay in the
        cache, outside the session's tokens, until settle_tree keeps one path."""
        tree.validate_tree(tokens, parents)
        self.settle_tree(session, [])  # an earlier tree nobody settled keeps nothing
        depth = tree.depths(parents)
        self.check_room(session, [0] * max(depth, default=0))
        pending, past = session.pending(), session.cached
        fed, nodes = len(pending), len(tokens)
        positions = list(range(past, past + fed)) + [past + fed - 1 + d for d in depth]
        mask = torch.zeros((fed + nodes, past + fed + nodes), dtype=torch.bool)  # [q, kv]: True = may attend
        mask[:, :past] = True
        mask[:fed, past : past + fed] = torch.ones((fed, fed), dtype=torch.bool).tril()
        mask[fed:, past : past + fed] = True
        mask[fed:, past + fed :] = torch.tensor(tree.ancestry(parents), dtype=torch.bool).reshape(nodes, nodes)
        pending_tree = PendingTree(len(session.tokens), list(tokens), list(parents)) if nodes else None
        scored = session.scored  # row 0 is the prefill's (then nothing is pending): the pass scores the nodes
        return Feed(session, pending + list(tokens), logits=nodes + (scored is None), tree=pending_tree, positions=positions,
                    mask=mask, scored=scored)

    def forward(self, session: KVSession, extra: Sequence[int] = ()) -> torch.Tensor:
        """Feed pending + extra tokens; return logits [len(extra) + 1, V] for the positions after
        the last committed token and after each extra token. `extra` joins the sequence (speculatively)."""
        return self.run_feeds([self.chain_feed(session, extra)])[0]

    def forward_tree(self, session: KVSession, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """tree_feed's pass alone: logits [len(tokens) + 1, V]."""
        return self.run_feeds([self.tree_feed(session, tokens, parents)])[0]

    @on_model_thread
    def settle_tree(self, session: KVSession, path: Sequence[int]) -> None:
        """Keep the cache rows of `path` (node indices from the root, tree.path_of) after the committed
        tokens, in order, and append their tokens; drop the other nodes. No pending tree: nothing."""
        pending = session.tree
        if pending is None:
            return
        kv_cache.keep_rows(session.cache, pending.base, [pending.base + node for node in path])  # [1, H, base + len(path), D]
        session.tokens = session.tokens[: pending.base] + [pending.tokens[node] for node in path]
        session.cached = len(session.tokens)
        session.tree = None

    def check_room(self, session: KVSession, extra: Sequence[int]) -> None:
        """INVALID_ARGUMENT when the session plus `extra` would pass the model's context limit."""
        if len(session.tokens) + len(extra) > self.max_length:
            raise InvalidArgument(
                f"{len(session.tokens)} tokens + {len(extra)} drafts exceed the model's {self.max_length}-token limit"
            )

    def forward_batch(self, requests: Sequence[tuple[KVSession, Sequence[int]]]) -> list[torch.Tensor]:
        """`forward` for several distinct sessions in one pass; the i-th result is what
        forward(*requests[i]) returns ([len(extra_i) + 1, V]), up to float rounding."""
        return self.run_feeds([self.chain_feed(session, extra) for session, extra in requests])

    def run_feeds(self, feeds: Sequence[Feed]) -> list[Optional[torch.Tensor]]:
        """One pass over distinct sessions' feeds: each feed's logits [feed.logits, V] (None for a
        prefill chunk), and the sessions moved on (a chain's drafts join its tokens, a tree waits for
        settle_tree, a chunk is cached).

        With the lean forward every feed shares one ragged pass (_run_ragged: weights streamed once,
        attention in place in each cache). transformers' forward (other architectures) runs chains
        in one padded pass (specd_engine/kv_batch.py) where every cache can be packed, and trees and
        prefill chunks one pass each."""
        if len({id(feed.session) for feed in feeds}) != len(feeds):
            raise ValueError("a pass must not hold the same session twice")
        if self.store is not None:
            return self._run_flat(feeds)
        if self.lean is not None:
            return self._run_ragged(feeds)
        chains = [feed for feed in feeds if feed.logits and feed.tree is None]
        if len(chains) > 1 and all(kv_batch.is_packable(feed.session.cache) for feed in chains):
            padded = dict(zip(map(id, chains), self._run_batch(chains)))
            return [padded[id(feed)] if id(feed) in padded else self._run(feed) for feed in feeds]
        return [self._run(feed) for feed in feeds]

    def run_feeds_then_rewind(self, feeds: Sequence[Feed]) -> list[Optional[torch.Tensor]]:
        """run_feeds, then every session as it was before (its cache, tokens and pending tree): a pass
        timed again and again over the same positions (start-up timings, scripts/pass_anatomy.py)."""
        before = [(feed.session.cache.get_seq_length(), feed.session.cached, len(feed.session.tokens)) for feed in feeds]
        results = self.run_feeds(feeds)
        for feed, (length, cached, tokens) in zip(feeds, before):
            session = feed.session
            added = session.cache.get_seq_length() - length
            if added:  # crop(0) would empty the cache
                session.cache.crop(-added)
            session.cached, session.tree = cached, None
            del session.tokens[tokens:]
        return results

    @staticmethod
    def _advance(feed: Feed) -> None:
        """The session after its feed's pass: what the pass put in its cache is accounted for (and a
        prefill's scored row, once a round read it, dropped)."""
        session = feed.session
        session.tokens.extend(feed.extra)
        session.cached = len(session.tokens) if feed.is_round else session.cached + len(feed.tokens)
        session.tree = feed.tree
        if feed.scored is not None:
            session.scored = None

    def _keep_features(self, feed: Feed, start: int, hidden: torch.Tensor, layers: Optional[torch.Tensor]) -> None:
        """The feed's rows of the final hidden state [n, H] (and captured layers [n, L, H]) as the session's
        features, from position `start`. A prefill chunk's are kept aside and the prompt's joined once,
        after its last chunk (they are those of one pass; joining at every chunk would copy them once a
        chunk)."""
        session = feed.session
        if feed.is_round:
            session.fed_start, session.fed_features, session.fed_layers = start, hidden, layers
            return
        parts = session.prefill_parts = (session.prefill_parts if start > 0 else None) or []
        parts.append((hidden, layers))
        if start + len(feed.tokens) >= self.prefill_end(session):  # the prompt's last chunk
            session.fed_start, session.fed_features = 0, torch.cat([features for features, _ in parts])  # [n, H]
            session.fed_layers = torch.cat([part for _, part in parts]) if layers is not None else None  # [n, L, H]
            session.prefill_parts = None

    @contextlib.contextmanager
    def _runtime_for(self, rows: int, trial: bool = True) -> Iterator[None]:
        """Run the pass inside on the measured runtime for `rows` positions, or (trial) on a serving
        trial's candidate, timed and recorded (_settle_trial)."""
        candidate = self.trials.next(rows) if trial and self.trials is not None else None
        if candidate is None:
            self._configure(rows)
            yield
            return
        self._apply(*candidate)
        started = time.perf_counter()
        yield
        self._settle_trial(rows, candidate, time.perf_counter() - started)

    def _configure(self, rows: int) -> None:
        """The measured runtime for a forward over `rows` positions: its weight layout, and its thread
        count where that varies by size."""
        self._apply(self.runtime.threads_for(rows), self.runtime.layout_for(rows))

    def _apply(self, threads: int, layout: str) -> None:
        """Use `layout`'s weights and `threads` torch threads (set only when it changes: the call
        resizes OpenMP's team; 0 leaves them)."""
        self.switch.layout = layout
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _settle_trial(self, rows: int, trial: autotune.Candidate, seconds: float) -> None:
        """Record a timed trial pass; when its size settles, run that size with the winner from now on
        and say so in one log line."""
        settled = self.trials.record(rows, trial, seconds)
        if settled is None:
            return
        (threads, layout), medians = settled
        why = f"{threads} threads ({layout}); medians of {self.trials.passes} passes each: " + ", ".join(
            f"{t} threads ({lay}) {seconds * 1e3:.1f} ms" for (t, lay), seconds in medians.items())
        self.runtime.settle(rows, threads, layout, why)
        log.info("serving trials: %d-position forwards run on %s", rows, why)

    @on_model_thread
    @torch.inference_mode()
    def _run_ragged(self, feeds: Sequence[Feed]) -> list[Optional[torch.Tensor]]:
        """run_feeds by the lean forward: every feed's tokens in one pass (lean_forward.forward_ragged),
        the LM head only over the rows whose logits are wanted (a prefill chunk wants none: scoring its
        n × V logits would cost the LM head's weights n times over and n × V × 4 bytes)."""
        device = self.loaded.device
        segments, ids, positions, starts, at = [], [], [], [], 0
        for feed in feeds:
            cached = feed.session.cache.get_seq_length()
            starts.append(cached)
            ids += feed.tokens
            positions += feed.positions if feed.positions is not None else range(cached, cached + len(feed.tokens))
            mask = None if feed.mask is None else feed.mask.to(device)
            # int4: every row one query over its keys padded to whole blocks, so a position scores alike in any
            # pass; a prompt's rows in whole tiles
            if feed.tokens:  # a round whose row 0 the prefill scored may feed nothing
                segments.append(lean_forward.Segment(feed.session.cache, at, len(feed.tokens), mask, self.weights == "int4",
                                                     self._prompt_rows_of(feed, cached) if self.prompt_tiles else 0))
            at += len(feed.tokens)
        if not at:  # every row was scored by a prefill: no pass
            return self._hand_back(feeds, starts, None, None, None)
        keep = any(feed.session.keep_features or feed.scores_last for feed in feeds)  # a scored row keeps its layers
        wanted = self._logit_rows(feeds)
        with self._forward_lock, model_forward(at), self._runtime_for(at, trial=len(feeds) == 1):  # serving trials time lone passes
            hidden, layers = self.lean.forward_ragged(torch.tensor(ids, dtype=torch.long, device=device),
                                                      torch.tensor(positions, dtype=torch.long, device=device), segments,
                                                      keep, self.captured_layers, self._prompt_rows(feeds, starts))  # [T, H], [T, L, H] or None
            logits = self.lean.lm_head(hidden[wanted]).float() if wanted else None  # [R, V]
        return self._hand_back(feeds, starts, hidden, layers, logits)

    @on_model_thread
    @torch.inference_mode()
    def _run_flat(self, feeds: Sequence[Feed]) -> list[Optional[torch.Tensor]]:
        """run_feeds as one flat pass over the store (specd_engine/flat_pass.py): every feed's rows, each
        attending its own slot; the LM head only over the rows whose logits are wanted."""
        device = self.loaded.device
        starts = [feed.session.cache.get_seq_length() for feed in feeds]
        slots = [flat_pass.slot_of(feed.session.cache) for feed in feeds]
        if None in slots:
            raise ValueError("a flat pass needs every session in a store slot (made after use_flat_pass)")
        rows = flat_pass.flat_rows([(slot, start, len(feed.tokens), feed.positions, feed.mask)
                                    for feed, slot, start in zip(feeds, slots, starts)], device)
        for slot in slots:
            self.store.prepare(slot, rows.visible.shape[1])
        ids = torch.tensor([token for feed in feeds for token in feed.tokens], dtype=torch.long, device=device)  # [R]
        keep = any(feed.session.keep_features for feed in feeds)
        wanted = self._logit_rows(feeds)
        with self._forward_lock, model_forward(len(ids)), self._runtime_for(len(ids), trial=len(feeds) == 1):
            hidden = layers = None
            if self.graphs is not None and not (keep and self.captured_layers):  # a graph keeps no layer's outputs
                hidden = self._replay(ids, rows)  # [R, H] or None
            if hidden is None:
                # several sessions decoding one row each: gathering their keys costs less than a call a session,
                # on a CPU too; one session reads a view of its slot (no copy)
                gather = self.gather or len(ids) == len(feeds) > 1
                hidden, layers = flat_pass.forward_flat(self.lean, self.store, ids, rows, gather, keep,
                                                        self.captured_layers)  # [R, H], [R, L, H] or None
            logits = self.lean.lm_head(hidden[wanted]).float() if wanted else None  # [W, V]
        for feed, start in zip(feeds, starts):
            for layer in feed.session.cache.layers:
                layer.set_length(start + len(feed.tokens))
        return self._hand_back(feeds, starts, hidden, layers, logits)

    def _replay(self, ids: torch.Tensor, rows: flat_pass.FlatRows) -> Optional[torch.Tensor]:
        """The pass replayed as a CUDA graph ([R, H]), or None where no captured shape holds it. A shape
        that fails to capture turns graphs off, with the reason in the log: passes then run eagerly."""
        try:
            return self.graphs.run(ids, rows)
        except Exception:  # noqa: BLE001: a serving verify keeps serving, eagerly
            log.exception("CUDA graphs are off: capturing a flat pass of %d rows failed", len(ids))
            self.graphs = None
            return None

    def _prompt_rows(self, feeds: Sequence[Feed], starts: Sequence[int]) -> Optional[lean_forward.PromptRows]:
        """The rows of a pass over the feeds that are prompt positions in a prefill chunk, where prompt rows take
        dense products (self.prompt_kernel); None where none does. A row is one by its position alone, so it
        is scored alike in a chunk of any size and beside any rows. The prompt's last token is not one: a
        session's first pass scores it with the generated tokens, and a replay must score it alike."""
        if self.prompt_kernel is None:
            return None
        prompt, at = [], 0
        for feed, start in zip(feeds, starts):
            prompt += range(at, at + self._prompt_rows_of(feed, start))
            at += len(feed.tokens)
        if not prompt:
            return None
        other = sorted(set(range(at)) - set(prompt))
        return lean_forward.PromptRows(lean_forward.row_index(prompt), lean_forward.row_index(other) if other else None)

    @staticmethod
    def _logit_rows(feeds: Sequence[Feed]) -> list[int]:
        """The rows of a pass over the feeds' tokens in order whose logits are wanted: each feed's last
        `logits`, and the last row of a prefill chunk that scores it."""
        wanted, at = [], 0
        for feed in feeds:
            at += len(feed.tokens)
            wanted += range(at - feed.logits, at) if not feed.scores_last else [at - 1]
        return wanted

    def _hand_back(self, feeds: Sequence[Feed], starts: Sequence[int], hidden: Optional[torch.Tensor],
                   layers: Optional[torch.Tensor], logits: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """After a pass over the feeds' rows in order (hidden [T, H], layers [T, L, H] or None, logits of
        the wanted rows [W, V]; all None when no row was fed): each feed's logits (a round's [k + 1, V],
        its row 0 the prefill's where it scored it; None for a prefill chunk), its features kept where
        asked, a prefill's scored row kept, and its session moved on."""
        results, row, at = [], 0, 0
        for feed, start in zip(feeds, starts):
            n, session = len(feed.tokens), feed.session
            rows = hidden[at : at + n] if n else None  # [n, H]
            row_layers = layers[at : at + n] if layers is not None and n else None  # [n, L, H]
            mine = logits[row : row + feed.logits] if feed.logits else None  # [feed.logits, V]
            if feed.scores_last:  # the prompt's last row: its scores wait for the first round
                session.scored = ScoredRow(logits[row : row + 1].clone(), rows[-1:].clone(),
                                           row_layers[-1:].clone() if row_layers is not None else None)
                row += 1
                rows, row_layers = rows[:-1], row_layers[:-1] if row_layers is not None else None
            elif feed.scored is not None:  # a round reads its row 0 from the prefill: [1 + n, ...]
                scored = feed.scored
                mine = scored.logits if mine is None else torch.cat((scored.logits, mine))
                rows = scored.hidden if rows is None else torch.cat((scored.hidden, rows))
                if scored.layers is not None:
                    row_layers = scored.layers if row_layers is None else torch.cat((scored.layers, row_layers))
                start -= 1
            row += feed.logits
            results.append(mine)
            if session.keep_features:
                self._keep_features(feed, start, rows, row_layers)
            at += n
            self._advance(feed)
        return results

    @on_model_thread
    @torch.inference_mode()
    def _run(self, feed: Feed) -> Optional[torch.Tensor]:
        """run_feeds for one feed by transformers' forward: its logits [feed.logits, V] or None."""
        session, device = feed.session, self.loaded.device
        input_ids = torch.tensor([feed.tokens], dtype=torch.long, device=device)  # [1, n]
        start = session.cache.get_seq_length()
        custom = {} if feed.positions is None else {
            "position_ids": torch.tensor([feed.positions], dtype=torch.long, device=device),  # [1, n]
            "attention_mask": feed.mask[None, None].to(device),  # [1, 1, n, cached + n]
        }
        with self._forward_lock, model_forward(len(feed.tokens)), self._runtime_for(len(feed.tokens)):
            logits, hidden, layers = self._pass(input_ids, session.cache, session.keep_features,
                                                logits_to_keep=max(feed.logits, 1), **custom)  # [1, kept, V], [1, n, H], [1, n, L, H]
        if session.keep_features:
            self._keep_features(feed, start, hidden[0], layers[0] if layers is not None else None)
        self._advance(feed)
        return logits[0].float() if feed.logits else None  # [feed.logits, V]

    @on_model_thread
    @torch.inference_mode()
    def _run_batch(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """Chains of several sessions in one padded pass by transformers' forward (kv_batch packs their
        caches and hands each its new keys/values back); each feed's logits [feed.logits, V]."""
        caches = [feed.session.cache for feed in feeds]
        starts = [cache.get_seq_length() for cache in caches]
        keep = any(feed.session.keep_features for feed in feeds)
        with self._forward_lock:
            batch = kv_batch.pack(caches, [feed.tokens for feed in feeds], pad_id=0, device=self.loaded.device)
            self._configure(batch.input_ids.numel())
            logits, hidden, layers = self._pass(batch.input_ids, batch.past, keep, position_ids=batch.position_ids,
                                                attention_mask=batch.attention_mask)  # [B, N, V], [B, N, H], [B, N, L, H] when kept
            kv_batch.scatter_new(batch.past, batch, caches)  # the pass appended to batch.past in place
        results = []
        for row, (feed, start) in enumerate(zip(feeds, starts)):
            n = len(feed.tokens)  # rows are left-aligned: the feed's tokens are its row's first n positions
            if feed.session.keep_features:
                self._keep_features(feed, start, hidden[row, :n], layers[row, :n] if layers is not None else None)
            self._advance(feed)
            results.append(logits[row, n - feed.logits : n].float())  # [feed.logits, V]
        return results

    def _pass(self, input_ids: torch.Tensor, cache: DynamicCache, keep_hidden: bool, logits_to_keep: int = 0,
              position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One model pass over input_ids [B, n] appending to `cache`, by the lean forward or
        transformers': logits [B, kept, V], and when keep_hidden the final hidden state [B, n, H] and
        the captured layers' outputs [B, n, L, H] (None when no layer is captured)."""
        if self.lean is not None:
            output = self.lean(input_ids, cache, position_ids=position_ids, attention_mask=attention_mask,
                               logits_to_keep=logits_to_keep, keep_hidden=keep_hidden, capture=self.captured_layers)
            return output.logits, output.hidden, output.layers
        self._keep_hidden = keep_hidden
        output = self.loaded.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
                                   position_ids=position_ids, attention_mask=attention_mask)
        hidden, layers = self._take_hidden()
        return output.logits, hidden, layers

    def _serving_module(self) -> torch.nn.Module:
        """The module whose linears run the passes: the lean forward's, or transformers' model."""
        return self.lean if self.lean is not None else self.loaded.model
