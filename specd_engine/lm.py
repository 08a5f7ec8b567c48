"""CausalLM: one model serving many sessions, each with its own KV cache that can be rolled back.

Shared by the verify service (the target) and the model drafter. A session (sessions.KVSession) is
a TokenSequence whose cache appends in place (kv_cache.py) or lives in a slot of the flat pass's
store; CausalLM makes a pass's feeds (a prompt's chunks, a chain of drafts, a draft tree), runs them
through one pass engine (passes.py: ragged, flat or transformers'), and hands each session its rows
back. `forward` feeds the pending tokens plus any extra (drafted) tokens in one pass and returns
logits for the positions after each. The runtime a pass runs on, and the start-up measurements that
choose it, are tuning.py's.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from transformers import DynamicCache

from specd_common import tree
from specd_common.errors import InvalidArgument
from specd_engine import autotune, flat_pass, kv_cache, lean_forward, model_thread, passes, quantized, tuning
from specd_engine.layouts import LayoutSwitch, available_layouts, make_linears_switchable
from specd_engine.models import LoadedModel, max_sequence_length, model_vocab_size
from specd_engine.sessions import Feed, KVSession, PendingTree, tree_mask

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt positions per prefill pass when no other session shares it (CausalLM.prefill_feed)
WEIGHTS = ("float", "int4", "auto")  # CausalLM's weights: as loaded, 4-bit products (quantized.py), int4 where it serves


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


def int4_missing(loaded: LoadedModel, lean: Optional[lean_forward.LeanLlama]) -> str:
    """What int4 products would need and this model lacks ("" when they can serve it)."""
    if loaded.device.type == "cpu" and lean is not None:
        return ""
    return ("int4 needs the CPU and the lean forward (a Llama-shaped target that agrees with transformers on the "
            f"start-up probe); here: {loaded.device.type}, {'lean' if lean is not None else 'transformers'} forward")


def on_model_thread(method: Callable) -> Callable:
    """Run a CausalLM method on the model's own thread (specd_engine/model_thread.py says why)."""

    @functools.wraps(method)
    def run(self: "CausalLM", *args: Any, **kwargs: Any) -> Any:
        return self.model_thread.run(method, self, *args, **kwargs)

    return run


class CausalLM:
    """Runs one model for many sessions: makes their feeds, runs every pass through one pass engine
    (`passes`, chosen at load: passes.py), and hands each session its rows back. Every pass, and the
    start-up measurements, on the process's model thread (specd_engine/model_thread.py; `run` puts a
    caller's own torch work there too)."""

    def __init__(self, loaded: LoadedModel, layouts: set[str] = frozenset({autotune.PLAIN}), lean: bool = True,
                 weights: str = "float"):
        """layouts: on a float32 CPU model, the linear-weight layouts to keep (layouts.py; `tune` picks
        among them per forward size and drops the unused). lean: run passes with lean_forward.py where
        the model is supported and agrees with transformers (lean_forward_for), which fuses its q/k/v
        and gate/up weights in place (the originals become views: same values, one copy). weights:
        "float" as loaded; "int4": the lean decoder layers' products in 4-bit groups with bfloat16
        inputs (quantized.py; CPU and lean forward only, else ValueError); "auto": int4 where that
        serves, else float. They change loaded.model in place, so only the owner of the model (a
        service) should ask for them."""
        self.loaded, self.model_thread = loaded, model_thread.shared()
        self.lean = self.model_thread.run(lean_forward_for, loaded) if lean else None  # None: transformers' forward serves
        if not lean:
            log.info("model passes: transformers' forward (asked for)")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
        missing = int4_missing(loaded, self.lean)
        if weights == "auto":  # asked for a model stored in 4 bits (specd_app.cli.weights_for)
            weights = "float" if missing else "int4"
            log.info("weights: auto → %s", f"float ({missing})" if missing else weights)
        self.weights = weights
        if weights == "int4":
            if missing:
                raise ValueError(f"--weights {missing}")
            self.run(lean_forward.pack_int4, self.lean, loaded.device)
            layouts = {autotune.PLAIN}  # no float32 product is left whose layout could be chosen
        # Layouts are the float32 products' (SwitchableLinear): where none was made switchable (a bfloat16 or
        # int4 model, transformers' linears) the plain weights serve every pass and must stay, so the plain
        # layout is the only one to time and keep (a copied layout timed faster by noise dropped them).
        switch = LayoutSwitch()
        switchable = loaded.device.type == "cpu" and make_linears_switchable(self._serving_module(), switch, set(layouts)) > 0
        kept = (set(layouts) & available_layouts()) or {autotune.PLAIN} if switchable else {autotune.PLAIN}
        self.tuning = tuning.PassRuntime(loaded.device, kept, switch)
        self._release_unused_originals()
        self.vocab_size, self.max_length = model_vocab_size(loaded), max_sequence_length(loaded)
        self.captured_layers: tuple[int, ...] = ()  # decoder layers (1-based) whose outputs are kept with the features
        self.store: Optional[flat_pass.KVStore] = None  # set by use_flat_pass: sessions hold slots, passes are flat
        self.passes = (passes.RaggedPasses(self.lean, loaded.device, self.tuning, self.weights == "int4") if self.lean is not None
                       else passes.TransformersPasses(loaded.model, loaded.device, self.tuning))

    @property
    def runtime(self) -> autotune.RuntimeChoice:
        """The threads and weight layout passes run on, per size (tuning.py)."""
        return self.tuning.choice

    @property
    def ragged(self) -> Optional[passes.RaggedPasses]:  # the ragged engine, where it serves the passes
        return self.passes if isinstance(self.passes, passes.RaggedPasses) else None

    @property
    def prompt_tiles(self) -> bool:
        """A ragged int4 pass attends a prompt's rows in tiles (lean_forward.prompt_tiles)."""
        return self.ragged is not None and self.ragged.tiles

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Also keep the outputs of decoder layers `layers` (1-based: hidden_states[l] in transformers'
        terms, before the final norm) wherever the final features are kept: what Medusa heads that fuse
        lower layers and EAGLE-3 heads read (verify_service/medusa.py, a session's feature_layers).
        Additive, so a session may ask for layers at run time (between passes, on the model thread);
        kept in ascending order, the order a pass produces them (`layer_slots` finds them)."""
        count = self.loaded.model.config.num_hidden_layers
        if not all(1 <= layer <= count for layer in layers):
            raise ValueError(f"layers {list(layers)} are not all among this model's decoder layers 1..{count}")
        self.captured_layers = tuple(sorted(set(self.captured_layers).union(layers)))

    def layer_slots(self, layers: Sequence[int]) -> list[int]:
        """Where captured `layers` sit along the L axis of a session's fed_layers [n, L, H]."""
        return [self.captured_layers.index(layer) for layer in layers]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the model's thread: for torch work on its outputs (an argmax over the
        logits, a softmax, heads), which would otherwise start a second OpenMP team on the caller's thread."""
        return self.model_thread.run(fn, *args, **kwargs)

    def tune(self, threads: int = 0, max_threads: int = 0, repeats: int = 5,
             measure: autotune.Measure = autotune.measure_now) -> autotune.RuntimeChoice:
        """Measure this model's passes on this machine and adopt the fastest runtime (tuning.tune)."""
        return self.run(tuning.tune, self, threads, max_threads, repeats, measure)

    def use_prompt_kernel(self, kernel: Optional[str]) -> None:
        """Prompt rows' products through the dense weight `kernel` (quantized.PROMPT_KERNELS), or int4 (None)."""
        self.passes.prompt_kernel = self.run(quantized.use_prompt_kernel, self.lean.layers, kernel)

    def use_only(self, layouts: set[str]) -> None:
        """Drop the weights of layouts no forward will use (frees their memory)."""
        self.tuning.use_only(self._serving_module(), layouts)
        self._release_unused_originals()

    def _release_unused_originals(self) -> None:
        """With the lean forward and no layout that reads the ordinary weights, transformers' decoder
        linears would keep a second copy of each weight alive (the lean pass has its own layouts):
        drop them. transformers' forward cannot run this model after that; nothing here calls it."""
        if self.lean is not None and self.loaded.device.type == "cpu" and not self.tuning.layouts & autotune.DENSE_LAYOUTS:
            self.lean.release_originals()

    def _serving_module(self) -> torch.nn.Module:
        """The module whose linears run the passes: the lean forward's, or transformers' model."""
        return self.lean if self.lean is not None else self.loaded.model

    def use_flat_pass(self, slots: int, capacity: int = 0, gather: Optional[bool] = None, kv_dtype: str = "auto") -> bool:
        """Serve every pass as one flat pass over a KV store allocated now, if it passes its start-up
        probes (flat_pass.serve_flat); returns whether it serves."""
        return flat_pass.serve_flat(self, slots, capacity, gather, kv_dtype)

    def new_session(self, prompt: Sequence[int], keep_features: bool = False, prefill: bool = True,
                    prompt_length: Optional[int] = None) -> KVSession:
        """A session holding `prompt`, with everything but the last token in its cache, or all of it and
        the next position's scores where the prefill scores the last token (prescores; prefill=False:
        nothing cached yet; the caller prefills it with prefill_feed, e.g. in chunks that share passes
        with other sessions: batching.py). `prompt_length`: how many of its tokens are the request's
        prompt (the rest are generated tokens replayed, scored as generated ones); None: all."""
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
            self.run(kv_cache.copy_into, session.cache, cache)
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
        position alone (the engine's positional_prompts: int4's per-row products and dense blocks of
        fixed size, with tiles cut by position or folded attention), so the first token is the same
        however the prompt was chunked and whatever shared its passes. Elsewhere (a float32 GEMM rounds
        a row by the chunk's row count) the first round scores the last token as a generated one."""
        return self.passes.positional_prompts

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

    @property
    def prefill_granule(self) -> int:
        """The prompt positions a pass's prefill chunks are best counted in: with a prompt kernel, blocks of
        quantized.PROMPT_BLOCK rows (a dense product pads to one, the prompt tiles dequantize every weight
        once a pass); PROMPT_TILE where tiles attend prompt rows; 1 where rows cost one by one."""
        if self.passes.prompt_kernel is not None:
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
        prompt_end = self.prompt_end(session)  # prompt rows: the positions before it (Feed.prompt_rows)
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
        positions = list(range(past, past + len(pending))) + [past + len(pending) - 1 + d for d in depth]
        pending_tree = PendingTree(len(session.tokens), list(tokens), list(parents)) if tokens else None
        scored = session.scored  # row 0 is the prefill's (then nothing is pending): the pass scores the nodes
        return Feed(session, pending + list(tokens), logits=len(tokens) + (scored is None), tree=pending_tree,
                    positions=positions, mask=tree_mask(past, len(pending), parents), scored=scored)

    def forward(self, session: KVSession, extra: Sequence[int] = ()) -> torch.Tensor:
        """Feed pending + extra tokens; return logits [len(extra) + 1, V] for the positions after
        the last committed token and after each extra token. `extra` joins the sequence (speculatively)."""
        return self.run_feeds([self.chain_feed(session, extra)])[0]

    def forward_tree(self, session: KVSession, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """tree_feed's pass alone: logits [len(tokens) + 1, V]."""
        return self.run_feeds([self.tree_feed(session, tokens, parents)])[0]

    def forward_batch(self, requests: Sequence[tuple[KVSession, Sequence[int]]]) -> list[torch.Tensor]:
        """`forward` for several distinct sessions in one pass; the i-th result is what
        forward(*requests[i]) returns ([len(extra_i) + 1, V]), up to float rounding."""
        return self.run_feeds([self.chain_feed(session, extra) for session, extra in requests])

    @on_model_thread
    def settle_tree(self, session: KVSession, path: Sequence[int]) -> None:
        """Keep the cache rows of `path` (node indices from the root, tree.path_of) after the committed
        tokens, in order, and append their tokens; drop the other nodes. No pending tree: nothing."""
        pending = session.tree
        if pending is None:
            return
        kv_cache.keep_rows(session.cache, pending.base, [pending.base + node for node in path])  # [1, H, base + len(path), D]
        session.tokens = session.tokens[: pending.base] + [pending.tokens[node] for node in path]
        session.cached, session.tree = len(session.tokens), None

    def check_room(self, session: KVSession, extra: Sequence[int]) -> None:
        """INVALID_ARGUMENT when the session plus `extra` would pass the model's context limit."""
        if len(session.tokens) + len(extra) > self.max_length:
            raise InvalidArgument(f"{len(session.tokens)} tokens + {len(extra)} drafts exceed the model's {self.max_length}-token limit")

    @on_model_thread
    @torch.inference_mode()
    def run_feeds(self, feeds: Sequence[Feed]) -> list[Optional[torch.Tensor]]:
        """One pass over distinct sessions' feeds (passes.py), then each session takes its rows back:
        each feed's logits [feed.logits, V] (a round's row 0 the prefill's where it scored it; None for a
        prefill chunk), its features kept where asked, and the session moved on (a chain's drafts join
        its tokens, a tree waits for settle_tree, a chunk is cached). Feeds with no rows (a round whose
        row 0 the prefill scored, with no drafts) run no pass."""
        if len({id(feed.session) for feed in feeds}) != len(feeds):
            raise ValueError("a pass must not hold the same session twice")
        starts = [feed.session.cache.get_seq_length() for feed in feeds]
        for feed, start in zip(feeds, starts):  # a prompt row is one by its position alone
            feed.prompt_rows = 0 if feed.is_round else max(0, min(len(feed.tokens), self.prompt_end(feed.session) - start))
        out = self.passes.run(feeds, starts, self.captured_layers) if any(feed.tokens for feed in feeds) else None
        results, row, at = [], 0, 0
        for feed, start in zip(feeds, starts):
            n, session = len(feed.tokens), feed.session
            hidden = out.hidden[at : at + n] if n and out.hidden is not None else None  # [n, H]
            layers = out.layers[at : at + n] if n and out.layers is not None else None  # [n, L, H]
            wanted = feed.logit_rows
            logits = out.logits[row : row + wanted] if wanted else None  # [wanted, V]
            row, at = row + wanted, at + n
            if feed.is_round:
                results.append(session.take_round(feed, start, logits, hidden, layers))
            else:
                session.take_prefill_chunk(feed, start, self.prefill_end(session), logits, hidden, layers)
                results.append(None)
        return results

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
