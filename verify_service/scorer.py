"""The target side of a round: apply the commit, one forward over pending + drafted tokens, report p."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from specd.v1 import common_pb2, verify_pb2
from specd_common import tree
from specd_engine import autotune, flat_pass, kv_cache, quantized, runtime_cache, store_attention
from specd_engine.autotune import COLS, MKL, PLAIN, PREPACKED, ROWS, TALL
from specd_engine.batching import Again, BatchPolicy, make_batcher
from specd_common.config import ServerConfig, StartupMeasurement
from specd_common.errors import require
from specd_engine.features import encode_features
from specd_engine.lm import PREFILL_CHUNK, CausalLM
from specd_engine.sessions import KVSession
from specd_engine.models import LoadedModel, describe_model, synchronize
from specd_common.params import Warp
from specd_common.sequence import common_prefix
from specd_engine.warping import constrained, draw_walk, encode_rows, warp_probs
from verify_service.medusa import MedusaHeads

log = logging.getLogger(__name__)


@dataclass
class VerifySession:
    """One request's target state: token sequence with KV cache, and its warping."""

    sequence: KVSession
    warp: Warp
    feature_layers: tuple[int, ...] = ()  # the layers its feature rows hold side by side; (): the final hidden state


@dataclass
class Scores:
    """The target's view of k + 1 positions: argmax ids when greedy; when sampling the coupled rule's
    draws (Draw) or encoded p."""

    argmax_token_ids: list[int] = field(default_factory=list)  # [k + 1] (greedy)
    target_probs: list[common_pb2.Distribution] = field(default_factory=list)  # [k + 1] (sampling without a Draw, or asked)
    sampled_token_ids: list[int] = field(default_factory=list)  # [k + 1] (sampling with a Draw; UNDRAWN off the walk)
    features: Optional[common_pb2.TargetFeatures] = None  # the positions read, when asked for
    head_drafts: Optional[common_pb2.HeadDrafts] = None  # the Medusa heads' proposals there, when asked for
    logprobs: list[verify_pb2.RowLogprobs] = field(default_factory=list)  # [k + 1] greedy rows' likeliest tokens, when asked for


@dataclass(frozen=True)
class Draw:
    """VerifyRequest.coupled_draw: the verify draws a sampled session's token at each row."""

    seed: int
    positions: Sequence[int]  # [k + 1]: the position each row draws (a chain's consecutive; a tree's by depth)
    with_probs: bool = False  # target_probs too (the caller reports log probabilities)


@dataclass(frozen=True)
class Part:
    """One session's part of a pass, and what its reply carries besides the scores."""

    session: VerifySession
    drafts: Sequence[int]  # the drafted tokens scored after the pending one(s)
    features: bool = False
    head_drafts: bool = False
    head_candidates: int = 1  # per head, when head_drafts
    parents: Sequence[int] = ()  # the drafts' tree (specd_common/tree.py); () for a chain
    head_rows: int = 0  # a sampled chain: proposals at the first head_rows rows from the pending token's (0: all)
    allowed: Optional[torch.Tensor] = None  # [k + 1, V] bool: the tokens a grammar allows at each row (structured output)
    top_logprobs: int = 0  # greedy: the likeliest tokens of each row to return with their log probabilities
    draw: Optional[Draw] = None  # sampling: the verify draws each row's token (the coupled rule)
    head_depth: int = 0  # when head_drafts: proposals of the first head_depth heads (0: all)
    steps: int = 1  # plain decoding: passes this call may run, each from the last one's token (VerifyRequest.plain_steps)
    stop_ids: frozenset = frozenset()  # with steps: tokens after which no further pass runs
    produced: list = field(default_factory=list)  # with steps: the tokens of the passes run so far

    def again(self, own: torch.Tensor, room: bool) -> bool:
        """Whether this part's next pass runs in the same call: its chosen token own [1] is not the last
        of its steps nor a stop token, and the session has `room` for one more."""
        return room and len(self.produced) + 1 < self.steps and int(own[0]) not in self.stop_ids


class HeadInputs(NamedTuple):
    """What the Medusa heads read for one session's proposals (Scorer.head_inputs)."""

    first: int  # the first row's position less the first position the session's last forward read
    features: torch.Tensor  # [m, H]
    next_tokens: torch.Tensor  # [m]: each row's own next token
    layers: Optional[torch.Tensor]  # [m, L, H]: the fused layers' outputs, for heads that fuse them; else None


PREFILL_TIMING_TOKENS = 256  # a chat prompt's size: long enough that the pass's fixed cost is spread thin
PREPACK_CHOICES = {"auto": set(autotune.LAYOUTS), "on": {PREPACKED}, "mkl": {MKL}, "tall": {TALL}, "cols": {COLS}, "rows": {ROWS},
                   "off": {PLAIN}}


def attention_mode(lm: CausalLM) -> str:
    """How the passes attend, for keys of cached timings: specd's kernel (its build), folded or SDPA calls over
    the flat store, or the ragged pass's calls (a row's query block, or a call a row)."""
    if lm.lean is None:
        return "transformers"
    if lm.store is not None:
        layers = "-native-layers" if lm.passes.native_layers else ""
        return f"native-{store_attention.identity()}{layers}" if lm.passes.native else "fold" if lm.passes.fold else "sdpa"
    return "a call a row" if lm.lean.query_per_call else f"query block {lm.lean.layers[0].query_block}"


class Scorer:
    """Wraps the target model for many sessions.

    On a CPU it first measures its own forward passes (CausalLM.tune): torch threads (unless
    `threads` > 0; at most `max_threads` > 0) and the linear-weight layout per forward size, among those `prepack` allows
    (auto: all, measured; on: oneDNN-prepacked; mkl: MKL's packed one-row GEMM, else plain; tall: W·xᵀ
    for tall weights, else plain; cols: W·xᵀ for every weight; rows: x·Wᵀ from a transposed copy;
    off: PyTorch's plain layout; specd_engine.layouts.SwitchableLinear), then its KV-token budget and, when it
    batches, what batched rounds cost (measure_batch_costs). `forward`: auto runs the passes with
    specd_engine/lean_forward.py where it serves the model, as one flat pass over a KV store where
    flat_pass.why_not_by_default allows (an int4 CPU verify with specd's attention kernel), transformers
    keeps transformers'. With `medusa`
    heads (verify_service/medusa.py) a Verify may also return their proposals."""

    def __init__(self, loaded: LoadedModel, batching: BatchPolicy = BatchPolicy(), threads: int = 0, prepack: str = "auto",
                 max_threads: int = 0, kv_token_budget: int = 0, medusa: Optional[MedusaHeads] = None, forward: str = "auto",
                 startup: StartupMeasurement = StartupMeasurement(), weights: str = "float",
                 max_sessions: int = ServerConfig.max_sessions, kv_dtype: str = "auto"):
        if prepack not in PREPACK_CHOICES:
            raise ValueError(f"prepack must be one of {sorted(PREPACK_CHOICES)}, not {prepack!r}")
        if kv_dtype not in autotune.KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(autotune.KV_DTYPES)}, not {kv_dtype!r}")
        if forward not in autotune.FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(autotune.FORWARDS)}, not {forward!r}")
        self._info = describe_model(loaded)  # before tuning, which may drop the plain weights it reads
        self._info.hidden_size = loaded.model.config.hidden_size
        self.medusa = medusa.to(loaded.device) if medusa is not None else None
        self._info.medusa_heads = medusa.config.num_heads if medusa is not None else 0
        self.lm = CausalLM(loaded, layouts=PREPACK_CHOICES[prepack], lean=forward != "transformers", weights=weights)
        kv_tokens = self.kv_token_budget(kv_token_budget)
        if forward == "flat" or forward == "auto" and not flat_pass.why_not_by_default(self.lm):
            # a slot for every session the verify holds and every one its start-up timings hold at once; on a CPU
            # each spans the model's context (its pages are the system's until used, and go back when it is
            # released: the KV budget bounds what sessions hold), on a GPU its share of the budget
            slots = max_sessions + batching.max_batch_size + 1
            capacity = 0 if loaded.device.type == "cpu" else flat_pass.slot_capacity(kv_tokens, slots)
            self.lm.use_flat_pass(slots, capacity, kv_dtype=kv_dtype)
        if self.medusa is not None and self.medusa.config.fusion_layers:
            self.lm.capture_layers(self.medusa.config.fusion_layers)
        timings = runtime_cache.StartupTimings.open("verify", self.timing_key(threads, max_threads, batching), startup.cache_dir,
                                                    startup.remeasure, startup.budget_s)
        runtime = self.lm.tune(threads, max_threads, measure=timings.measure)
        runtime.kv_token_budget = kv_tokens
        runtime.weights = self.lm.weights
        if self.medusa is not None:  # on the model thread, at its thread count
            runtime.heads_product = self.lm.run(self.medusa.tune_product, measure=timings.measure)
        self.batcher = make_batcher(self.lm, batching, finish=self._finish)  # None: one session per forward
        if self.batcher is not None:  # what a batch costs as its rows draft: the gateway's speculation cap reads it
            costs = self.measure_batch_costs(autotune.priced_rows(batching.max_batch_size), measure=timings.measure)
            runtime.session_costs_ms = costs.pop(1, {})  # the batches' own baseline (autotune.pass_pricing), not a batch
            runtime.batch_costs_ms = costs
        self._info.runtime_profile.prefill_ms_per_token = self.measure_prefill_cost(measure=timings.measure)
        timings.finish()
        if runtime.source == "measured":
            runtime.source = timings.source
        log.info("verify runtime: %s", runtime.summary())
        self._info.runtime_config = runtime.summary()
        self._info.runtime_profile.ragged = self.batcher is not None and self.lm.lean is not None  # CausalLM.run_feeds
        self._info.runtime_profile.batch_costs.extend(
            common_pb2.BatchCost(rows=rows, positions=positions, milliseconds=ms)
            for rows, by_positions in runtime.batch_costs_ms.items() for positions, ms in by_positions.items())
        self._info.runtime_profile.pass_costs.extend(  # the gateway's prices of round sizes it has not served yet
            common_pb2.BatchCost(rows=1, positions=positions, milliseconds=ms) for positions, ms in runtime.pass_costs_ms().items())

    def timing_key(self, threads: int, max_threads: int, batching: BatchPolicy) -> dict:
        """What the start-up timings depend on (specd_engine/runtime_cache.py): the machine, the model, and
        what this verify times (the layouts and forward it may use, the thread counts it tries, the sizes
        of its passes, its batches and its heads)."""
        loaded = self.lm.loaded
        return {
            **runtime_cache.machine_key(str(loaded.device)), **runtime_cache.model_key(loaded.name, loaded.model),
            "layouts": sorted(self.lm.tuning.layouts), "lean": self.lm.lean is not None, "flat": self.lm.store is not None,
            "kv_dtype": self.lm.store.kv_dtype if self.lm.store is not None else "",
            "weights": self.lm.weights, "int4_kernel": quantized.products_kernel(self.lm.lean.layers) if self.lm.lean is not None else "",
            "key_block": kv_cache.KEY_BLOCK, "threads": autotune.threads_to_try(threads, max_threads),
            "positions": list(autotune.timed_sizes(self.lm.weights)), "batch_rows": autotune.priced_rows(batching.max_batch_size),
            "batch_positions": list(autotune.BATCH_POSITIONS), "batch_context": autotune.BATCH_CONTEXT,
            "medusa": runtime_cache.digest(self.medusa.config) if self.medusa is not None else "",
            "prefill_tokens": PREFILL_TIMING_TOKENS, "attention": attention_mode(self.lm),
        }

    def measure_batch_costs(self, rows: Sequence[int], positions: Sequence[int] = autotune.BATCH_POSITIONS,
                            repeats: int = 3, context: int = autotune.BATCH_CONTEXT,
                            measure: autotune.Measure = autotune.measure_now) -> dict[int, dict[int, float]]:
        """Milliseconds of the model's work for one batched round in which b sessions score n positions
        each, for every b in rows and n in positions (medians of interleaved rounds): the padded pass,
        then each row's argmax and, when n > 1 and there are heads, the heads' proposals (a gateway
        asks for them only while it speculates). Single-session costs do not tell this: a batch pads
        every row to the longest and packs every row's cache, so drafts in a busy batch cost every
        request in it. On the model's thread."""
        if not rows:
            return {}
        prompt = self._timing_prompt(context)
        sessions: list[VerifySession] = []  # filled when the runs are made: not at all when the timings are cached
        draft, next_token = 2 % self.lm.vocab_size, 1 % self.lm.vocab_size  # distinct: a commit drops the drafts

        def batched_round(b: int, n: int) -> Callable[[], None]:
            drafts, heads = [draft] * (n - 1), n > 1 and self.medusa is not None

            def run() -> None:
                for session in sessions[:b]:
                    session.sequence.keep_features = heads
                logits = self.lm.forward_batch([(session.sequence, drafts) for session in sessions[:b]])
                self._replies([Part(session, drafts, head_drafts=heads) for session in sessions[:b]], logits)
                synchronize(self.lm.loaded.device)  # this service's GPU, not the current one
                for session in sessions[:b]:  # as if no draft was accepted
                    session.sequence.apply_commit(len(session.sequence.tokens) - (n - 1), [next_token])

            return run

        def runs() -> dict:
            first = self.lm.new_session(prompt)  # not via the batcher: this runs on the model thread; copied, not prefilled again
            first.apply_commit(len(first.tokens), [next_token])  # a token pending, as in every round after the first
            sessions.extend(VerifySession(self.lm.copy_session(first) if i else first, Warp()) for i in range(max(rows)))
            return {(self.lm.runtime.threads_for(b * n) or threads, b, n): batched_round(b, n) for b in rows for n in positions}

        threads = torch.get_num_threads()
        costs = measure("batch costs", runs, repeats)
        torch.set_num_threads(threads)
        table: dict[int, dict[int, float]] = {}
        for (_, b, n), seconds in costs.items():
            table.setdefault(b, {})[n] = round(seconds * 1000, 2)
        return table

    def measure_prefill_cost(self, tokens: int = PREFILL_TIMING_TOKENS, repeats: int = 2,
                             measure: autotune.Measure = autotune.measure_now) -> float:
        """Milliseconds per prompt token of one prompt of `tokens` prefilled alone (0.0 when the start-up
        budget left no time): the gateway's first estimate of a new request's time to first token
        (gateway/admission.py), before it has measured prompts of its own."""
        prompt = self._timing_prompt(tokens)

        def runs() -> dict:  # keyed (threads, positions), as every timing: the run is timed at its thread count
            return {(self.lm.runtime.threads_for(PREFILL_CHUNK) or threads, len(prompt)): lambda: self.lm.new_session(prompt)}

        threads = torch.get_num_threads()
        timed = measure("prefill cost", runs, repeats)
        torch.set_num_threads(threads)
        return round(next(iter(timed.values())) * 1000 / (len(prompt) - 1), 4) if timed else 0.0

    def _timing_prompt(self, tokens: int) -> list[int]:
        """A prompt of `tokens` ids (at most half the context) for start-up timings: any ids do."""
        return [i % self.lm.vocab_size for i in range(1, min(tokens, self.lm.max_length // 2) + 1)]

    def kv_token_budget(self, requested: int) -> int:
        """Positions all sessions may hold: `requested` when > 0, none when < 0, else derived from the
        memory free after loading and the target's KV bytes per position (autotune.kv_token_budget)."""
        if requested:
            return max(requested, 0)
        loaded = self.lm.loaded
        element = next(loaded.model.parameters()).element_size()
        per_token = autotune.kv_bytes_per_token(loaded.model.config, element)
        return autotune.kv_token_budget(per_token, autotune.available_memory_bytes(str(loaded.device)))

    def info(self) -> common_pb2.GetModelInfoResponse:
        """What this verify serves, with its runtime as it stands (serving trials settle sizes after start-up;
        the batch costs in runtime_profile are measured once, at start-up)."""
        self._info.runtime_config = self.lm.runtime.summary()
        return self._info

    def open(self, prompt: Sequence[int], warp: Warp, keep_features: bool = False,
             wanted: Callable[[], bool] = lambda: True, feature_layers: Sequence[int] = (),
             prompt_length: Optional[int] = None) -> VerifySession:
        """A session holding `prompt`; with batching its prefill shares passes with other sessions' rounds
        and stops (Cancelled) between chunks once `wanted()` is False (the caller went away). With
        `feature_layers` its features are those layers' outputs side by side (an EAGLE-3 head's).
        `prompt_length`: how many of its tokens are the request's prompt (None: all; the rest are
        generated tokens replayed)."""
        layers = self.check_feature_layers(feature_layers)
        if set(layers) - set(self.lm.captured_layers):  # the first session to ask: hooks added between passes
            self.lm.run(self.lm.capture_layers, layers)
        session = self.lm.new_session(prompt, keep_features, prefill=self.batcher is None, prompt_length=prompt_length)
        if self.batcher is not None:
            self.batcher.prefill(session, wanted)
        return VerifySession(session, warp, layers)

    def close(self, session: VerifySession) -> None:
        """The session was released or expired: the batcher stops scheduling around it."""
        if self.batcher is not None:
            self.batcher.forget(session.sequence)

    def check_feature_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """`layers` as a tuple; INVALID_ARGUMENT unless they are all decoder layers of this target."""
        count = self.lm.loaded.model.config.num_hidden_layers
        require(all(1 <= layer <= count for layer in layers),
                f"feature_layers {list(layers)} must be in 1..{count} (this target's decoder layers, transformers' "
                "hidden_states numbering)")
        return tuple(layers)

    def last_features(self, session: VerifySession) -> Optional[common_pb2.TargetFeatures]:
        """The features of the positions the session's last forward read (None unless it keeps them),
        encoded on the model's thread (a prompt's [n, H] conversion is parallel torch work)."""
        sequence = session.sequence
        if not sequence.keep_features or sequence.fed_features is None:
            return None
        if not session.feature_layers:
            return self.lm.run(encode_features, sequence.fed_features, sequence.fed_start)
        layers = sequence.fed_layers[:, self.lm.layer_slots(session.feature_layers)]  # [n, len(feature_layers), H]
        return self.lm.run(encode_features, layers.flatten(1), sequence.fed_start)  # rows [n, len(feature_layers) × H]

    def head_inputs(self, session: VerifySession, own: torch.Tensor, drafts: Sequence[int],
                    parents: Sequence[int] = (), head_rows: int = 0, drawn: bool = False) -> Optional[HeadInputs]:
        """What the Medusa heads read for the session's proposals (HeadInputs); None without heads or kept
        features. own [j] is the target's argmax at that pass's last j rows (after the
        pending token and each draft): a row's own next token, which heads with the token input read;
        for rows before those (committed tokens read late) it is the committed token after it. A greedy
        session gets only the row the caller will read: the gateway keeps exactly the drafts that equal
        the target's argmax, so its last committed token is the argmax after them (so does a sampling
        session whose tokens the verify draws, `drawn`: own holds the draws); after a tree
        (parents), the row of the last node of the path the target's argmax walks (tree.greedy_path),
        whose position is the root's plus the path's length. A sampling session gets every row, after
        a tree too (then in node order after the committed rows, like the features: the gateway
        picks the row of the path it sampled); after a chain only the first `head_rows` rows from the
        pending token's when that is > 0 (the rows the gateway is likely to keep: each row costs the
        heads' product)."""
        sequence = session.sequence
        if self.medusa is None or not sequence.keep_features or sequence.fed_features is None:
            return None
        features = sequence.fed_features  # [n, H]: positions fed_start .. fed_start + n - 1
        earlier = features.shape[0] - own.shape[0]
        committed = torch.tensor(sequence.tokens[sequence.fed_start + 1 : sequence.fed_start + 1 + earlier], dtype=torch.long)
        next_tokens = torch.cat((committed.to(own.device), own))  # [n]
        fusion = self.medusa.config.fusion_layers
        layers = sequence.fed_layers[:, self.lm.layer_slots(fusion)] if fusion else None  # [n, L, H] the heads fuse
        if not session.warp.greedy and not drawn:
            if parents or head_rows <= 0:
                return HeadInputs(0, features, next_tokens, layers)
            rows = slice(earlier, earlier + head_rows)
            return HeadInputs(earlier, features[rows], next_tokens[rows], layers[rows] if layers is not None else None)
        if parents:
            path = tree.greedy_path(drafts, parents, own.tolist())
            first, row = earlier + len(path), earlier + (path[-1] + 1 if path else 0)
        else:
            first = row = earlier + common_prefix(list(drafts), own[: len(drafts)].tolist())
        rows = slice(row, row + 1)
        return HeadInputs(first, features[rows], next_tokens[rows], layers[rows] if layers is not None else None)

    def head_drafts(self, parts: Sequence[Part], owns: Sequence[torch.Tensor]) -> list[Optional[common_pb2.HeadDrafts]]:
        """The Medusa heads' proposals for each part that asks for them (None for the others), from one
        propose over all their rows: the heads' cost is reading their V' × H rows once a head per call,
        plus a little a row (on the 2-core AMD EPYC, one row 3.2 ms, four rows 4.7 ms), so a batch's
        sessions share it; the heads run as deep as the deepest part asks (VerifyRequest.head_depth),
        and each part gets its own depth's."""
        inputs = [self.head_inputs(part.session, own, part.drafts, part.parents, part.head_rows, part.draw is not None)
                  if part.head_drafts else None for part, own in zip(parts, owns)]
        asked = [item for item in inputs if item is not None]
        if not asked:
            return [None] * len(parts)
        layers = torch.cat([item.layers for item in asked]) if asked[0].layers is not None else None  # [rows, L, H]
        candidates = max(part.head_candidates for part, item in zip(parts, inputs) if item is not None)
        depths = [part.head_depth or len(self.medusa.heads) for part, item in zip(parts, inputs) if item is not None]
        features = torch.cat([item.features for item in asked])  # [rows, H]
        next_tokens = torch.cat([item.next_tokens for item in asked])  # [rows]
        proposals, confidences = self.medusa.ranked(features, next_tokens, layers, candidates, max(depths))  # [rows, K, c] each
        replies, row = [], 0
        for part, item in zip(parts, inputs):
            if item is None:
                replies.append(None)
                continue
            mine, heads = slice(row, row + item.features.shape[0]), min(part.head_depth or proposals.shape[1], proposals.shape[1])
            row += item.features.shape[0]
            replies.append(common_pb2.HeadDrafts(start_position=part.session.sequence.fed_start + item.first,
                                                 heads=heads, candidates=part.head_candidates,
                                                 token_ids=proposals[mine, :heads, : part.head_candidates].flatten().tolist(),
                                                 confidences=confidences[mine, :heads, : part.head_candidates].flatten().tolist()))
        return replies

    def settle_tree(self, session: VerifySession, prefix_length: int, append: Sequence[int]) -> None:
        """Before a commit: keep the cache entries of the last tree's path that the commit's tokens
        follow (specd_common/tree.py), drop the other nodes'. Nothing when no tree is pending."""
        pending, tokens = session.sequence.tree, session.sequence.tokens
        if pending is None:
            return
        committed = tokens[:prefix_length] + list(append)
        walk = committed[pending.base :] if committed[: pending.base] == tokens[: pending.base] else []
        self.lm.settle_tree(session.sequence, tree.path_of(pending.tokens, pending.parents, walk))

    def score(self, session: VerifySession, draft_token_ids: Sequence[int], parents: Sequence[int] = (),
              features: bool = False, head_drafts: bool = False, head_candidates: int = 1, head_rows: int = 0,
              allowed: Optional[torch.Tensor] = None, top_logprobs: int = 0,
              coupled: Optional[verify_pb2.CoupledDraw] = None, head_depth: int = 0, steps: int = 1,
              stop_ids: Sequence[int] = ()) -> Scores:
        """One target forward over the pending token(s) and the drafts: k + 1 next-token positions
        (a tree's nodes when `parents` is given, in node order), with the target's features and the
        Medusa heads' proposals (head_candidates a head) there when asked for (head_inputs: which
        rows; head_rows: how many a sampled chain asks for), over the tokens `allowed` [k + 1, V] at each
        row when a grammar constrains the answer (and, greedy, each row's top_logprobs likeliest tokens);
        a sampled session with `coupled` gets each row's drawn token instead of its p. Concurrent
        sessions' rounds, chains and trees, share one pass when batching is on, and the batch's replies
        are made together (_finish). With `steps` > 1 (no drafts) the call decodes up to that many
        passes, each from the last one's token, stopping after a token in `stop_ids`: the reply holds
        one token a pass (Part.again; ForwardBatcher's Again)."""
        session.sequence.keep_features = features or (head_drafts and self.medusa is not None)
        draw = None
        if coupled is not None and not session.warp.greedy:
            base = len(session.sequence.tokens)  # row 0 draws the position after the committed tokens
            depths = tree.depths(parents) if parents else range(1, len(draft_token_ids) + 1)
            draw = Draw(coupled.seed, [base] + [base + depth for depth in depths], coupled.return_target_probs)
        part = Part(session, draft_token_ids, features, head_drafts, max(head_candidates, 1), parents, head_rows, allowed,
                    top_logprobs, draw, head_depth, max(steps, 1), frozenset(stop_ids))
        while True:
            if self.batcher is not None and not (session.sequence.scored is not None and not draft_token_ids):  # else: no pass
                reply = self.batcher.forward(session.sequence, draft_token_ids, part, parents=list(parents) if parents else None)
            else:
                if parents:
                    logits = self.lm.forward_tree(session.sequence, draft_token_ids, parents)  # [n + 1, V]
                else:
                    logits = self.lm.forward(session.sequence, draft_token_ids)  # [k + 1, V]
                reply = self._finish([part], [logits])[0]
            if isinstance(reply, Exception):
                raise reply
            if not isinstance(reply, Again):  # the batcher runs a part's further passes itself; alone, they run here
                return reply
            session.sequence.apply_commit(len(session.sequence.tokens), [reply.token])

    def _finish(self, parts: list[Part], logits: list[torch.Tensor]) -> list[Union[Scores, Exception]]:
        """What each part's Verify returns, from its logits [k + 1, V] (ForwardBatcher's finish): its
        Scores, or the exception its Verify fails with."""
        return self.lm.run(self._replies, parts, logits)

    def _replies(self, parts: Sequence[Part], logits: Sequence[torch.Tensor]) -> list[Union[Scores, Exception]]:
        """_finish on the model's thread (its torch work would start a second OpenMP team anywhere
        else: specd_engine/model_thread.py). A part whose reply fails gets its exception instead, and
        the batch's other sessions their replies: one session's fault (its warp, the heads' product it
        asked for) fails that session's Verify alone."""
        choices = [self._choice(part, rows) for part, rows in zip(parts, logits)]  # (probs, own) each, or its exception
        again = {index for index, (part, choice) in enumerate(zip(parts, choices)) if not isinstance(choice, Exception)
                 and part.again(choice[1], len(part.session.sequence.tokens) < self.lm.max_length - 1)}
        for index in again:
            parts[index].produced.append(int(choices[index][1][0]))
        live = [index for index, choice in enumerate(choices) if not isinstance(choice, Exception) and index not in again]
        try:
            heads: list = self.head_drafts([parts[i] for i in live], [choices[i][1] for i in live])
        except Exception as error:  # handed to the sessions that asked, as their Verify's error
            log.exception("the Medusa heads' proposals failed for %d session(s)", sum(parts[i].head_drafts for i in live))
            heads = [error if parts[i].head_drafts else None for i in live]
        proposals = dict(zip(live, heads))
        return [Again(parts[index].produced[-1]) if index in again else choice if isinstance(choice, Exception)
                else self._reply(part, rows, *choice, proposals[index])
                for index, (part, rows, choice) in enumerate(zip(parts, logits, choices))]

    @staticmethod
    def _choice(part: Part, rows: torch.Tensor) -> Union[tuple[Optional[torch.Tensor], torch.Tensor], Exception]:
        """A part's warped p [k + 1, V] (sampling; else None) and the target's choice at each row own
        [k + 1]: greedy's argmax, the coupled rule's draw (part.draw), or else the argmax as the heads'
        guess of a sampled row's token; or the exception that stopped it (its warp: that session's alone)."""
        warp = part.session.warp
        try:
            probs = None if warp.greedy else warp_probs(rows, warp, part.allowed)
            if part.draw is not None and probs is not None:  # a plain step draws its own position (Part.produced)
                positions = [position + len(part.produced) for position in part.draw.positions]
                return probs, draw_walk(probs, part.draw.seed, positions, part.drafts, part.parents)
            return probs, torch.argmax(constrained(rows, warp, part.allowed), dim=-1)
        except Exception as error:
            return error

    def _reply(self, part: Part, rows: torch.Tensor, probs: Optional[torch.Tensor], own: torch.Tensor,
               heads: Union[common_pb2.HeadDrafts, Exception, None]) -> Union[Scores, Exception]:
        """One part's Scores from its logits rows [k + 1, V], warped probs [k + 1, V] (sampling) and
        choices own [k + 1], or the exception that stopped it."""
        if isinstance(heads, Exception):
            return heads
        try:
            features = self.last_features(part.session) if part.features else None
            if part.session.warp.greedy:
                logprobs = top_logprobs(constrained(rows, part.session.warp, part.allowed), part.top_logprobs)
                return Scores(argmax_token_ids=part.produced + own.tolist(), features=features, head_drafts=heads, logprobs=logprobs)
            if part.draw is not None:
                return Scores(sampled_token_ids=part.produced + own.tolist(), target_probs=encode_rows(probs) if part.draw.with_probs else [],
                              features=features, head_drafts=heads)
            return Scores(target_probs=encode_rows(probs), features=features, head_drafts=heads)
        except Exception as error:  # this session's Verify fails with it (grpc_errors maps it)
            return error


def top_logprobs(scores: torch.Tensor, n: int) -> list[verify_pb2.RowLogprobs]:
    """Each row's n likeliest tokens and their log probabilities under softmax(scores) (scores [k + 1, V]:
    the logits after logit_bias and a grammar's mask); tokens a grammar forbids are never listed. [] for n = 0."""
    if n <= 0:
        return []
    logprobs = torch.log_softmax(scores.float(), dim=-1)  # [k + 1, V]
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)  # [k + 1, n]
    rows = []
    for row_values, row_ids in zip(values.tolist(), ids.tolist()):
        listed = [(token, value) for token, value in zip(row_ids, row_values) if value > float("-inf")]
        rows.append(verify_pb2.RowLogprobs(token_ids=[t for t, _ in listed], logprobs=[v for _, v in listed]))
    return rows
