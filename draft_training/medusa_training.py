"""`specd train-draft --recipe medusa-*`: Medusa heads for the verify service (verify_service/medusa.py).

The same data as the feature head (feature_training.run_feature_data: the corpus of the target's
answers, public reference answers, the target's final hidden states at every position), the same
resumable loop (loop.py), its own objective: head k at row t learns the target's distribution of
x_{t+1+k}, i.e. the target's scores from row t + k, over the heads' vocabulary (soft cross-entropy:
a loss against the target's distribution, not only its argmax). Heads are position-wise (no
attention), so a batch is simply the rows of its records, concatenated.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from draft_training.distill_data import Budget
from draft_training.feature_data import feature_stage
from draft_training.feature_training import (FeatureRecipe, choose_vocab, corpus_prompts, eval_records, load_feature_records,
                                             run_feature_data, with_overrides)
from draft_training.train_prompts import KINDS, passage_check

log = logging.getLogger(__name__)


@dataclass
class MedusaRecipe(FeatureRecipe):
    num_heads: int = 3
    num_layers: int = 1
    next_token_input: bool = False  # heads also read the row's own next token (verify_service/medusa.py)
    chained_input: bool = False  # ... and head k the earlier heads' tokens too (Hydra)
    fusion_layers: list[int] = field(default_factory=list)  # decoder layers whose outputs the heads' input fuses (EAGLE-3)


_TINY = MedusaRecipe(  # a test of a whole run
    gen_per_kind={kind: 4 for kind in KINDS}, eval_per_kind=2, max_new_tokens=24, gen_batch=8, reference_rows=8,
    draft_vocab=0, epochs=80, batch_tokens=256, lr=1e-2, warmup_steps=3,
)
# Trains on the committed corpus (feature rows shared with the feature-corpus recipe's work dir layout).
_CORPUS = MedusaRecipe(
    use_corpus=True, reference_rows=8000, max_new_tokens=192, feature_batch=16, generated_repeats=2,
    epochs=2, batch_tokens=8192, lr=2e-3,
)
MEDUSA_RECIPES = {
    "medusa-tiny": _TINY,
    "medusa-chain-tiny": replace(_TINY, next_token_input=True, chained_input=True),
    "medusa-corpus": _CORPUS,
    "medusa-token-corpus": replace(_CORPUS, next_token_input=True),
    "medusa-chain-corpus": replace(_CORPUS, next_token_input=True, chained_input=True),
    "medusa-chain2-corpus": replace(_CORPUS, next_token_input=True, chained_input=True, num_layers=2),
    # low and middle layers of the default target's 30 fused into the final features (EAGLE-3); trains on the
    # records whose layer outputs are stored (--tf-minutes extracts more, resumably)
    "medusa-fusion-corpus": replace(_CORPUS, next_token_input=True, chained_input=True, num_layers=2, fusion_layers=[2, 15]),
    "medusa-fusion-tiny": replace(_TINY, next_token_input=True, chained_input=True, fusion_layers=[1]),
}


def answer_rows(records: list[dict]) -> torch.Tensor:
    """The rows whose target scores the heads learn, every record's f_start..f_{T-1} concatenated:
    [R, H]. Head k's targets are a suffix of each record's (medusa_rows' sources index them), so the
    target's distribution is computed once a row instead of once a head."""
    return torch.cat([r["features"][r["start"] :] for r in records]).float()


def medusa_rows(records: list[dict], heads: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Per head k = 1..heads: (inputs [N_k, H], tokens [N_k, k], sources [N_k], layers [N_k, L, H] or
    None) over every record's answer rows t (start - 1 ≤ t, t + k < T): inputs f_t, tokens
    x_{t+1}..x_{t+k} (the row's own next token, then what a chained head reads in place of the earlier
    heads' proposals: the answer's own tokens, i.e. teacher forcing), sources the index in
    answer_rows(records) of f_{t+k} (the row whose target scores are x_{t+1+k}'s), layers the fused
    layers' outputs at t where the records carry them (their row 0 is t = start - 1)."""
    offsets = [0]
    for r in records:
        offsets.append(offsets[-1] + len(r["tokens"]) - r["start"])
    out = []
    for k in range(1, heads + 1):
        kept = [(r, offset) for r, offset in zip(records, offsets) if len(r["tokens"]) - k > r["start"] - 1]
        inputs = [r["features"][r["start"] - 1 : len(r["tokens"]) - k] for r, _ in kept]
        tokens = [torch.stack([r["tokens"][r["start"] + c : len(r["tokens"]) - k + 1 + c] for c in range(k)], dim=1) for r, _ in kept]
        sources = [torch.arange(offset + k - 1, offset + len(r["tokens"]) - r["start"]) for r, offset in kept]
        layers = None
        if "layer_features" in records[0]:  # row 0 of a record's layer outputs is t = start - 1
            layers = torch.cat([r["layer_features"][: len(r["tokens"]) - k - r["start"] + 1] for r, _ in kept]).float()
        out.append((torch.cat(inputs).float(), torch.cat(tokens).long(), torch.cat(sources), layers))
    return out


def medusa_loss(heads, batch: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over heads of the soft cross-entropy between each head's scores at row t and the target's
    scores from row t + k (both over the heads' vocabulary). Returns (loss, head 1's argmax agreement)."""
    with torch.no_grad():
        targets = torch.softmax(answer_rows(batch).to(device) @ heads.head_columns, dim=-1)  # [R, V']
    total, agreement = 0.0, None
    for index, (inputs, tokens, sources, layers) in enumerate(medusa_rows(batch, heads.config.num_heads)):
        inputs, tokens = inputs.to(device), tokens.to(device)  # [N, H], [N, k]
        fused = heads.fused(inputs, layers.to(device) if layers is not None else None)  # [N, H]
        scores = heads.head_output(index, fused, tokens) @ heads.head_columns  # [N, V']
        p = targets[sources.to(device)]  # [N, V']
        total = total + F.cross_entropy(scores, p) / heads.config.num_heads  # soft targets: −Σ p log softmax(scores), averaged
        if agreement is None:
            agreement = (scores.argmax(dim=-1) == p.argmax(dim=-1)).float().mean()
    return total, agreement


def simulate_chain(proposals: list[list[int]], tokens: list[int], start: int, k: int) -> tuple[int, list[int]]:
    """Greedy head rounds over one answer (tokens[start:]), as the gateway runs them under the fixed
    policy with no other drafter: the first pass reads the prompt and has no proposals; each later
    pass verifies the k proposals of row L - 2 (L = committed length: its next token is the last
    committed one), at most one fewer than the tokens left, and keeps the agreeing prefix plus the
    target's own token. proposals[t]: the heads' tokens at row t. Returns (passes, accepted per round that drafted)."""
    length, passes, accepted = start + 1, 1, []
    while length < len(tokens):
        drafts = proposals[length - 2][: min(k, len(tokens) - length - 1)]
        a = next((i for i, d in enumerate(drafts) if d != tokens[length + i]), len(drafts))
        passes += 1
        if drafts:  # the last pass may have room for the target's own token only
            accepted.append(a)
        length += 1 + a
    return passes, accepted


def chain_report(records: list[dict], all_proposals: list[list[list[int]]], heads: int) -> dict:
    """Simulated greedy chains of k = 1..heads drafts over the records (simulate_chain): tokens per
    target pass, overall and per task kind."""
    report = {}
    for k in range(1, heads + 1):
        by_kind: dict = {}
        for record, proposals in zip(records, all_proposals):
            passes, _ = simulate_chain(proposals, record["tokens"].tolist(), record["start"], k)
            entry = by_kind.setdefault(record["category"], [0, 0])
            entry[0], entry[1] = entry[0] + passes, entry[1] + len(record["tokens"]) - record["start"]
        passes, produced = (sum(v[i] for v in by_kind.values()) for i in (0, 1))
        report[f"k{k}"] = {"tokens_per_pass": round(produced / max(passes, 1), 4),
                           "by_kind": {kind: round(v[1] / v[0], 4) for kind, v in sorted(by_kind.items())}}
    return report


def medusa_evaluation(heads, target, work: Path, limit: int,
                      holds_passage: Optional[Callable[[Sequence[int]], bool]] = None) -> dict:
    """Held-out answers: each head's top-1 agreement with the target's greedy token, and simulated
    greedy chains of k = 1..K drafts (tokens per target pass), overall and per task kind. With
    `holds_passage` (train_prompts.passage_check of the corpus's prompts) also the chains on the
    held-out answers whose prompt holds no corpus passage ("leak_free"), where heads trained with and
    without the leaking records compare fairly."""
    records = eval_records(target, work, limit, heads.config.fusion_layers)
    report: dict = {"held_out_answers": len(records), "answer_tokens": sum(len(r["tokens"]) - r["start"] for r in records)}
    with torch.inference_mode():
        hits = torch.zeros(heads.config.num_heads)
        counts = torch.zeros(heads.config.num_heads)
        all_proposals = []
        for record in records:
            tokens, first = record["tokens"].long(), record["start"] - 1  # the heads are read from row start - 1 on
            next_tokens = torch.cat((tokens[1:], tokens[-1:]))  # [T]: the row's own next token (the last row's is unused)
            read = record["features"][first:].float()  # [T - first, H]
            proposals = heads.propose(read, next_tokens[first:], record.get("layer_features"))  # [T - first, K]
            all_proposals.append([[]] * first + proposals.tolist())  # indexed by row
            for k in range(1, heads.config.num_heads + 1):
                rows = torch.arange(first, len(tokens) - 1 - k)
                hits[k - 1] += (proposals[rows - first, k - 1] == tokens[rows + 1 + k]).sum()
                counts[k - 1] += len(rows)
        report["top1_by_head"] = [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)]
        report.update(chain_report(records, all_proposals, heads.config.num_heads))
        if holds_passage is not None:
            leaked = [holds_passage(r["tokens"][: r["start"]].tolist()) for r in records]
            clean = [(r, p) for r, p, leak in zip(records, all_proposals, leaked) if not leak]
            report["leak_free"] = {"held_out_answers": len(clean), "leaked_by_kind": dict(collections.Counter(
                r["category"] for r, leak in zip(records, leaked) if leak)),
                **chain_report([r for r, _ in clean], [p for _, p in clean], heads.config.num_heads)}
    def tokens_per_pass(chains: dict) -> list[float]:
        return [chains[f"k{k}"]["tokens_per_pass"] for k in range(1, heads.config.num_heads + 1)]

    log.info("eval: top-1 by head %s; tokens/pass %s", report["top1_by_head"], tokens_per_pass(report))
    if "leak_free" in report:
        log.info("eval: on the %d held-out answers whose prompts hold no corpus passage, tokens/pass %s",
                 report["leak_free"]["held_out_answers"], tokens_per_pass(report["leak_free"]))
    return report


def build_heads(target, vocab_ids: torch.Tensor, target_spec: str, recipe: MedusaRecipe):
    from specd_engine.models import vocab_digest
    from verify_service.medusa import MedusaConfig, MedusaHeads

    model = target.model
    config = MedusaConfig(hidden_size=model.config.hidden_size, num_heads=recipe.num_heads, vocab_size=model.config.vocab_size,
                          draft_vocab_size=len(vocab_ids), num_layers=recipe.num_layers,
                          next_token_input=recipe.next_token_input, chained_input=recipe.chained_input,
                          fusion_layers=list(recipe.fusion_layers), target=target_spec, vocab_digest=vocab_digest(target.tokenizer))
    return MedusaHeads(config, model.get_output_embeddings().weight, vocab_ids, model.get_input_embeddings().weight)


def reshaped_from(heads, target_model, **changes):
    """Heads of the config `heads.config` with `changes` (chained_input=True, a larger num_layers) that
    compute exactly what `heads` do until trained: a first block that reads more tokens gains zero
    weight columns for them, and an added block starts as the identity (ResidualBlock's zero init),
    so a run with the new shape starts from trained heads instead of from scratch."""
    from verify_service.medusa import MedusaHeads

    reshaped = MedusaHeads(replace(heads.config, **changes), target_model.get_output_embeddings().weight,
                           heads.vocab_ids, target_model.get_input_embeddings().weight)
    state = reshaped.state_dict()  # the new shape's zero-initialized blocks, overwritten where `heads` has weights
    for name, weight in heads.state_dict().items():
        if weight.shape != state[name].shape:  # a first block's weight [H, H + n·H]: zero columns for the new tokens
            weight = torch.cat((weight, weight.new_zeros(weight.shape[0], state[name].shape[1] - weight.shape[1])), dim=1)
        state[name] = weight
    reshaped.load_state_dict(state)
    return reshaped


def starting_heads(target, folder: Path, recipe: MedusaRecipe):
    """Saved heads to train further (weights and vocabulary), after checking they fit this target and
    this recipe's shape (token-input heads may go on as chained ones, and heads may gain blocks): a
    warm start costs a fraction of training from scratch on a CPU."""
    from specd_engine.models import vocab_digest
    from verify_service.medusa import load_heads

    heads = load_heads(folder, target.model, vocab_digest(target.tokenizer))
    config = heads.config
    changes = {}
    if recipe.chained_input and config.next_token_input and not config.chained_input:
        changes["chained_input"] = True
    if recipe.num_layers > config.num_layers:
        changes["num_layers"] = recipe.num_layers
    if recipe.fusion_layers and not config.fusion_layers:
        changes["fusion_layers"] = list(recipe.fusion_layers)
    if changes:
        heads = reshaped_from(heads, target.model, **changes)
    shape = (heads.config.num_heads, heads.config.num_layers, heads.config.next_token_input, heads.config.chained_input,
             list(heads.config.fusion_layers))
    wanted = (recipe.num_heads, recipe.num_layers, recipe.next_token_input, recipe.chained_input, list(recipe.fusion_layers))
    if shape != wanted:
        raise ValueError(f"the heads in {folder} have (heads, layers, token input, chained, fused layers) {shape}; the recipe wants "
                         f"{wanted}: pick the matching recipe")
    log.info("train: starting from the heads in %s (%d-token vocabulary%s)", folder, heads.config.draft_vocab_size,
             f"; reshaped: {changes}" if changes else "")
    return heads.train()


def run_medusa_recipe(args) -> int:
    """`specd train-draft --recipe medusa-*`: data → train → eval → save, each stage resumable."""
    from draft_training.loop import start_run, train_draft, write_run_records
    from specd_engine.models import eos_token_ids
    from verify_service.medusa import save_heads

    recipe = with_overrides(MEDUSA_RECIPES[args.recipe], args)
    work, device, target = start_run(args, recipe)
    sources = run_feature_data(target, recipe, Path(args.data_dir), work)
    if recipe.fusion_layers:  # the fused layers' outputs, for as many records as the budget allows (resumable)
        feature_stage(target.model, sources, work / "data", batch_size=recipe.feature_batch, budget=Budget(recipe.feature_minutes),
                      layers=recipe.fusion_layers)
    records = load_feature_records(work, target.model.config.max_position_embeddings, recipe.generated_repeats, recipe.fusion_layers,
                                   sources, recipe.kind_balance)
    if recipe.init_head:
        heads = starting_heads(target, Path(recipe.init_head), recipe)
    else:
        vocab_path = work / "train" / "vocab.pt"
        if not vocab_path.exists():  # chosen once, so a resumed run trains the same heads
            vocab_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(choose_vocab(records, recipe.draft_vocab, target.model.config.vocab_size, eos_token_ids(target)), vocab_path)
        heads = build_heads(target, torch.load(vocab_path), args.target, recipe)
    state = train_draft(heads, records, recipe, work, device, loss_fn=medusa_loss)
    heads = heads.cpu().eval()
    target.model.cpu()
    output = Path(args.output or work / "medusa")
    report = {} if args.skip_eval else medusa_evaluation(heads, replace(target, device=torch.device("cpu")), work, args.eval_limit,
                                                         passage_check(corpus_prompts(target.name)) if recipe.use_corpus else None)
    size = save_heads(heads, output)
    write_run_records(output, {"name": args.recipe, "target": args.target, **asdict(recipe), "train_records": len(records),
                               "train_answer_tokens": sum(len(r["tokens"]) - r["start"] for r in records)}, report, state)
    log.info("saved the Medusa heads to %s (%.1f MB)", output, size / 1e6)
    return 0
