"""Medusa heads: the verify service proposes the next round's drafts from the target's own last hidden state.

Why: a draft service costs a round trip and a draft model's steps every round. Heads on the target's
final hidden state f_t (after the final norm: what the LM head reads, the row that scores x_{t+1})
guess the tokens after that one at almost no cost inside the verify pass that computed f_t, so a
deployment can speculate with no draft service at all (Cai et al., "Medusa", 2024).

Alignment: head k (k = 1..K) at row t scores x_{t+1+k}. The row the gateway reads is the last one of
the committed sequence after judging: its target argmax is the round's bonus/correction token x_{t+1},
and heads 1..K propose x_{t+2}..x_{t+1+K}, the next round's drafts, in order.

    r_k = f_t + SiLU(W_k f_t + b_k)     [H]   (num_layers such residual blocks per head; Medusa-1)
    logits_k = r_k · W[vocab_ids]ᵀ       [V']  the target's frozen LM head, restricted to the V' most
                                               frequent target choices (cost)

With next_token_input the first block of every head also reads the embedding of the row's own next
token, x_{t+1} (r = f_t + SiLU(W_k [f_t ; e(x_{t+1})] + b_k), as a Hydra head conditions on the
tokens before its own): what EAGLE's first drafting step knows, without its attention. The verify
passes the target's argmax at the row (the round's token itself when greedy; a guess when sampling,
which only costs acceptance, never exactness).

With chained_input as well, head k's first block reads every token between the row and its own:
x_{t+1} and heads 1..k-1's proposals for x_{t+2}..x_{t+k} (Hydra: Ankner et al., 2024). Medusa heads
guess x_{t+3} without knowing what head 1 guessed for x_{t+2}; a chain of drafts is only accepted
where every earlier guess was right, so what counts is head k's accuracy *given* the earlier heads
were right, which is what a head reading their tokens learns (trained on the answer's own tokens:
teacher forcing). The cost: the heads score one after another (K products over the V' × H rows
instead of one).

With fusion_layers the heads' input is not f_t alone: f_t + W [norm(h_t^(a)) ; norm(h_t^(b)) ; ...], the
outputs of lower decoder layers (before the final norm) projected into the residual stream
(EAGLE-3's fusion of low, middle and high features: the last layer is specialized for the next token,
lower ones keep more of the context that the tokens after it depend on). W starts at zero, so heads
trained without fusion go on with it unchanged until trained (medusa_training.reshaped_from).

Only the residual blocks are trained and saved (~0.7 MB a block in bf16, twice that with the token
input); the LM head rows and the embedding are the target's and are read from it at load time. Drafts are each head's argmax: deterministic, so a
sampling round treats them like prompt-lookup copies (q = one-hot), which the ordinary rejection
rule keeps exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from specd_engine import autotune
from specd_engine.head_files import save_head_files
from specd_engine.quantized import GROUP, Int8Linear

WEIGHTS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_heads.json"
FLOAT32, BFLOAT16, INT8 = "float32", "bfloat16", "int8"  # precisions of the heads' product (MedusaHeads.tune_product)
REDUCED = (BFLOAT16, INT8)  # the precisions whose best candidates are rescored in float32
RESCORED_CANDIDATES = 4  # a reduced precision's best candidates, rescored in float32
REDUCED_MARGIN = 1.1  # a reduced precision must be this much faster than float32 to be used (it rescores; timings are noisy)


@dataclass
class MedusaConfig:
    """Shapes and the target the heads serve."""

    hidden_size: int
    num_heads: int  # K: head k proposes the token k + 1 positions after the row's own
    vocab_size: int  # the target's
    draft_vocab_size: int  # V': ids the heads score
    num_layers: int = 1  # residual blocks per head
    next_token_input: bool = False  # the first block also reads the embedding of the row's own next token
    chained_input: bool = False  # ... and head k also the earlier heads' proposals (Hydra; needs next_token_input)
    fusion_layers: list[int] = field(default_factory=list)  # decoder layers (1-based) whose outputs the input fuses; []: f_t alone
    target: str = ""
    vocab_digest: str = ""  # the target tokenizer's digest, checked at load


class ResidualBlock(nn.Module):
    """x + SiLU(W [x ; extra] + b), starting as the identity (W = 0, b = 0), as in Medusa; `extra`
    (width extra_size, e.g. a token embedding) is read but not added to the residual stream."""

    def __init__(self, size: int, extra_size: int = 0):
        super().__init__()
        self.linear = nn.Linear(size + extra_size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, extra: Optional[torch.Tensor] = None, packed: Optional[Int8Linear] = None) -> torch.Tensor:
        """packed: this block's weight in 8 bits (MedusaHeads.block_dtypes), multiplied in its place."""
        inputs = x if extra is None else torch.cat((x, extra), dim=-1)
        return x + F.silu(self.linear(inputs) if packed is None else packed(inputs) + self.linear.bias)


class MedusaHeads(nn.Module):
    """K heads of residual blocks over the target's frozen LM head rows."""

    def __init__(self, config: MedusaConfig, lm_head: torch.Tensor, vocab_ids: torch.Tensor, embedding: Optional[torch.Tensor] = None):
        """lm_head [V, H] and embedding [V, H] (needed with next_token_input) are the target's; vocab_ids [V'] the ids scored."""
        super().__init__()
        if config.chained_input and not config.next_token_input:
            raise ValueError("Medusa heads with chained_input read the tokens after the row's own next token: they need next_token_input too")
        self.config = config
        h = config.hidden_size
        self.heads = nn.ModuleList(
            nn.ModuleList(ResidualBlock(h, h * self.token_inputs(index) if layer == 0 else 0) for layer in range(config.num_layers))
            for index in range(config.num_heads)
        )
        if config.fusion_layers:
            self.fusion = nn.Linear(len(config.fusion_layers) * h, h)  # zero at first: the heads read f_t alone
            nn.init.zeros_(self.fusion.weight)
            nn.init.zeros_(self.fusion.bias)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # [V']
        # the target's LM-head rows of the heads' vocabulary, stored as contiguous columns [H, V']:
        # x @ columns streams them at ~1.3x the speed of x @ rows.T on the 2-core AMD EPYC VM (the
        # "rows" layout of specd_engine/lm.py)
        columns = lm_head.detach().float()[vocab_ids.long()].T.contiguous()  # [H, V']
        self.register_buffer("head_columns", columns, persistent=False)
        self.product_dtypes: dict[int, str] = {}  # rows → a precision for the heads' product (tune_product); {}: float32
        self.reduced: dict[str, Union[torch.Tensor, Int8Linear]] = {}  # the columns in the reduced precisions some size uses
        self.rescoring: Optional[torch.Tensor] = None  # head_columns as rows [V', H], while a reduced precision is kept
        self.block_dtypes: dict[int, str] = {}  # rows → float32 or int8 for the residual blocks (tune_product); {}: float32
        self.packed_blocks: dict[tuple[int, int], Int8Linear] = {}  # (head, layer) → its block's weight in 8 bits, when some size uses them
        self.native = None  # NativeHeads (verify_service/native_heads.py), when some row count proposes natively
        self.native_rows: dict[int, bool] = {}  # rows → whether proposals take the native call (tune_product); {}: never
        if config.next_token_input:
            if embedding is None:
                raise ValueError("Medusa heads with next_token_input need the target's input embedding")
            self.register_buffer("embedding", embedding.detach().float(), persistent=False)  # [V, H]

    def token_inputs(self, index: int) -> int:
        """How many tokens after the row head index + 1's first block reads: none, the row's own next
        token, or (chained) that and the earlier heads' proposals."""
        if not self.config.next_token_input:
            return 0
        return index + 1 if self.config.chained_input else 1

    def fused(self, features: torch.Tensor, layer_features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The heads' input: features [..., H], plus with fusion_layers the projection of those layers'
        outputs layer_features [..., L, H], each RMS-normalized first (a decoder layer's output is the
        raw residual stream, whose scale grows with depth) → [..., H]."""
        x = features.to(self.head_columns.dtype)
        if not self.config.fusion_layers:
            return x
        if layer_features is None:
            raise ValueError(f"these Medusa heads fuse the outputs of layers {self.config.fusion_layers}: pass layer_features")
        normalized = F.rms_norm(layer_features.to(x.dtype), (x.shape[-1],))  # [..., L, H]
        return x + self.fusion(normalized.flatten(-2))

    def head_output(self, index: int, features: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Head index + 1's residual stream: features [..., H] (the heads' input: fused) → [..., H]. tokens [..., m] (or [...] for
        m = 1): column c is the token c + 1 positions after the row (column 0 the row's own next
        token); the head reads the first token_inputs(index) columns."""
        x = features.to(self.head_columns.dtype)
        extra = None
        if self.config.next_token_input:
            tokens = tokens if tokens.dim() == features.dim() else tokens[..., None]  # [..., m]
            extra = self.embedding[tokens[..., : self.token_inputs(index)]].flatten(-2)  # [..., n·H]
        packed = autotune.by_size(self.block_dtypes, x.shape[0], FLOAT32) == INT8 if x.dim() == 2 else False
        for layer, block in enumerate(self.heads[index]):
            x = block(x, extra if layer == 0 else None, self.packed_blocks[index, layer] if packed else None)
        return x

    def forward(self, features: torch.Tensor, next_tokens: Optional[torch.Tensor] = None,
                layer_features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """features [..., H] (next_tokens [...]: each row's own next token, with the token input;
        layer_features [..., L, H] with fusion) → scores [K, ..., V'] over the heads' vocabulary (head k
        at index k - 1). Unchained heads only: chained ones need each other's proposals (propose)."""
        if self.config.chained_input:
            raise ValueError("chained Medusa heads score one after another: use propose")
        features = self.fused(features, layer_features)
        outputs = torch.stack([self.head_output(k, features, next_tokens) for k in range(len(self.heads))])  # [K, ..., H]
        return (outputs @ self.head_columns).float()  # one product: the V' × H rows are read once for all heads

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, next_tokens: Optional[torch.Tensor] = None,
                layer_features: Optional[torch.Tensor] = None, candidates: int = 1) -> torch.Tensor:
        """features [N, H] (next_tokens [N]; layer_features [N, L, H] with fusion) → token ids [N, K]:
        row n holds heads 1..K's argmax, the drafts after row n's next token; with candidates c > 1,
        [N, K, c]: each head's c best, best first (a tree's alternatives; chained heads read the
        earlier heads' best)."""
        proposals, _ = self.ranked(features, next_tokens, layer_features, candidates)  # [N, K, c]
        return proposals[..., 0] if candidates == 1 else proposals

    @torch.inference_mode()
    def ranked(self, features: torch.Tensor, next_tokens: Optional[torch.Tensor] = None,
               layer_features: Optional[torch.Tensor] = None, candidates: int = 1, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """propose's candidates, always [N, K, c], and each one's probability under its head's softmax
        over the heads' vocabulary [N, K, c] (float32): the heads' confidence, which says where a
        tree's alternatives are worth their verified positions (EAGLE-2's dynamic trees). depth > 0:
        only the first `depth` heads propose (K = depth; each head costs a product over V' × H)."""
        features = self.fused(features, layer_features)
        heads = min(depth, len(self.heads)) if depth > 0 else len(self.heads)
        if self.native is not None and autotune.by_size(self.native_rows, features.shape[0], False):
            return self.native.ranked(features, next_tokens, candidates, heads)
        if not self.config.chained_input:
            outputs = torch.stack([self.head_output(k, features, next_tokens) for k in range(heads)])  # [K, N, H]
            top, probs = self.top_columns(outputs.flatten(0, 1), candidates, with_probs=True)  # [K·N, c] each: one product
            shape = (*outputs.shape[:2], candidates)
            return self.vocab_ids[top.view(shape)].transpose(0, 1), probs.view(shape).transpose(0, 1)
        tokens, picks, confidences = next_tokens[:, None], [], []  # [N, 1 + proposals so far]
        for index in range(heads):
            top, probs = self.top_columns(self.head_output(index, features, tokens), candidates, with_probs=True)  # [N, c] each
            picks.append(self.vocab_ids[top])
            confidences.append(probs)
            tokens = torch.cat((tokens, picks[-1][:, :1]), dim=1)
        return torch.stack(picks, dim=1), torch.stack(confidences, dim=1)  # [N, K, c] each

    def top_columns(self, outputs: torch.Tensor, count: int = 1, precision: str = "", with_probs: bool = False):
        """outputs [N, H] → [N, count]: each row's best columns by its scores outputs · head_columns,
        best first, in the product precision measured fastest for N rows (tune_product; `precision`
        overrides); with_probs: (columns, their softmax probabilities [N, count]). In bfloat16 the
        candidates are its max(RESCORED_CANDIDATES, count) best, rescored exactly in float32: a
        bfloat16 score has 8 bits of mantissa, too few to order close logits (int8 columns fewer), and
        a proposal that differs from the float32 one would cost acceptance (never exactness: the
        verify judges every draft); the softmax's normalizer comes from the reduced scores (a
        confidence, not a probability the sampling rule uses)."""
        precision = precision or autotune.by_size(self.product_dtypes, outputs.shape[0], FLOAT32)
        if precision not in REDUCED:
            scores = outputs @ self.head_columns  # [N, V']
            best = scores.topk(count, dim=-1)
            columns, top_scores = best.indices, best.values  # [N, count] each
        else:
            scores = self._reduced_scores(outputs, precision)  # [N, V']
            rescored = scores.topk(max(RESCORED_CANDIDATES, count), dim=-1).indices  # [N, c]
            exact = (self.rescoring_rows()[rescored] @ outputs[:, :, None])[..., 0]  # [N, c, H] @ [N, H, 1] → [N, c]
            order = exact.topk(count, dim=-1)
            columns, top_scores = rescored.gather(1, order.indices), order.values
        if not with_probs:
            return columns
        return columns, (top_scores - scores.logsumexp(dim=-1, keepdim=True)).exp()

    def _reduced_scores(self, outputs: torch.Tensor, precision: str) -> torch.Tensor:
        """outputs [N, H] → float32 scores [N, V'] from the columns in a reduced precision: bfloat16
        columns, or int8 ones with a bfloat16 scale per column (the CPU int8 kernel the int4
        target's LM head uses; it reads a quarter of float32's bytes)."""
        columns = self.reduced[precision] if precision in self.reduced else self._reduce(precision)
        if precision == INT8:
            return columns(outputs).float()  # Int8Linear over the rows [V', H]
        return (outputs.to(torch.bfloat16) @ columns).float()

    def rescoring_rows(self) -> torch.Tensor:
        """head_columns as contiguous rows [V', H], kept in self.rescoring: a candidate's float32 row is one
        read (from the columns, one cache line a value: 0.85 ms for four candidates after a served pass
        on the 2-core Xeon, against 0.24)."""
        if self.rescoring is None:
            self.rescoring = self.head_columns.T.contiguous()
        return self.rescoring

    def _reduce(self, precision: str) -> Union[torch.Tensor, Int8Linear]:
        """head_columns in `precision`, kept in self.reduced: int8 as the target's 8-bit LM head is kept
        (Int8Linear: specd's AMX tiles where they serve, else PyTorch's int8 kernel)."""
        self.rescoring_rows()
        if precision == INT8:
            self.reduced[INT8] = Int8Linear(self.head_columns.T)  # [V', H] rows
        else:
            self.reduced[BFLOAT16] = self.head_columns.to(torch.bfloat16)  # [H, V']
        return self.reduced[precision]

    def _pack_blocks(self) -> None:
        """Every residual block's weight in 8 bits (packed_blocks), as the target's LM head is kept."""
        self.packed_blocks = {(index, layer): Int8Linear(block.linear.weight) for index, head in enumerate(self.heads)
                              for layer, block in enumerate(head)}

    def fix_precision(self, precision: str) -> None:
        """Every row count's blocks and products in float32 or int8, unmeasured (a comparison's choice;
        serving measures it: tune_product)."""
        if precision == INT8:
            self._reduce(INT8)
            self._pack_blocks()
        self.product_dtypes, self.block_dtypes = {1: precision}, {1: precision}

    def head_outputs(self, features: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Every head's residual stream for features [N, H] and tokens [N, K] (column c: the token c + 1
        positions after the row): the blocks' whole cost in a proposal."""
        return [self.head_output(index, features, tokens) for index in range(len(self.heads))]

    @torch.inference_mode()
    def tune_product(self, rows: Sequence[int] = autotune.MEASURED_POSITIONS, repeats: int = 7,
                     measure: autotune.Measure = autotune.measure_now) -> dict[int, str]:
        """Time the heads' product (one head's argmax over N rows) in float32 and in each reduced
        precision (with the float32 rescoring), and every head's residual blocks in float32 and int8,
        for each N in rows, interleaved; use a reduced precision for the row counts where it is
        REDUCED_MARGIN faster than float32. Returns rows → the choices and their timings, for the
        service's runtime record. Why measured: on a 2-core AMD EPYC with AVX512-BF16, 4 rows took 0.81
        ms in bfloat16 against 2.42 in float32, one row 0.69 against 0.50; a CPU without bfloat16
        instructions converts and loses at every size (23 ms a row on the AVX2-only EPYC), where the
        int8 kernel took 0.42 ms against float32's 1.10 (a proposal costs three products, chained). On
        a 2-vCPU Xeon with AMX, where int8 runs on specd's tiles, a proposal after a served pass (its
        weights cold) took 4.99 ms for one row with int8 blocks and products against 6.13 in float32,
        6.85 against 9.35 for four rows (scripts/heads_precision.py). Greedy and coupled sampled
        sessions score one row (verify_service/scorer.py), other sampling ones every row of the pass.
        A batch's rows take its row count's precision, so a row's confidences may differ from its
        own alone by a reduced precision's rounding (its proposals are rescored in float32). Then a
        whole proposal natively (verify_service/native_heads.py) against the framework's at the
        precisions chosen (_tune_native). Float32, unmeasured, off the CPU."""
        self.product_dtypes, self.block_dtypes = {}, {}
        self.native, self.native_rows = None, {}
        if self.head_columns.device.type != "cpu":
            return {}
        h = self.config.hidden_size
        precisions = (FLOAT32, *REDUCED) if h % GROUP == 0 else (FLOAT32, BFLOAT16)  # Int8Linear packs whole groups
        blocks = (FLOAT32, INT8) if h % GROUP == 0 else (FLOAT32,)
        for precision in precisions[1:]:
            self._reduce(precision)
        if INT8 in blocks:
            self._pack_blocks()
        threads = torch.get_num_threads()
        outputs = {n: torch.randn(n, h) for n in rows}  # [n, H], made before the timing
        tokens = {n: torch.randint(0, self.config.vocab_size, (n, len(self.heads))) for n in rows}  # [n, K]

        def timed_blocks(n: int, precision: str):
            def run():
                self.block_dtypes = {n: precision}
                self.head_outputs(outputs[n], tokens[n])
            return run

        def runs() -> dict:
            products = {(threads, n, precision): lambda n=n, precision=precision: self.top_columns(outputs[n], 1, precision)
                        for n in rows for precision in precisions}
            return products | {(threads, n, f"blocks {precision}"): timed_blocks(n, precision) for n in rows for precision in blocks}

        # in the timing's name: a start-up cache of other precisions is measured over
        timed = measure(f"heads product ({', '.join(precisions)}; blocks {', '.join(blocks)})", runs, repeats)
        costs = {key[1:]: seconds * 1e3 for key, seconds in timed.items()}  # (rows, precision) → ms
        self.block_dtypes = {}
        for n in rows if costs else ():
            self.product_dtypes[n] = faster_than_float32(costs, n, precisions[1:])
            self.block_dtypes[n] = faster_than_float32(costs, n, [f"blocks {INT8}"] if INT8 in blocks else [],
                                                       f"blocks {FLOAT32}").removeprefix("blocks ")
        used = set(self.product_dtypes.values()) & set(REDUCED)
        self.reduced = {precision: columns for precision, columns in self.reduced.items() if precision in used}
        if not used:
            self.rescoring = None
        if INT8 not in self.block_dtypes.values():
            self.packed_blocks = {}

        def described(n: int, chosen: str, names: Sequence[str], prefix: str = "") -> str:
            return f"{chosen} (" + ", ".join(f"{costs[n, prefix + name]:.2f} ms {name}" for name in names) + ")"

        chosen = {n: described(n, self.product_dtypes[n], precisions) + "; blocks " + described(n, self.block_dtypes[n], blocks, "blocks ")
                  for n in self.product_dtypes}
        natively = self._tune_native(rows, repeats, measure) if costs else {}
        return {n: chosen[n] + natively.get(n, "") for n in chosen}

    def _tune_native(self, rows: Sequence[int], repeats: int, measure: autotune.Measure) -> dict[int, str]:
        """Time a whole proposal (every head, one candidate) natively (NativeHeads) and by the framework at
        the precisions just chosen, for each row count in rows, interleaved; propose natively where it is
        REDUCED_MARGIN faster. Returns rows → what was measured ("" for every row count where it cannot run)."""
        from verify_service import native_heads

        why = native_heads.unavailable(self)
        if why:
            return {n: f"; proposals by the framework (native: {why})" for n in rows}
        native = native_heads.NativeHeads(self)
        h, layers = self.config.hidden_size, len(self.config.fusion_layers)
        features = {n: torch.randn(n, h) for n in rows}  # [n, H]
        tokens = {n: torch.randint(0, self.config.vocab_size, (n,)) for n in rows}  # [n]
        fused = {n: torch.randn(n, layers, h) if layers else None for n in rows}  # [n, L, H]

        def proposal(n: int, natively: bool):
            def run():
                self.native, self.native_rows = (native, {1: True}) if natively else (None, {})
                self.ranked(features[n], tokens[n], fused[n])
            return run

        def runs() -> dict:
            return {(torch.get_num_threads(), n, way): proposal(n, way == "native") for n in rows for way in ("native", "framework")}

        timed = measure("heads proposal (native int4, framework)", runs, repeats)
        costs = {key[1:]: seconds * 1e3 for key, seconds in timed.items()}  # (rows, way) → ms
        self.native_rows = {n: costs[n, "native"] * REDUCED_MARGIN < costs[n, "framework"] for n in rows} if costs else {}
        self.native = native if any(self.native_rows.values()) else None
        return {n: f"; proposals {'native' if self.native_rows.get(n) else 'framework'} ({costs[n, 'native']:.2f} ms native int4, "
                   f"{costs[n, 'framework']:.2f} ms framework)" for n in rows if costs}


def faster_than_float32(costs: dict[tuple[int, str], float], rows: int, reduced: Sequence[str], float32: str = FLOAT32) -> str:
    """The fastest of the reduced choices for `rows` rows where it measured REDUCED_MARGIN faster than
    float32's (costs: (rows, name) → ms), else float32's name."""
    if not reduced:
        return float32
    fastest = min(reduced, key=lambda name: costs[rows, name])
    return fastest if costs[rows, fastest] * REDUCED_MARGIN < costs[rows, float32] else float32


def save_heads(heads: MedusaHeads, folder: Path) -> int:
    """Weights (bf16 safetensors, vocab_ids int64) + config; returns bytes written."""
    return save_head_files(heads.state_dict(), heads.config, folder, WEIGHTS_FILE, CONFIG_FILE)


def load_heads(folder: Path, target_model, expected_digest: str = "") -> MedusaHeads:
    """Saved heads bound to the target's LM head, float32, eval mode. Raises ValueError when they were
    trained for another vocabulary (size, width or tokenizer digest)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = MedusaConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    lm_head = target_model.get_output_embeddings().weight  # [V, H]
    if tuple(lm_head.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"Medusa heads in {folder} were trained for a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.hidden_size}; this target has {lm_head.shape[0]} and {lm_head.shape[1]}"
        )
    if expected_digest and config.vocab_digest and config.vocab_digest != expected_digest:
        raise ValueError(f"Medusa heads in {folder} were trained for another tokenizer (digest {config.vocab_digest}, "
                         f"the target's is {expected_digest})")
    state = load_file(str(folder / WEIGHTS_FILE))
    heads = MedusaHeads(config, lm_head, state["vocab_ids"], target_model.get_input_embeddings().weight)
    heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return heads.eval()
