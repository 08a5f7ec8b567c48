"""`specd train-draft --recipe eagle3-*`: an EAGLE-3 head for a target, in the EAGLE authors' layout.

EAGLE-3's recipe (Li et al. 2025), as specd runs it:
- **fused features**: the head reads three target layers side by side (hidden_states 2, L // 2, L - 3;
  the ones the verify returns to an EAGLE-3 draft), computed on the fly by one target forward a batch,
  so nothing is stored and a GPU never waits on the host for features;
- **training-time test**: drafting steps 2..passes are trained on the head's own earlier outputs, as
  it drafts (Eagle3Head.unrolled), each step's loss weighted 0.8^(step - 1);
- **a loss against the target's distribution**: soft cross-entropy between the head's scores and the
  target's next-token distribution over the draft vocabulary; no feature regression (EAGLE-3 drops it).

The head starts from the target: the decoder layer from the target's last layer (q/k/v read only the
hidden half), fc passes the highest layer through, norm and lm_head from the target's own. Data: the
committed corpus of the target's answers (draft_training/corpus.py) and, for targets without one, the
target's answers generated here. The loop (draft_training/loop.py) checkpoints and resumes; the head
is written as an EAGLE-3 checkpoint that `--drafter eagle3 --draft-model DIR` serves.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from draft_training import distill_data
from draft_training.feature_data import right_padded
from draft_training.distill_data import Budget
from draft_training.train_prompts import KINDS, load_all_prompts, select_prompts

log = logging.getLogger(__name__)
STEP_DECAY = 0.8  # EAGLE-3's weight of each later drafting step's loss relative to the one before


@dataclass
class Eagle3Recipe:
    """Everything that decides the result; saved next to the head."""

    gen_per_kind: dict = field(default_factory=dict)  # kind → prompts answered by the target here (besides the corpus)
    eval_per_kind: int = 12
    held_out_fraction: float = 0.1
    max_new_tokens: int = 192
    max_length: int = 1024  # tokens of a training sequence (prompt + answer)
    gen_batch: int = 16
    use_corpus: bool = True
    draft_vocab: int = 8192  # V': the most frequent answer tokens (0 = the whole vocabulary)
    ttt_passes: int = 4  # drafting steps trained (EAGLE-3 uses 7; each costs about one more pass of the head)
    epochs: int = 2
    batch_tokens: int = 8192
    lr: float = 5e-4
    warmup_steps: int = 30
    gen_minutes: float = 0.0
    train_minutes: float = 0.0
    seed: int = 0


EAGLE3_RECIPES = {
    "eagle3-tiny": Eagle3Recipe(gen_per_kind={kind: 4 for kind in KINDS}, eval_per_kind=2, max_new_tokens=24, gen_batch=8,
                                use_corpus=False, draft_vocab=0, ttt_passes=3, epochs=30, batch_tokens=256, lr=1e-2,
                                warmup_steps=3),
    "eagle3-corpus": Eagle3Recipe(gen_batch=96),  # a GPU answers the 84 held-out prompts in one batch
    # A 2-core CPU runs ~190 answer positions a second (the target's forward dominates): smaller steps, so
    # an hour's run takes well over a hundred optimizer steps rather than a few dozen.
    "eagle3-cpu": Eagle3Recipe(batch_tokens=2048, warmup_steps=10, lr=1e-3, ttt_passes=3),
}


def target_batch(target_model, batch: Sequence[dict], layers: Sequence[int], head_rows: torch.Tensor, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One right-padded target forward over the batch (feature_data.right_padded; no_grad, not inference
    mode, since the head's graph reads what it returns). Returns tokens [B, T], fused features [B, T, L·H]
    (hidden_states at `layers`, side by side), the target's scores over the draft vocabulary [B, T, V']
    (final hidden state @ head_rows.T, head_rows [V', H]) and lengths [B]."""
    tokens, attention = right_padded([record["tokens"] for record in batch], device)  # [B, T] each
    lengths = attention.sum(dim=1)  # [B]
    with torch.no_grad():
        output = target_model.model(input_ids=tokens, attention_mask=attention, output_hidden_states=True)
        fused = torch.cat([output.hidden_states[layer] for layer in layers], dim=-1)  # [B, T, L·H]
        scores = output.last_hidden_state.to(head_rows.dtype) @ head_rows.T  # [B, T, V']
    return tokens, fused, scores.float(), lengths


def eagle3_loss(head, batch: list[dict], device: torch.device, *, target_model, head_rows: torch.Tensor,
                passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's objective on a batch: at every answer position t, for drafting steps 1..passes, soft
    cross-entropy between the head's scores for x_{t+1} and the target's distribution there (both over
    the draft vocabulary), step j weighted STEP_DECAY^(j-1), the weights summing to one. Returns (loss,
    per-step agreement [passes]: the head's top choice equals the target's best within the draft vocabulary)."""
    layers = head.config.feature_layers
    tokens, fused, target_scores, lengths = target_batch(target_model, batch, layers, head_rows, device)
    width = tokens.shape[1]
    positions = torch.arange(1, width, device=device)  # [T-1]: input t reads x_t and f_{t-1}, scores x_{t+1}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    with autocast:
        outputs = head.unrolled(tokens[:, 1:], fused[:, :-1], positions, passes)  # passes × [B, T-1, H]
    starts = torch.tensor([record["start"] for record in batch], device=device)[:, None]
    answer = (positions[None, :] >= starts - 1) & (positions[None, :] < lengths[:, None])  # [B, T-1]
    weights = [STEP_DECAY**step for step in range(passes)]
    total, agreement = 0.0, []
    for step, output in enumerate(outputs):
        rows = answer & (positions[None, :] > step)  # step j's row t drafts from t - j, which must exist
        log_q = torch.log_softmax(head.logits(output[rows]), dim=-1)  # [N, V']
        p = torch.softmax(target_scores[:, 1:][rows], dim=-1)  # [N, V']
        total = total + weights[step] / sum(weights) * -(p * log_q).sum(dim=-1).mean()
        agreement.append((log_q.argmax(dim=-1) == p.argmax(dim=-1)).float().mean().detach())
    return total, torch.stack(agreement)


def first_step_agreement(loss_fn):
    """The loop logs one agreement: the first drafting step's (what acceptance at position 1 follows)."""
    def wrapped(head, batch, device):
        loss, agreement = loss_fn(head, batch, device)
        return loss, agreement[0]
    return wrapped


def build_head(target, vocab_ids: torch.Tensor):
    """A fresh EAGLE-3 head (the EAGLE authors' layout) for `target`, started from the target's last layer."""
    from draft_service.eagle3_head import Eagle3Config, Eagle3Head, default_feature_layers
    from draft_service.feature_head import target_matrices

    c = target.model.config
    layers = default_feature_layers(c.num_hidden_layers)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    config = Eagle3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_attention_heads,
                          num_kv_heads=c.num_key_value_heads, head_dim=head_dim, rms_norm_eps=c.rms_norm_eps,
                          rope_theta=float(getattr(c, "rope_theta", 10000.0)), rope_scaling=None, vocab_size=c.vocab_size,
                          draft_vocab_size=len(vocab_ids), target_hidden_size=c.hidden_size, feature_layers=layers,
                          layout="eagle")
    embedding, lm_head = target_matrices(target.model)
    head = Eagle3Head(config, embedding, vocab_ids)
    init_from_target(head, target.model, lm_head[vocab_ids.long()])
    return head


def starting_head(target, folder: Path):
    """A saved EAGLE-3 head (this recipe's or a published one for the same target) to train further: its
    weights, its draft vocabulary and its target layers. A head trained on a GPU goes on on a CPU and back."""
    from draft_service.eagle3_head import load_eagle3
    from draft_service.feature_head import target_matrices

    head = load_eagle3(folder, target_matrices(target.model)[0].detach(), target.model.config.num_hidden_layers)
    log.info("train: starting from the EAGLE-3 head in %s (%d-token draft vocabulary, layers %s)", folder,
             head.config.draft_vocab_size, list(head.config.feature_layers))
    return head.train()


@torch.no_grad()
def init_from_target(head, target_model, head_rows: torch.Tensor) -> None:
    """The layer from the target's last one (q/k/v read only the hidden half of [e ; g]), fc = [0 … 0 I] so g
    is the highest fused layer, norm and lm_head (the draft vocabulary's rows) from the target."""
    last, h = target_model.model.layers[-1], head.config.hidden_size
    attention, mlp, mine = last.self_attn, last.mlp, head.layer
    for own, theirs in ((mine.self_attn.q_proj, attention.q_proj), (mine.self_attn.k_proj, attention.k_proj),
                        (mine.self_attn.v_proj, attention.v_proj)):
        own.weight.zero_()
        own.weight[:, h:] = theirs.weight.float()
    mine.self_attn.o_proj.weight.copy_(attention.o_proj.weight.float())
    for own, theirs in ((mine.mlp.gate_proj, mlp.gate_proj), (mine.mlp.up_proj, mlp.up_proj), (mine.mlp.down_proj, mlp.down_proj)):
        own.weight.copy_(theirs.weight.float())
    mine.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
    mine.hidden_norm.weight.copy_(last.input_layernorm.weight.float())
    mine.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
    head.norm.weight.copy_(target_model.model.norm.weight.float())
    head.lm_head.weight.copy_(head_rows.float())
    head.fc.weight.zero_()
    head.fc.weight[:, -h:] = torch.eye(h)


def training_records(target, recipe: Eagle3Recipe, data_dir: Path, work: Path) -> tuple[list[dict], list[dict]]:
    """(training sequences, held-out answers): the target's answers generated here (gen-train, budgeted) and,
    with use_corpus, the committed corpus's answers, cut to max_length; held-out answers to evaluation prompts
    (gen-eval), never trained on."""
    from draft_training.feature_training import corpus_sources
    from specd_engine.models import eos_token_ids

    rows = load_all_prompts(data_dir)
    data = work / "data"
    common = dict(batch_size=recipe.gen_batch, max_new_tokens=recipe.max_new_tokens, top_k=1, eos_ids=eos_token_ids(target))
    eval_rows = select_prompts(rows, {kind: recipe.eval_per_kind for kind in KINDS}, True, recipe.held_out_fraction, recipe.seed)
    distill_data.generate_stage(target.model, target.tokenizer, eval_rows, data, "gen-eval", budget=Budget(0), **common)
    held_out = distill_data.load_records(data, "gen-eval")
    if recipe.gen_per_kind:
        train_rows = select_prompts(rows, recipe.gen_per_kind, False, recipe.held_out_fraction, recipe.seed)
        distill_data.generate_stage(target.model, target.tokenizer, train_rows, data, "gen-train", budget=Budget(recipe.gen_minutes), **common)
    sources = distill_data.load_records(data, "gen-train") if recipe.gen_per_kind else []
    if recipe.use_corpus:
        sources += corpus_sources(target.name, recipe.held_out_fraction, [r["tokens"][: r["start"]].tolist() for r in held_out])
    records = []
    for source in sources:
        tokens = torch.as_tensor(source["tokens"]).long()[: recipe.max_length]
        if len(tokens) - source["start"] >= 2 and source["start"] >= 1:
            records.append({"id": source["id"], "category": source["category"], "tokens": tokens, "start": source["start"]})
    log.info("eagle3 data: %d training answers (%d answer tokens), %d held-out answers", len(records),
             sum(len(r["tokens"]) - r["start"] for r in records), len(held_out))
    return records, held_out


@torch.no_grad()
def held_out_agreement(head, target_model, head_rows: torch.Tensor, records: list[dict], passes: int, device: torch.device,
                       batch_size: int = 8) -> dict:
    """Teacher-forced agreement with the target's top choice on held-out answers, per drafting step and per
    task kind: step j's row drafts from j - 1 of its own outputs, as served (what acceptance at position j
    follows, given the earlier ones were accepted)."""
    head.eval()
    by_kind: dict[str, list] = {}
    for begin in range(0, len(records), batch_size):
        batch = records[begin : begin + batch_size]
        for kind in {r["category"] for r in batch}:
            mine = [r for r in batch if r["category"] == kind]
            _, agreement = eagle3_loss(head, mine, device, target_model=target_model, head_rows=head_rows, passes=passes)
            weight = sum(len(r["tokens"]) - r["start"] for r in mine)
            by_kind.setdefault(kind, []).append((weight, agreement.cpu()))
    summary = {kind: [round(float(v), 4) for v in sum(w * a for w, a in parts) / sum(w for w, _ in parts)]
               for kind, parts in sorted(by_kind.items())}
    every = [part for parts in by_kind.values() for part in parts]
    summary["overall"] = [round(float(v), 4) for v in sum(w * a for w, a in every) / sum(w for w, _ in every)]
    return summary


def run_eagle3_recipe(args) -> int:
    """`specd train-draft --recipe eagle3-*`: data → train (resumable) → held-out agreement → EAGLE-3 checkpoint."""
    from draft_service.eagle3_head import save_eagle3
    from draft_training.feature_training import run_vocab
    from draft_training.loop import start_run, train_draft, write_run_records

    overrides = {"gen_minutes": args.gen_minutes, "train_minutes": args.train_minutes, "epochs": args.epochs,
                 "ttt_passes": args.ttt_passes}
    recipe = replace(EAGLE3_RECIPES[args.recipe], **{k: v for k, v in overrides.items() if v is not None})
    work, device, target = start_run(args, recipe)
    if device.type == "cuda":
        target.model.to(torch.bfloat16)  # features as a bfloat16 verify computes them, at the GPU's speed
    target.model.eval()
    records, held_out = training_records(target, recipe, Path(args.data_dir), work)
    if args.init_head:
        head = starting_head(target, Path(args.init_head))
    else:
        head = build_head(target, run_vocab(work, records, recipe.draft_vocab, target))
    lm_head = target.model.get_output_embeddings().weight.detach()
    head_rows = lm_head[head.vocab_ids.to(lm_head.device)]  # [V', H] the target's scores over the draft vocabulary
    loss = partial(eagle3_loss, target_model=target.model, head_rows=head_rows, passes=recipe.ttt_passes)
    state = train_draft(head, records, recipe, work, device, loss_fn=first_step_agreement(loss))
    report = {"held_out_answers": len(held_out),
              "agreement_per_step": held_out_agreement(head, target.model, head_rows, held_out, recipe.ttt_passes, device)}
    log.info("eagle3 held-out agreement per drafting step: %s", report["agreement_per_step"]["overall"])
    output = Path(args.output or work / "draft")
    size = save_eagle3(head.cpu().float(), output)
    write_run_records(output, {"name": args.recipe, "target": args.target, **asdict(recipe), "train_records": len(records),
                               "train_answer_tokens": sum(len(r["tokens"]) - r["start"] for r in records)}, report, state)
    (output / "README.md").write_text(readme(args.target, recipe, report))
    log.info("saved the EAGLE-3 head to %s (%.1f MB)", output, size / 1e6)
    return 0


def readme(target: str, recipe: Eagle3Recipe, report: dict) -> str:
    """A few lines beside the checkpoint: what it is, how to serve it, what it measured."""
    return (f"# EAGLE-3 head for {target}\n\nTrained by `specd train-draft` (draft_training/eagle3_training.py), "
            f"{recipe.ttt_passes}-step training-time test. Serve it with `specd up --drafter eagle3 --draft-model "
            f"<this folder>`.\n\nHeld-out teacher-forced agreement per drafting step:\n\n```\n"
            f"{json.dumps(report['agreement_per_step'], indent=1)}\n```\n")
