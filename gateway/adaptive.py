"""Adaptive draft length: each round, the k that maximizes expected tokens per second.

Expected tokens from one round with per-token acceptance α and k drafts are (1 − α^(k+1)) / (1 − α)
(Leviathan et al. 2023); a round costs a Verify over k + 1 positions plus a Propose of k tokens.
Both costs are measured live by the gateway (they depend on the hardware, the batch and the network,
so no constant is baked in), and α is estimated per request from its own rounds. k = 0 (a plain
target step) is always a candidate, so a request whose drafts keep failing stops paying for them.

Once requests share verify passes, one request's drafts cost the others too (a batch pads every row
to the longest): speculation_cap bounds how many requests may speculate at once, from the verify's
measured batch costs and the shape of the rounds measured here (RoundShapes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

from gateway.policy import POLICY, SpeculationPolicy
from specd_common import tree
from specd_common.cost_curve import interpolate


def expected_tokens(chain: Sequence[float], k: int, rescue: Sequence[float] = ()) -> float:
    """Expected tokens from a round of k drafts when draft i is accepted with probability chain[i-1]
    given that drafts 1..i-1 were (positions past a list's end repeat its last value):
    1 + Σ_j Π_{i≤j} chain[i-1]. With one value α this is (1 − α^(k+1)) / (1 − α).

    rescue: a tree of the chain with alternatives beside each draft as leaves (tree.chain_with_leaves);
    rescue[i-1] is the probability that one of draft i's alternatives is the target's token when
    draft i is not. Then the round keeps at least j tokens when drafts 1..j-1 were kept and draft j
    or an alternative of it was: 1 + Σ_j reach_{j-1} (a_j + (1 − a_j) s_j), reach_j = Π_{i≤j} a_i."""
    total, reach = 1.0, 1.0
    for i in range(k):
        accepted = chain[min(i, len(chain) - 1)] if chain else 0.0
        rescued = rescue[min(i, len(rescue) - 1)] if rescue else 0.0
        total += reach * (accepted + (1.0 - accepted) * rescued)
        reach *= accepted
    return total


def extrapolate(costs: dict[int, float], positions: int) -> float:
    """Cost at `positions` from measured sizes: linear between neighbours, flat below the smallest,
    above the largest along the two largest's slope (a pass grows with its positions; never down)."""
    sizes = sorted(costs)
    if positions > sizes[-1] and len(sizes) >= 2:
        low, high = sizes[-2:]
        return costs[high] + max(0.0, (costs[high] - costs[low]) / (high - low)) * (positions - high)
    return interpolate(costs, positions)


def best_rate(acceptance: Union[float, Sequence[float]], max_k: int, round_cost_s: Callable[[int], float],
              rescue: Sequence[float] = ()) -> tuple[int, float]:
    """The k in [0, max_k] that maximizes expected tokens per second (ties: the smaller k) and that rate.

    acceptance: one per-token rate α, or the conditional rate per draft position (measured rates fall
    with the position, so one α over-promises long drafts); rescue: the drafts carry alternatives
    (expected_tokens), which round_cost_s prices."""
    chain = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    best_k, best = 0, -1.0
    for k in range(max_k + 1):
        rate = expected_tokens(chain, k, rescue) / max(round_cost_s(k), 1e-9)
        if rate > best * (1 + 1e-9):
            best_k, best = k, rate
    return best_k, best


def best_shape(chain: Sequence[float], length: int, rescue: Optional[Sequence[float]],
               round_cost_s: Callable[[int, int], float]) -> tuple[int, int, float]:
    """The round that maximizes expected tokens per second among chains of k ≤ `length` drafts and,
    when `rescue` is given, trees of that chain with alternatives beside its first w drafts
    (tree.chain_with_leaves): (k, w, tokens/s), w = 0 for a chain (ties: the fewest alternatives).

    chain: the drafts' conditional acceptance per position (AcceptanceEstimate.chain(length));
    rescue: per position, the chance an alternative holds the target's token where the draft misses
    (None: chains only); round_cost_s(k, w): the measured seconds of such a round. Alternatives are
    worth most early, where a chain misses first."""
    best = (0, 0, -1.0)
    for widened in range(length + 1) if rescue is not None else range(1):
        rescued = list(rescue[:widened]) + [0.0] * (length - widened) if widened else ()
        k, rate = best_rate(chain, length, lambda k: round_cost_s(k, widened), rescued)
        if rate > best[2] * (1 + 1e-9):
            best = (k, min(widened, k), rate)
    return best


def node_values(confidences: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """[(value, depth, rank)] for every candidate of the Medusa heads (confidences[d][r]: head d + 1's
    probability of its r-th candidate, best first): the product of the probabilities along its path,
    the chain of each head's best, where a later candidate of head d hangs off the chain's node d − 1
    (chained heads read the earlier heads' best). Calibrated heads make it the chance that the node
    is the target's token (confident_tree)."""
    nodes, reach = [], 1.0
    for depth, probs in enumerate(confidences):
        nodes += [(reach * p, depth, rank) for rank, p in enumerate(probs)]
        reach *= probs[0] if probs else 0.0
    return nodes


class TreeNode(NamedTuple):
    """A candidate node of a round's tree: the tokens from the root to it, and its value, the chance it
    is the target's token there (calibrated); never above its parent's value."""

    path: tuple[int, ...]
    value: float


def head_nodes(tokens: Sequence[Sequence[int]], confidences: Sequence[Sequence[float]],
               scales: Sequence[float] = ()) -> list[TreeNode]:
    """The Medusa heads' candidates as tree nodes (tokens[d][r], confidences[d][r]: head d + 1's r-th
    candidate and its probability, best first): valued by node_values times the request's scale at
    their depth (HeadCalibration.scales; () or past its end: the last scale, else 1), never above
    their parent's value, in node_values' order, so each head's best comes before its alternatives."""
    chain = [candidates[0] for candidates in tokens]
    values: dict[tuple[int, ...], float] = {(): 1.0}
    for value, depth, rank in node_values(confidences):  # parents (the chain's nodes) come first
        scale = scales[min(depth, len(scales) - 1)] if scales else 1.0
        path = (*chain[:depth], tokens[depth][rank])
        values[path] = min(value * scale, values[tuple(chain[:depth])])
    return [TreeNode(path, value) for path, value in values.items() if path]


def chain_nodes(tokens: Sequence[int], rates: Sequence[float]) -> list[TreeNode]:
    """A chain of drafts (a lookup copy) as tree nodes: node i's value is the chance that drafts 0..i are
    all the target's, the product of the per-position acceptance rates (AcceptanceEstimate.chain)."""
    nodes, reach = [], 1.0
    for i, rate in enumerate(rates[: len(tokens)]):
        reach *= rate
        nodes.append(TreeNode(tuple(tokens[: i + 1]), reach))
    return nodes


def pool_chain(pool: Sequence[TreeNode]) -> list[TreeNode]:
    """A drafter's own chain among its nodes: from the root, each node's first child in the pool's order."""
    chain: list[TreeNode] = []
    while (child := next((node for node in pool if node.path[:-1] == (chain[-1].path if chain else ())), None)) is not None:
        chain.append(child)
    return chain


def valued_tree(pools: Sequence[Sequence[TreeNode]], round_cost_s: Callable[[int, bool], float],
                max_nodes: int = tree.MAX_TREE_NODES) -> tuple[list[TreeNode], float]:
    """The nodes of one round's tree from free drafters' candidates (EAGLE-2's dynamic tree, over every
    drafter that needs no draft call): pools[i] are drafter i's nodes, each one's parent among them.
    A round's expected tokens are 1 + the sum of its nodes' values, so the round takes the n most
    valuable nodes of all pools (a path offered twice counts once, at its larger value) for the n
    that maximizes that over round_cost_s(n, tree) (the measured verify of n + 1 positions, tree:
    some nodes are siblings; a tree pass costs more than a chain of its size), and weighs each pool's
    chain (pool_chain: a drafter's best guesses) apart, since the best
    chain need not be a prefix of the nodes by value once trees cost more. At most max_nodes nodes (what a
    Verify scores).

    Returns (the chosen nodes ordered for a tree: parents first, and among siblings those of the
    earliest pool first, so tree.main_chain is the first pool's chain as far as it was chosen; [] for
    no drafts) and the tokens per second expected."""
    merged: dict[tuple[int, ...], TreeNode] = {}
    first_pool: dict[tuple[int, ...], int] = {}
    for index, pool in enumerate(pools):
        for node in pool:
            first_pool.setdefault(node.path, index)
            if node.path not in merged or node.value > merged[node.path].value:
                merged[node.path] = node
    ranked = sorted(merged.values(), key=lambda node: (-node.value, len(node.path)))  # stable: a parent first at equal value
    chains = [[merged[node.path] for node in pool_chain(pool)] for pool in pools]
    best, best_rate = [], 1.0 / max(round_cost_s(0, False), 1e-9)
    for candidates in [ranked] + chains:
        chosen: set[tuple[int, ...]] = {()}
        taken: list[TreeNode] = []
        expected, branched = 1.0, False
        for node in candidates:
            if len(taken) == max_nodes:
                break
            if node.path[:-1] not in chosen:
                continue  # its parent was not taken (equal values)
            branched = branched or any(len(other.path) == len(node.path) and other.path[:-1] == node.path[:-1] for other in taken)
            chosen.add(node.path)
            taken.append(node)
            expected += min(node.value, POLICY.max_acceptance)
            rate = expected / max(round_cost_s(len(taken), branched), 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = list(taken), rate
    best.sort(key=lambda node: (len(node.path), first_pool[node.path], -node.value))
    return best, best_rate


def confident_tree(tokens: Sequence[Sequence[int]], confidences: Sequence[Sequence[float]], scales: Sequence[float],
                   round_cost_s: Callable[[int, bool], float]) -> tuple[list[TreeNode], float]:
    """A tree of the Medusa heads' candidates chosen by their confidence this round (valued_tree over
    head_nodes): tokens[d][r] and confidences[d][r] are head d + 1's r-th candidate and its
    probability (best first); a node's value is the chance it is the target's token, its path product
    (node_values) times the request's measured scale at its depth (HeadCalibration): calibrated
    heads' path products are their acceptance rates (docs/design/trees.md).

    Returns (the chosen nodes, ordered for tree.from_paths; [] for no drafts) and the tokens per
    second expected."""
    return valued_tree([head_nodes(tokens, confidences, scales)], round_cost_s)


def depth_sums(nodes: Sequence[TreeNode], values: dict[tuple[int, ...], float]) -> list[float]:
    """values (path → value) of `nodes` summed by depth: [depth 1, depth 2, ...] up to the deepest node."""
    sums = [0.0] * max((len(node.path) for node in nodes), default=0)
    for node in nodes:
        sums[len(node.path) - 1] += values.get(node.path, 0.0)
    return sums


def tokens_by_pass(tokens: int, passes: int) -> list[int]:
    """A round's emitted tokens by target pass: all of them for one pass; a plain call of several
    (VerifyRequest.plain_steps) emits one a pass until they run out (a stop string may cut it short)."""
    return [tokens] if passes == 1 else [int(index < tokens) for index in range(passes)]


def mean_positions(positions_share: dict[int, float]) -> float:
    """Positions a row verifies on average, from positions → share of rounds."""
    return sum(n * share for n, share in positions_share.items())


def expected_batch_cost(by_positions: dict[int, float], positions_share: dict[int, float], rows: int,
                        ragged: bool = False) -> float:
    """Expected cost of a batched round whose `rows` rows each verify a number of positions drawn
    independently from positions_share (positions → share of rounds). by_positions: measured cost of
    `rows` rows of n positions each (interpolated between, flat beyond).

    ragged: each row costs its own positions (one ragged pass), and the measured costs are nearly
    linear in them, so the round costs what rows of the mean positions do. Padded: a batch pads every
    row to the longest, so it costs as much as its longest row, Σ_p P(max = p) · cost(p) with
    P(max ≤ p) = F(p)^rows: one copy of 8 tokens among 8 rows makes all 8 verify 9 positions."""
    if ragged:
        return interpolate(by_positions, mean_positions(positions_share))
    total, below, cumulative = 0.0, 0.0, 0.0
    for positions in sorted(positions_share):
        cumulative += positions_share[positions]
        at_most = min(cumulative, 1.0) ** rows
        total += (at_most - below) * interpolate(by_positions, positions)
        below = at_most
    return total


def position_price_s(by_positions: dict[int, float], shapes: dict[tuple[int, bool], "RoundShape"], rows: int) -> float:
    """Seconds one more verified position of one request adds to a round among `rows` requests,
    summed over every request that waits for it: the round's price of a draft beside others.

    Measured where rounds among `rows` were measured both ways (shapes, RoundShapes.measured): the
    extra seconds of a speculating round over a plain one, per position a request drafted in it; that
    includes all a draft costs as served (the heads' products, the gateway's work per draft), which
    on the 2-vCPU Xeon came to 6.6-9.5 ms a position among 8 against 4.3 at start-up. Else the
    verify's start-up costs of `rows` rows (by_positions: positions → ms, Scorer.measure_batch_costs):
    (cost(4) - cost(1)) / 3, every row 3 positions more, as one row's 3 positions each delay all."""
    speculating, plain = shapes.get((rows, True)), shapes.get((rows, False))
    if speculating is not None and plain is not None:
        drafted = mean_positions(speculating.positions_share) - mean_positions(plain.positions_share)
        if drafted >= 0.1:  # fewer drafts a round than that measure noise, not their price
            return max(speculating.round_s - plain.round_s, 0.0) / drafted
    if 1 not in by_positions or not any(n > 1 for n in by_positions):
        return 0.0
    more = min((n for n in by_positions if n > 1), key=lambda n: abs(n - 4))
    return max(by_positions[more] - by_positions[1], 0.0) / (more - 1) / 1e3


def speculation_cap(batch_costs_ms: dict[int, dict[int, float]], shapes: dict[tuple[int, bool], "RoundShape"],
                    current: Optional[int] = None, policy: SpeculationPolicy = POLICY, ragged: bool = False) -> int:
    """The most requests a verify replica may run while they speculate, from its measured batch costs
    and the rounds measured at each batch size.

    Once requests share passes, a draft costs every request in the batch (its positions make the pass
    longer; a padded batch pads every row to the longest: `ragged` says which), so speculation pays
    at batch size B only if rounds there emit more tokens a second while speculation is allowed than
    while it is not. shapes[(B, speculating)] holds what rounds run among B requests
    (RoundShapes.bucket) measured, either way. Where both were measured at B the measured rates
    decide (speculating must be policy.measured_margin faster to start, and not slower to go on);
    elsewhere the model does, from the verify's start-up costs: expected_batch_cost(B) / cost(B, 1) ×
    policy.speculation_margin < tokens a speculating round yields, with the yield measured at B, or,
    until it is, at the largest smaller size measured, else the smallest larger one (a provisional
    estimate that lets B be tried and measured: on the 2-core EPYC rounds among ≤ 2 requests yielded
    2.4 tokens a pass where 4 yielded 1.85). What requests running alone yield is no estimate (on
    that VM the one prompt that ends a benchmark's wave, 1.55 tokens a pass, stood for 2 streams).

    The cap is the largest B for which speculation pays at every size up to B; 1 when it fails
    already at the smallest (a request running alone still decides for itself); 0 (no cap) when it
    pays at every size (past the largest batch, passes are full and each pays the same). While the
    size served most (the bucket with the most plain rounds) has no speculating rounds measured, the
    cap is that size: speculation is tried at the load the gateway carries until its rounds are
    measured and the rates decide (a yield measured in a burst's tail among fewer requests must not
    end the trial first), unless even a lone request's yield would not pay there (_hopeless). Measured rates overrule the model, smaller sizes' too: where speculating
    among B measured faster than not, the model's no at a smaller size (each speculating row costs
    less there) does not cap it (in a burst's tail the requests still running are those whose drafts
    kept least: on the Xeon rounds among 4 yielded 1.46 tokens a pass where 8 yielded 2.46). With
    nothing served yet it is the smallest size (a cold gateway does not bet a busy batch on drafts it
    knows nothing of). Trying only the smallest size never ended under
    steady load: on a 2-vCPU Xeon serving 8 streams the cap stayed at 2 through thousands of rounds
    (too few ran among 2 requests to be measured), while speculating among 8 was 6% faster than not
    (docs/design/speculation-cap.md). batch_costs_ms[b][n]: ms of one round over b rows scoring n
    positions each (Scorer.measure_batch_costs). current: the cap in force (0 = none), whose sizes
    are kept at a lower bar (hysteresis: the model's at half its margin, measured rates at 1.0; an
    estimate near the threshold would otherwise flip the cap with every round)."""
    sizes = sorted(batch_costs_ms)
    served = max(((shapes[rows, False].rounds, rows) for rows in sizes if (rows, False) in shapes), default=(0, 0))[1]
    if served and (served, True) not in shapes and not _hopeless(served, batch_costs_ms[served], shapes, ragged):
        return served  # the load served most, never measured speculating: try it
    drafted = [rows for rows in sizes if (rows, True) in shapes]
    if not drafted:  # cold: the smallest size
        return sizes[0] if sizes else 0
    verdicts = [(rows, *_speculation_pays(rows, batch_costs_ms[rows], shapes, drafted, current, policy, ragged))
                for rows in sizes]
    won = max((rows for rows, pays, measured in verdicts if pays and measured), default=0)
    cap = 0
    for rows, pays, measured in verdicts:
        if not pays and (measured or rows > won):  # the model's no below a measured win is overruled
            return max(cap, 1)
        cap = rows
    return 0


def _hopeless(rows: int, by_positions: dict[int, float], shapes: dict[tuple[int, bool], "RoundShape"], ragged: bool) -> bool:
    """Whether speculating among `rows` requests cannot pay even if each yielded what a request alone does
    (nothing shares its pass, so its planner drafts most; speculation_cap's trial is then not run):
    rounds of a lone request's shape cost more, beside `rows` - 1 others, than its yield over a plain
    round. On the 2-vCPU EPYC a trial among 8 ran most of a 16-prompt burst at 0.85x a request's
    plain rate (8 rows of 4 positions cost 3x 8 rows of one; alone, 2.31 tokens a pass)."""
    alone = shapes.get((1, True))
    if alone is None or 1 not in by_positions:
        return False
    return expected_batch_cost(by_positions, alone.positions_share, rows, ragged) >= by_positions[1] * alone.tokens_per_pass


def _speculation_pays(rows: int, by_positions: dict[int, float], shapes: dict[tuple[int, bool], "RoundShape"],
                      drafted: list[int], current: Optional[int], policy: SpeculationPolicy, ragged: bool) -> tuple[bool, bool]:
    """(whether speculating among `rows` requests pays, whether measured rates both ways said so) for
    speculation_cap: the measured rates where both were measured, else the model over the yield measured
    there or at the nearest size measured (a smaller one first)."""
    speculating, plain = shapes.get((rows, True)), shapes.get((rows, False))
    held = current is not None and (current == 0 or rows <= current)
    if speculating is not None and plain is not None:
        return speculating.tokens_per_s > plain.tokens_per_s * (1.0 if held else policy.measured_margin), True
    shape = speculating or shapes[max((size for size in drafted if size < rows), default=drafted[0]), True]
    cost = expected_batch_cost(by_positions, shape.positions_share, rows, ragged) * (
        policy.cap_hysteresis if held else policy.speculation_margin)
    return cost < interpolate(by_positions, 1) * shape.tokens_per_pass, False


@dataclass(frozen=True)
class RoundShape:
    """What rounds of one kind looked like: how many were measured, tokens emitted and seconds taken
    a round (moving averages), and the share of rounds by positions verified."""

    rounds: int
    tokens_per_pass: float
    round_s: float
    positions_share: dict[int, float]

    @property
    def tokens_per_s(self) -> float:
        """One request's rate in such rounds (what speculation must raise)."""
        return self.tokens_per_pass / max(self.round_s, 1e-9)


class _MovingShape:
    """Moving averages behind one RoundShape (not thread-safe: RoundShapes locks)."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self.rounds, self.tokens, self.seconds = 0, 0.0, 0.0
        self.positions: dict[int, float] = {}  # positions → weight
        self.last = 0  # RoundShapes' round count at the last round of this kind

    def observe(self, tokens: int, positions: int, seconds: float, now: int) -> None:
        self.rounds, self.last = self.rounds + 1, now
        weight = max(self.smoothing, 1 / self.rounds)
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        for seen in self.positions:
            self.positions[seen] *= 1 - weight
        self.positions[positions] = self.positions.get(positions, 0.0) + weight

    def snapshot(self) -> RoundShape:
        total = sum(self.positions.values())
        return RoundShape(self.rounds, self.tokens, self.seconds, {n: w / total for n, w in self.positions.items()})


class RoundShapes:
    """What rounds look like by batch size and by whether speculation was allowed (drafting or not):
    tokens emitted, seconds taken and positions verified per round, as moving averages; shared by
    requests (the speculation cap). A round counts toward the smallest measured batch size that holds
    the requests running with it (bucket): the cap's question at size B is about rounds run among
    more requests than the next smaller size. Kinds unseen for policy.stale_rounds rounds are forgotten."""

    def __init__(self, policy: SpeculationPolicy = POLICY):
        self.policy = policy
        self._rounds = 0
        self._shapes: dict[tuple[int, bool], _MovingShape] = {}
        self._lock = threading.Lock()

    @staticmethod
    def bucket(rows: int, sizes: Sequence[int]) -> int:
        """The smallest of `sizes` that holds `rows` rows (the largest when none does; 1 for a request
        running alone, whose rounds are nobody else's cost)."""
        if rows <= 1 or not sizes:
            return 1
        return min((size for size in sizes if size >= rows), default=max(sizes))

    def observe(self, tokens: int, positions: int, seconds: float, rows: int = 1, speculating: bool = True) -> None:
        """One round that emitted `tokens`, verified `positions` and took `seconds`, in batch-size bucket
        `rows`, speculation allowed or not."""
        with self._lock:
            self._rounds += 1
            self._shapes.setdefault((rows, speculating), _MovingShape(self.policy.yield_smoothing)).observe(tokens, positions, seconds, self._rounds)
            for key in [key for key, shape in self._shapes.items() if self._rounds - shape.last > self.policy.stale_rounds]:
                del self._shapes[key]

    @property
    def count(self) -> int:
        """Rounds observed so far (the estimates change only when it does)."""
        with self._lock:
            return self._rounds

    def measured(self) -> dict[tuple[int, bool], RoundShape]:
        """(bucket, speculating) → its shape, for those with at least policy.min_shape_rounds rounds (a few say little)."""
        with self._lock:
            return {key: shape.snapshot() for key, shape in self._shapes.items() if shape.rounds >= self.policy.min_shape_rounds}


class StepCosts:
    """Moving averages of measured Verify seconds by positions and Propose seconds by k; shared by requests.

    Unmeasured sizes are priced optimistically so they get tried and measured: a Verify as the largest
    measured smaller one, a Propose linearly from the nearest measured k.

    Asking for the Medusa heads' proposals makes a pass dearer. One table holds every size's cost
    without the proposals and `heads_extra_s` what asking adds (asking passes enter the table less
    it), so head rounds are priced with the extra and the plain rounds they compete with without.
    A separate table of asking passes would lock a price in: once it priced the heads out, no pass
    would ask again to re-measure it.

    A tree pass costs more than a chain over as many positions (its own mask; the kept path's cache
    columns move at the next commit): tree Verifies move `tree_extra_s`, the moving average of what a
    tree took beyond a measured chain of its size, instead of the chain table.

    One slow pass must not price a size out for good (nothing chosen is re-measured): a size not
    measured in the last `stale_after` Verifies is priced from the fresh sizes around it, and its
    next measurement replaces the old average instead of moving it; no size costs more than a fresh
    larger one.

    With the verify's start-up pass costs (`prior`: what one session's pass over n positions took
    there, RuntimeProfile.pass_costs), a size that is not fresh costs the nearest fresh size's
    average plus what the start-up table says the difference is. Without them it is priced
    optimistically, so it gets tried; on the 2-core EPYC those tries were trees of 7-18 nodes at
    110-330 ms a round, each kept ~1.5 tokens. docs/design/step-costs.md has the measurements.
    """

    def __init__(self, policy: SpeculationPolicy = POLICY):
        self.smoothing = policy.cost_smoothing
        self.stale_after = policy.stale_after_verifies
        self._verify: dict[int, float] = {}  # positions → seconds of a chain Verify, without the heads' proposals
        self._verifies = 0  # Verifies observed so far (the clock of staleness)
        self._verify_measured_at: dict[int, int] = {}  # positions → self._verifies when last entered in the table
        self._measured_plain: set[int] = set()  # sizes measured by Verifies that did not ask for proposals
        self.heads_extra_s = 0.0  # what asking for the heads' proposals adds to a Verify
        self.heads_share = 0.0  # moving share of Verifies that asked (what a round of either kind pays on average)
        self._draft: dict[int, float] = {}
        self.tree_extra_s = 0.0  # what a tree Verify takes beyond a chain over as many positions
        self._prior: dict[int, float] = {}  # positions → seconds of one session's pass at the verify's start-up
        self._lock = threading.Lock()

    def set_prior(self, pass_s: dict[int, float]) -> None:
        """The verify's start-up cost of one session's pass by positions (seconds): what sizes not
        measured here are priced from (_chain_cost)."""
        with self._lock:
            self._prior = dict(pass_s)

    def observe_verify(self, positions: int, seconds: float, heads: bool = False, tree: bool = False) -> None:
        """A Verify over `positions` took `seconds`; heads: it asked for the heads' proposals; tree: it
        verified a tree (priced apart where a chain of its size is measured: tree_extra_s)."""
        with self._lock:
            self._verifies += 1
            self.heads_share += self.smoothing * (float(heads) - self.heads_share)
            chain = self._verify.get(positions) if positions in self._fresh_sizes() else None
            if heads and chain is not None and positions in self._measured_plain and not tree:
                self.heads_extra_s += self.smoothing * (seconds - chain - self.heads_extra_s)
            plain_seconds = seconds - (self.heads_extra_s if heads else 0.0)
            if tree and chain is not None:
                self.tree_extra_s += self.smoothing * (plain_seconds - chain - self.tree_extra_s)
                return
            if not heads:
                self._measured_plain.add(positions)
            if tree and positions in self._verify:  # stale: a chain of this size costs the tree less what trees add
                plain_seconds -= self.tree_extra_s
            # a stale size starts its average over: the old one may be the spike that made it stale
            old = chain if chain is not None else plain_seconds
            self._verify[positions] = old + self.smoothing * (plain_seconds - old)
            self._verify_measured_at[positions] = self._verifies

    def _fresh_sizes(self) -> set[int]:
        """Sizes measured in the last `stale_after` Verifies (every measured size while none is); under the lock."""
        fresh = {n for n, at in self._verify_measured_at.items() if self._verifies - at < self.stale_after}
        return fresh or set(self._verify)

    def observe_draft(self, k: int, seconds: float) -> None:
        self._observe(self._draft, k, seconds)

    def _observe(self, table: dict[int, float], key: int, seconds: float) -> None:
        with self._lock:
            old = table.get(key)
            table[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def verify_s(self, positions: int, heads: Optional[bool] = None) -> Optional[float]:
        """Seconds a Verify over `positions` takes (None while none is measured): the table's price of it
        (_chain_cost: fresh, stale or never measured), plus what
        asking for the heads' proposals adds when `heads` (True), nothing when it does not ask (False),
        and that times the share of Verifies that ask when it is not known (None)."""
        with self._lock:
            if not self._verify:
                return None
            share = self.heads_share if heads is None else float(heads)
            return self._chain_cost(positions) + share * self.heads_extra_s

    def _chain_cost(self, positions: int) -> float:
        """The table's price of a chain Verify over `positions` (some size measured); under the lock.

        Fresh: its own average. With the start-up prior, any other size: the nearest fresh size's
        average plus the prior's difference between the two (the served overhead of a pass is
        shared by every size; what positions add is the model's). Without it, stale: what the fresh
        sizes around it say (extrapolated), not its old average, which may be the spike that made it
        stale, nor the cheaper neighbour's (every rarely used size would then be tried again each
        `stale_after` Verifies); never measured: the largest measured size below it (optimistic, so
        it gets tried once). No size costs more than a fresh larger one."""
        measured, fresh = self._verify, self._fresh_sizes()
        if positions in fresh:
            cost = measured[positions]
        elif self._prior:
            anchor = min(fresh, key=lambda n: (abs(n - positions), n))
            cost = measured[anchor] + extrapolate(self._prior, positions) - extrapolate(self._prior, anchor)
        elif positions in measured:
            cost = extrapolate({n: measured[n] for n in fresh}, positions)
        else:
            smaller = [n for n in measured if n < positions]
            cost = self._chain_cost(max(smaller) if smaller else min(measured))
        return min([cost] + [measured[n] for n in fresh if n > positions])

    def draft_s(self, k: int) -> float:
        if k == 0:
            return 0.0
        with self._lock:
            if not self._draft:
                return 0.0
            nearest = min(self._draft, key=lambda j: abs(j - k))
            return self._draft[nearest] * k / nearest

    def round_cost_s(self, k: int, branches: int = 1, drafting: bool = True, heads: Optional[bool] = None,
                     widened: Optional[int] = None, tree: bool = False) -> float:
        """Seconds a round with k drafts is expected to take (1.0 while nothing is measured); a tree of
        `branches` candidates per position verifies k × branches + 1 positions, or with `widened`
        only the first `widened` drafts carry alternatives. drafting=False: the drafts cost nothing
        to make (the gateway's prompt-lookup copies). heads: priced by the Verifies that asked for the
        heads' proposals or did not (verify_s). A tree (alternatives, or `tree`: k nodes of any shape but
        a chain) costs tree_extra_s more."""
        extra = min(k, k if widened is None else widened) * (branches - 1)
        verify = self.verify_s(k + extra + 1, heads)
        if verify is not None and (extra or tree):
            verify += self.tree_extra_s
        return (1.0 if verify is None else verify) + (self.draft_s(k) if drafting else 0.0)


class AcceptanceEstimate:
    """Acceptance of one request's drafts, per draft position: accepted / examined, exponentially
    forgotten, shrunk toward a prior.

    Draft i is examined when drafts 1..i-1 were accepted; drafts after the first rejection say
    nothing, so counting them (accepted / drafted) would underestimate. Position i's prior is the
    `shared` estimate's at i where that has examined as much as the prior weighs (the same
    drafter's rounds across this server's recent requests of the same kind: a new request starts
    from what they kept, not from a constant), else the estimate of position i-1 (position 1's is
    `prior`), so a position never reached yet borrows from the one before it. Rounds without drafts forget too, so a request that
    stopped drafting drifts back to the prior and tries again: the draft may have become useful
    (code, repeated text) where it was not before. Rounds with drafts teach `shared` as well.
    """

    def __init__(self, prior: Optional[float] = None, policy: SpeculationPolicy = POLICY,
                 shared: Optional["AcceptanceEstimate"] = None, decay: Optional[float] = None):
        self.prior = policy.acceptance_prior if prior is None else prior
        self.prior_weight, self.ceiling = policy.prior_weight, policy.max_acceptance
        self.decay = policy.decay if decay is None else decay
        self.shared = shared
        self._accepted: list[float] = []  # per position (0 = the first draft)
        self._examined: list[float] = []
        self._lock = threading.Lock()  # a shared estimate is taught by every request's thread

    @classmethod
    def server_wide(cls, prior: Optional[float] = None, policy: SpeculationPolicy = POLICY) -> "AcceptanceEstimate":
        """An estimate shared by requests (their `shared`): forgets slowly, policy.shared_decay a round."""
        return cls(prior, policy, decay=policy.shared_decay)

    def chain(self, length: int) -> list[float]:
        """Conditional acceptance of draft positions 1..length."""
        base, evidence = (self.shared.chain(length), self.shared.examined(length)) if self.shared is not None else ([], [])
        rates, previous = [], self.prior
        with self._lock:
            for i in range(length):
                accepted = self._accepted[i] if i < len(self._accepted) else 0.0
                examined = self._examined[i] if i < len(self._examined) else 0.0
                prior = base[i] if evidence and evidence[i] >= self.prior_weight else previous
                previous = min((accepted + prior * self.prior_weight) / (examined + self.prior_weight), self.ceiling)
                rates.append(previous)
        return rates

    def examined(self, length: int) -> list[float]:
        """How many trials (forgotten as they age) positions 1..length have seen."""
        with self._lock:
            return [self._examined[i] if i < len(self._examined) else 0.0 for i in range(length)]

    def update(self, drafted: int, accepted: int) -> None:
        """A chain round: drafts 1..min(drafted, accepted + 1) were examined, the first `accepted` kept."""
        examined = min(drafted, accepted + 1)
        self._count(range(examined), range(accepted))
        if drafted and self.shared is not None:
            self.shared.update(drafted, accepted)

    def observe(self, position: int, hit: bool) -> None:
        """One trial at draft position `position` (0-based) alone: for estimates whose positions are
        tried one a round, e.g. whether a tree's alternatives beside draft position + 1 held the
        target's token when the draft did not (Generation's rescue estimate)."""
        self._count([position], [position] if hit else [])
        if self.shared is not None:
            self.shared.observe(position, hit)

    def _count(self, examined: Sequence[int], accepted: Sequence[int]) -> None:
        """Forget a little everywhere, then count the examined and accepted positions."""
        with self._lock:
            while len(self._examined) <= max(examined, default=-1):
                self._examined.append(0.0)
                self._accepted.append(0.0)
            for i in range(len(self._examined)):
                self._examined[i] = self.decay * self._examined[i] + (i in examined)
                self._accepted[i] = self.decay * self._accepted[i] + (i in accepted)


class HeadCalibration:
    """How the Medusa heads' confidence predicts this request's acceptance, per depth: accepted head
    nodes over the sum of the drafted head nodes' values (path products) at that depth, exponentially
    forgotten, shrunk toward a prior scale: the `shared` calibration's at that depth where that has
    seen as much predicted value as the prior weighs (this server's recent requests of the same
    kind), else the depth above's (the first depth's toward 1: calibrated).

    Held out, the greedy path products are close to the acceptance rates, but a request's own kind of
    text, or sampling (a one-hot draft is kept with the target's probability of it, below the heads'
    confidence, and the shortfall compounds along a chain), moves them, deeper nodes the most: one
    scale for all depths over-promised the deep ones (sampled at T = 0.8 on unseen prompts the heads
    kept 0.26, 0.10 and 0.05 drafts at depths 1-3 while a depth-1 scale valued the deep ones at twice
    that), so each depth follows the request apart."""

    def __init__(self, policy: SpeculationPolicy = POLICY, shared: Optional["HeadCalibration"] = None,
                 decay: Optional[float] = None):
        self.prior_weight = policy.prior_weight
        self.decay = policy.decay if decay is None else decay
        self.shared = shared
        self._accepted: list[float] = []  # per depth (0 = a head 1 node)
        self._predicted: list[float] = []
        self._lock = threading.Lock()  # a shared calibration is taught by every request's thread

    @classmethod
    def server_wide(cls, policy: SpeculationPolicy = POLICY) -> "HeadCalibration":
        """A calibration shared by requests (their `shared`): forgets slowly, policy.shared_decay a round."""
        return cls(policy, decay=policy.shared_decay)

    def scales(self, depths: int) -> list[float]:
        """The scale of depths 1..depths."""
        base, evidence = (self.shared.scales(depths), self.shared.predicted(depths)) if self.shared is not None else ([], [])
        scales, previous = [], 1.0
        with self._lock:
            for depth in range(depths):
                accepted = self._accepted[depth] if depth < len(self._accepted) else 0.0
                predicted = self._predicted[depth] if depth < len(self._predicted) else 0.0
                prior = base[depth] if evidence and evidence[depth] >= self.prior_weight else previous
                previous = (accepted + self.prior_weight * prior) / (predicted + self.prior_weight)
                scales.append(previous)
        return scales

    def predicted(self, depths: int) -> list[float]:
        """The value drafted (forgotten as it ages) at depths 1..depths."""
        with self._lock:
            return [self._predicted[d] if d < len(self._predicted) else 0.0 for d in range(depths)]

    def observe(self, predicted: Sequence[float], accepted: Sequence[int]) -> None:
        """One round: the drafted head nodes' values and how many of them were accepted, by depth."""
        with self._lock:
            while len(self._predicted) < max(len(predicted), len(accepted)):
                self._predicted.append(0.0)
                self._accepted.append(0.0)
            for depth in range(len(self._predicted)):
                self._predicted[depth] = self.decay * self._predicted[depth] + (predicted[depth] if depth < len(predicted) else 0.0)
                self._accepted[depth] = self.decay * self._accepted[depth] + (accepted[depth] if depth < len(accepted) else 0.0)
        if self.shared is not None:
            self.shared.observe(predicted, accepted)


@dataclass
class SharedEstimates:
    """What each drafter's rounds kept across this server's recent requests of one kind (greedy or
    sampled), forgetting slowly: the priors a new request's own estimates start from and shrink
    toward (AcceptanceEstimate.shared, HeadCalibration.shared). A request begins where requests like
    it left off instead of at a constant: the planner's first rounds are the ones a constant prior
    misjudges most (it drafted 3 tokens a round at prior 0.5 where sampled heads keep ~0.25)."""

    lookup: AcceptanceEstimate
    heads: AcceptanceEstimate
    head_rescue: AcceptanceEstimate
    head_calibration: HeadCalibration
    draft: AcceptanceEstimate
    draft_rescue: AcceptanceEstimate

    @classmethod
    def fresh(cls, policy: SpeculationPolicy = POLICY) -> "SharedEstimates":
        return cls(AcceptanceEstimate.server_wide(policy=policy), AcceptanceEstimate.server_wide(policy=policy),
                   AcceptanceEstimate.server_wide(policy.rescue_prior, policy), HeadCalibration.server_wide(policy),
                   AcceptanceEstimate.server_wide(policy=policy), AcceptanceEstimate.server_wide(policy.rescue_prior, policy))


def describe_shapes(shapes: dict[tuple[int, bool], RoundShape]) -> str:
    """One log line's worth of what the speculation cap was decided from."""
    return "; ".join(
        f"{rows} {'speculating' if speculating else 'plain'}: {shape.tokens_per_pass:.2f} tokens a pass, "
        f"{shape.tokens_per_s:.1f} tokens/s a request ({shape.rounds} rounds)"
        for (rows, speculating), shape in sorted(shapes.items())
    ) or "none measured yet"
