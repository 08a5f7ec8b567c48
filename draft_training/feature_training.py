"""`specd train-draft --recipe feature-*`: an EAGLE-style feature head for a target, resumably.

Stages, each resumable from <work-dir> (docs/draft-training.md has the results, and the stand-alone
small-Llama draft this pipeline replaced):
  1. data     — held-out answers (eval), training answers (generated), then target features for the
                training answers and public reference answers (feature_data.py);
  2. train    — the head learns to predict the target's next feature and next-token distribution;
  3. eval     — greedy speculation simulated on held-out answers, per task kind and draft position;
  4. save     — head weights (bf16 safetensors) + config + the run's JSON records, a few MB.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from draft_training import distill_data, feature_data
from draft_training.distill_data import Budget
from draft_training.train_prompts import KINDS, load_all_prompts, select_prompts

log = logging.getLogger(__name__)


@dataclass
class FeatureRecipe:
    """Everything that decides the result; saved next to the head so it can be reproduced."""

    gen_per_kind: dict = field(default_factory=dict)  # kind → max prompts answered by the target
    eval_per_kind: int = 12
    held_out_fraction: float = 0.1
    max_new_tokens: int = 128
    gen_batch: int = 16
    reference_rows: int = 0  # public reference answers, teacher-forced
    feature_batch: int = 8
    generated_repeats: int = 3  # the target's own answers (all task kinds) count this many times per epoch
    draft_vocab: int = 8192  # the head scores only the most frequent target choices (0 = all)
    epochs: int = 4
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup_steps: int = 20
    feature_loss_weight: float = 1.0
    token_loss_weight: float = 0.1
    ttt_passes: int = 1  # drafting steps trained (EAGLE-3 training-time test; 1 = the first step only)
    use_corpus: bool = False  # also train on the committed corpus of the target's answers (draft_training/corpus.py)
    corpus_from: int = 0  # the corpus's records from this one on (in the order they were added): a head trained further sees only answers new to it
    kind_answer_cap: int = 0  # at most this many corpus answers of each kind, spread evenly over the corpus's order (0 = all)
    kind_balance: int = 0  # thin kinds' answers repeat up to this many times, toward an equal share of positions a kind (0 = off)
    init_head: str = ""  # start from this saved head (its weights and vocabulary) instead of the target's last layer
    gen_minutes: float = 0.0  # budgets; 0 = unlimited
    feature_minutes: float = 0.0
    train_minutes: float = 0.0
    seed: int = 0


FEATURE_RECIPES = {
    "feature-tiny": FeatureRecipe(
        gen_per_kind={kind: 4 for kind in KINDS}, eval_per_kind=2, max_new_tokens=24, gen_batch=8, reference_rows=8,
        draft_vocab=0, epochs=20, batch_tokens=256, lr=1e-2, warmup_steps=3,
    ),
    "feature-cpu": FeatureRecipe(
        gen_per_kind={"math": 150, "code": 190, "chat": 160, "writing": 220, "translation": 165, "summarization": 290, "qa": 135},
        reference_rows=8000, gen_minutes=14, feature_minutes=22, train_minutes=45,
    ),
    # The accumulated corpus instead of per-run generation: features recomputed from its ids (issue 13).
    "feature-corpus": FeatureRecipe(
        use_corpus=True, reference_rows=8000, max_new_tokens=192, feature_batch=16, generated_repeats=2,
        epochs=6, batch_tokens=8192,
    ),
    "feature-full": FeatureRecipe(
        gen_per_kind={kind: 100_000 for kind in KINDS}, eval_per_kind=24, max_new_tokens=256, gen_batch=64,
        reference_rows=8000, feature_batch=32, epochs=10, batch_tokens=16384,
    ),
}


def run_feature_data(target, recipe: FeatureRecipe, data_dir: Path, work: Path) -> list[dict]:
    """Stage 1: eval answers, training answers (budgeted), then features (budgeted). Returns the
    feature sources (id, category, tokens, start), in the order their features are extracted."""
    from specd_engine.models import eos_token_ids

    rows = load_all_prompts(data_dir)
    eos = eos_token_ids(target)
    data = work / "data"
    common = dict(batch_size=recipe.gen_batch, max_new_tokens=recipe.max_new_tokens, top_k=1, eos_ids=eos)
    eval_rows = select_prompts(rows, {k: recipe.eval_per_kind for k in KINDS}, True, recipe.held_out_fraction, recipe.seed)
    distill_data.generate_stage(target.model, target.tokenizer, eval_rows, data, "gen-eval", budget=Budget(0), **common)
    train_rows = select_prompts(rows, recipe.gen_per_kind, False, recipe.held_out_fraction, recipe.seed)
    distill_data.generate_stage(target.model, target.tokenizer, train_rows, data, "gen-train", budget=Budget(recipe.gen_minutes), **common)
    generated = distill_data.load_records(data, "gen-train")
    if recipe.use_corpus:
        held_out_prompts = [record["tokens"][: record["start"]].tolist() for record in distill_data.load_records(data, "gen-eval")]
        generated += corpus_sources(target.name, recipe.held_out_fraction, held_out_prompts, recipe.corpus_from,
                                    recipe.kind_answer_cap)
    answered = {record["id"] for record in generated}
    references = [
        row for row in select_prompts(rows, {k: 100_000 for k in KINDS}, False, recipe.held_out_fraction, recipe.seed)
        if row.get("reference") and row["id"] not in answered
    ][: recipe.reference_rows]
    sources = feature_data.feature_sources(target.tokenizer, generated, references, recipe.max_new_tokens)
    feature_data.feature_stage(target.model, sources, data, batch_size=recipe.feature_batch, budget=Budget(recipe.feature_minutes))
    return sources


def corpus_sources(target_name: str, held_out_fraction: float, held_out_prompts: Sequence[Sequence[int]] = (),
                   first: int = 0, kind_cap: int = 0) -> list[dict]:
    """The committed corpus's answers from record `first` on as feature sources (ids
    'corpus:<mode>:<prompt id>'), leaving out those whose prompt shares a passage with one of
    `held_out_prompts` (train_prompts.leaking_prompts), and with `kind_cap` at most that many of
    each kind (capped_by_kind). The corpus never answers held-out prompts; checked here too, since
    evaluation prompts must stay unseen."""
    from draft_training.corpus import Corpus, corpus_dir
    from draft_training.train_prompts import is_held_out, leaking_prompts

    records = Corpus.open(corpus_dir(target_name)).records
    if any(is_held_out(record.id, held_out_fraction) for record in records):
        raise ValueError(f"the corpus of {target_name} holds answers to held-out prompts; it was made with another split")
    leaks = leaking_prompts([record.tokens[: record.start] for record in records], held_out_prompts)
    kept = [record for record, leak in zip(records[first:], leaks[first:]) if not leak]
    if kind_cap:
        kept = [kept[i] for i in capped_by_kind([record.kind for record in kept], kind_cap)]
    log.info("corpus: %d answers from record %d on, %d left out as sharing passages with held-out prompts; %d answers, %d answer tokens",
             len(records) - first, first, sum(leaks[first:]), len(kept), sum(len(r.tokens) - r.start for r in kept))
    return [{"id": f"corpus:{r.mode}:{r.id}", "category": r.kind, "tokens": r.tokens, "start": r.start} for r in kept]


def corpus_prompts(target_name: str) -> list[list[int]]:
    """Every prompt the committed corpus answers (token ids), the leaking ones too: what heads trained
    on any version of the corpus may have seen (train_prompts.passage_check)."""
    from draft_training.corpus import Corpus, corpus_dir

    return [record.tokens[: record.start] for record in Corpus.open(corpus_dir(target_name)).records]


def capped_by_kind(kinds: Sequence[str], cap: int) -> list[int]:
    """Indices of at most `cap` items of each kind, spread evenly over each kind's items (first and
    last included), in their original order: a kind that fills most of the corpus (the math and code
    prompt sets are the largest) stops drowning the thin ones, and the kept answers still span every
    generation session rather than the oldest alone."""
    by_kind: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    kept = []
    for indices in by_kind.values():
        if len(indices) <= cap:
            kept += indices
        else:
            kept += [indices[round(j * (len(indices) - 1) / max(1, cap - 1))] for j in range(cap)]
    return sorted(kept)


def kind_repeats(positions_by_kind: dict[str, int], max_repeat: int) -> dict[str, int]:
    """How many times each kind's answers count in an epoch so that every kind nears an equal share
    of the answer positions: round(mean / own), between 1 and `max_repeat`. The held-out answers
    weigh every kind equally, while the corpus holds ~90x more math than translation; repeating the
    thin kinds (capped, since a few hundred answers repeated many times are memorized) keeps a run on
    the whole corpus from forgetting them (docs/draft-training.md, "A GPU run")."""
    if not positions_by_kind:
        return {}
    mean = sum(positions_by_kind.values()) / len(positions_by_kind)
    return {kind: min(max_repeat, max(1, round(mean / max(1, own)))) for kind, own in positions_by_kind.items()}


def load_feature_records(work: Path, max_length: int, generated_repeats: int = 1, layers: Sequence[int] = (),
                         sources: Optional[Sequence[dict]] = None, kind_balance: int = 0) -> list[dict]:
    """Stored feature records with at least one answer position, cut to `max_length` tokens; the
    target's generated answers (ids without "ref:") repeated `generated_repeats` times, because they
    are few, cover every task kind and come from the distribution the draft serves. With `layers`
    only the records whose layer outputs are stored too (feature_data.target_layers), with them; with
    `sources` (run_feature_data's) only theirs, so a recipe with fewer reference answers than a work
    dir holds trains on its own. With `kind_balance` the generated answers of thin kinds count more
    (kind_repeats, up to that many times more)."""
    layered = distill_data.load_records(work / "data", feature_data.layer_prefix(layers)) if layers else []
    stored = {r["id"]: r["layer_features"] for r in layered}
    kept, records = [], distill_data.load_records(work / "data", "feat-train")
    chosen = {source["id"] for source in sources or ()}
    usable = []
    for record in records:
        cut = min(len(record["tokens"]), max_length)
        wanted = (not layers or record["id"] in stored) and (sources is None or record["id"] in chosen)
        if cut - record["start"] >= 1 and record["start"] >= 1 and wanted:
            usable.append((record, cut))
    positions: dict[str, int] = {}
    for record, cut in usable:
        if not record["id"].startswith("ref:"):
            positions[record["category"]] = positions.get(record["category"], 0) + cut - record["start"]
    by_kind = kind_repeats(positions, kind_balance) if kind_balance else {}
    if by_kind:
        log.info("kind balance: generated answers of each kind count %s times (x%d)", by_kind, generated_repeats)
    for record, cut in usable:
        repeats = 1 if record["id"].startswith("ref:") else generated_repeats * by_kind.get(record["category"], 1)
        extra = {"layer_features": stored[record["id"]][: cut - record["start"] + 1]} if layers else {}
        kept += [dict(record, tokens=record["tokens"][:cut], features=record["features"][:cut], **extra)] * repeats
    if layers:
        log.info("records with the outputs of layers %s: %d of %d", list(layers), len({r["id"] for r in kept}), len(records))
    return kept


def choose_vocab(records: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` ids the head scores: the most frequent answer tokens (the target's own choices, for
    generated answers), plus `always` (EOS). size 0 or ≥ vocab_size → every id. Sorted ids [V']."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size)
    for record in records:
        counts += torch.bincount(record["tokens"][record["start"] :].long(), minlength=vocab_size).float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.sort(torch.topk(counts, size).indices).values


def run_vocab(work: Path, records: list[dict], size: int, target) -> torch.Tensor:
    """The draft vocabulary of the run in `work` (choose_vocab, always holding EOS): chosen once and
    kept in train/vocab.pt, so a resumed run trains the same head."""
    from specd_engine.models import eos_token_ids

    path = work / "train" / "vocab.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(choose_vocab(records, size, target.model.config.vocab_size, eos_token_ids(target)), path)
    return torch.load(path)


def padded(batch: list[dict], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T] and features [B, T, H] (float32)."""
    width = max(len(r["tokens"]) for r in batch)
    tokens = torch.zeros((len(batch), width), dtype=torch.long)
    features = torch.zeros((len(batch), width, hidden))
    for row, record in enumerate(batch):
        tokens[row, : len(record["tokens"])] = record["tokens"].long()
        features[row, : len(record["tokens"])] = record["features"].float()
    return tokens, features


def feature_loss(head, batch: list[dict], device: torch.device, noise: float = 0.1,
                 feature_weight: float = 1.0, token_weight: float = 0.1, passes: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's objective at every answer position t (the head's output at t predicts x_{t+1}):
    smooth-L1 between f̂_t and the target's f_t, plus soft cross-entropy between the head's scores
    from f̂_t and the target's (from f_t) over the head's vocabulary. Input features get uniform
    noise so the head tolerates its own estimates when drafting several steps.

    passes > 1 adds EAGLE-3's training-time test: the same objective for drafting steps 2..passes,
    where the head reads its own earlier estimates (FeatureHead.unrolled); the passes count equally.

    Returns (loss, agreement): agreement = argmax from f̂_t equals argmax from f_t, first pass."""
    tokens, features = padded(batch, head.config.hidden_size)
    tokens, features = tokens.to(device), features.to(device)  # [B, T], [B, T, H]
    width = tokens.shape[1]
    prev = features[:, :-1]  # [B, T-1, H]: f_{t-1} for inputs x_t, t = 1..T-1
    if noise:
        prev = prev + (torch.rand_like(prev) - 0.5) * 2 * noise
    estimates = head.unrolled(tokens[:, 1:], prev, torch.arange(1, width, device=device), passes)  # passes × [B, T-1, H]
    positions = torch.arange(1, width, device=device)[None, :]  # [1, T-1]
    starts = torch.tensor([r["start"] for r in batch], device=device)[:, None]
    lengths = torch.tensor([len(r["tokens"]) for r in batch], device=device)[:, None]
    answer = (positions >= starts - 1) & (positions < lengths)  # [B, T-1]: answer positions
    total, agreement = 0.0, None
    for step, predicted in enumerate(estimates):
        mask = answer & (positions > step)  # step j's row t drafts from position t - j, which must exist
        mine, theirs = predicted[mask], features[:, 1:][mask]  # [N, H]
        feature_term = F.smooth_l1_loss(mine, theirs)
        log_q = torch.log_softmax(head.logits(mine), dim=-1)  # [N, V']
        with torch.no_grad():
            p = torch.softmax(head.logits(theirs), dim=-1)  # [N, V']
        token_term = -(p * log_q).sum(dim=-1).mean()
        total = total + (feature_weight * feature_term + token_weight * token_term) / passes
        if agreement is None:
            agreement = (log_q.argmax(dim=-1) == p.argmax(dim=-1)).float().mean()
    return total, agreement


def build_head(target, vocab_ids: torch.Tensor, target_spec: str):
    """A fresh head for `target`: the layer starts as the target's last layer, fc passes features through."""
    from draft_service.feature_head import FeatureHead, FeatureHeadConfig, target_matrices
    from specd_engine.models import vocab_digest

    model = target.model
    config = FeatureHeadConfig.from_target(model.config, len(vocab_ids), target_spec, vocab_digest(target.tokenizer))
    head = FeatureHead(config, *target_matrices(model), vocab_ids)
    head.init_from_target_layer(model.model.layers[-1], model.model.norm)
    return head


def starting_head(target, folder: Path):
    """A saved head to train further (fine-tuning is far cheaper on a CPU than starting over): its weights
    and its vocabulary map, after checking it was trained for this target's vocabulary."""
    from draft_service.feature_head import CONFIG_FILE, load_head
    from specd_engine.models import vocab_digest

    saved = json.loads((folder / CONFIG_FILE).read_text())
    digest = vocab_digest(target.tokenizer)
    if saved.get("vocab_digest") and saved["vocab_digest"] != digest:
        raise ValueError(f"the head in {folder} was trained for another vocabulary (digest {saved['vocab_digest']}, "
                         f"this target's is {digest}); start without --init-head")
    log.info("train: starting from the head in %s (%d-token vocabulary)", folder, saved["draft_vocab_size"])
    return load_head(folder, target.model).train()


def eval_records(target, work: Path, limit: int, layers: Sequence[int] = ()) -> list[dict]:
    """Held-out answers with the target's features (one teacher-forced pass each batch), and with
    `layers` those layers' outputs from row start - 1 on (feature_data.target_layers)."""
    records = distill_data.load_records(work / "data", "gen-eval")[: limit or None]
    for begin in range(0, len(records), 8):
        batch = records[begin : begin + 8]
        sequences = [r["tokens"].tolist() for r in batch]
        if not layers:
            for record, rows in zip(batch, feature_data.target_features(target.model, sequences)):
                record["features"] = rows
            continue
        features, layer_rows = feature_data.target_features_and_layers(target.model, sequences, [r["start"] for r in batch], layers)
        for record, rows, layer_features in zip(batch, features, layer_rows):
            record["features"], record["layer_features"] = rows, layer_features
    return records


def head_step_ms(head, record: dict, repeats: int = 30) -> float:
    """Median ms of one drafting step after the prompt: a one-position head forward plus its scores."""
    import statistics

    from draft_service.feature_head import HeadCache

    start = record["start"]
    tokens, features = record["tokens"].long(), record["features"].float()
    cache = HeadCache()
    with torch.inference_mode():
        estimate = head(tokens[None, 1:start], features[None, : start - 1], torch.arange(1, start), cache)[0, -1]  # [H]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            token = int(torch.argmax(head.logits(estimate)))
            head(torch.tensor([[token]]), estimate[None, None], torch.tensor([start]), cache)
            times.append((time.perf_counter() - started) * 1000)
            cache.crop(start - 1)
    return round(statistics.median(times), 3)


def feature_evaluation(head, target, work: Path, limit: int, target_spec: str) -> dict:
    """Stage 3: simulated greedy speculation on held-out answers (head and n-gram), and cost."""
    from draft_training.draft_eval import evaluate_drafter, forward_ms
    from draft_service.drafters import NgramDrafter
    from draft_service.feature_drafter import FeatureDrafter
    from specd_engine.models import describe_model, max_sequence_length

    records = eval_records(target, work, limit)
    drafter = FeatureDrafter(head.eval(), describe_model(target), max_sequence_length(target))
    log.info("eval: %d held-out answers, %d tokens", len(records), sum(len(r["tokens"]) - r["start"] for r in records))
    with torch.inference_mode():
        report = {
            "held_out_answers": len(records),
            "draft": evaluate_drafter(drafter, records, ks=(1, 2, 3, 4)),
            "ngram": evaluate_drafter(NgramDrafter(), records, ks=(1, 2, 3, 4)),
        }
        for n in (2, 3):  # the head with prompt lookup first when the last n tokens recur
            report[f"draft_lookup{n}"] = evaluate_drafter(drafter, records, ks=(2, 3, 4), lookup_min_ngram=n)
        prompt = records[0]["tokens"][: records[0]["start"]].tolist()
        step = min(head_step_ms(head, records[0]) for _ in range(3))
        target_ms = min(forward_ms(target, prompt) for _ in range(3))
    report["cost"] = {"threads": torch.get_num_threads(), "draft_step_ms": step, "target_forward_ms": target_ms, "ratio": round(step / target_ms, 3)}
    log.info("cost: head step %.2f ms, target forward %.2f ms (ratio %.3f)", step, target_ms, step / target_ms)
    return report


def with_overrides(recipe, args, **more):
    """The recipe with the `specd train-draft` flags that were given (not None) in place of its own
    values; `more` adds recipe-specific flags. One place for every recipe family's overrides."""
    overrides = {"gen_minutes": args.gen_minutes, "feature_minutes": args.tf_minutes, "train_minutes": args.train_minutes,
                 "epochs": args.epochs, "reference_rows": args.reference_rows, "corpus_from": args.corpus_from,
                 "kind_answer_cap": args.kind_answer_cap, "kind_balance": args.kind_balance,
                 "init_head": args.init_head and str(Path(args.init_head).resolve()), **more}
    return replace(recipe, **{k: v for k, v in overrides.items() if v is not None})


def run_feature_recipe(args) -> int:
    """`specd train-draft --recipe feature-*`: data → train → eval → save, each stage resumable."""
    from functools import partial

    from draft_service.feature_head import save_head
    from draft_training.loop import start_run, train_draft, write_run_records

    recipe = with_overrides(FEATURE_RECIPES[args.recipe], args, ttt_passes=args.ttt_passes)
    work, device, target = start_run(args, recipe)
    sources = run_feature_data(target, recipe, Path(args.data_dir), work)
    records = load_feature_records(work, target.model.config.max_position_embeddings, recipe.generated_repeats, sources=sources,
                                   kind_balance=recipe.kind_balance)
    if recipe.init_head:
        head = starting_head(target, Path(recipe.init_head))
    else:
        head = build_head(target, run_vocab(work, records, recipe.draft_vocab, target), args.target)
    loss = partial(feature_loss, feature_weight=recipe.feature_loss_weight, token_weight=recipe.token_loss_weight,
                   passes=recipe.ttt_passes)
    state = train_draft(head, records, recipe, work, device, loss_fn=loss)
    head = head.cpu().eval()
    target.model.cpu()
    target = replace(target, device=torch.device("cpu"))
    output = Path(args.output or work / "draft")
    if args.skip_eval:  # keep an earlier evaluation of this (finished) checkpoint, if there is one
        report = json.loads((output / "eval.json").read_text()) if (output / "eval.json").exists() else {}
    else:
        report = feature_evaluation(head, target, work, args.eval_limit, args.target)
    size = save_head(head, output)
    write_run_records(output, {"name": args.recipe, "target": args.target, **asdict(recipe), "train_records": len(records),
                               "train_answer_tokens": sum(len(r["tokens"]) - r["start"] for r in records),
                               "train_tokens": sum(len(r["tokens"]) for r in records)}, report, state)
    log.info("saved the feature head to %s (%.1f MB)", output, size / 1e6)
    return 0
