"""Flags of `specd train-draft` and `specd draft-corpus`, torch-free so that building the `specd` parser stays cheap everywhere.

The work itself lives in draft_training/feature_training.py and is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specd_common.config import DEFAULT_TARGET

log = logging.getLogger(__name__)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # the checkout's ../shared/data
RECIPE_NAMES = ("feature-tiny", "feature-cpu", "feature-corpus", "feature-full")  # feature_training.FEATURE_RECIPES
MEDUSA_RECIPE_NAMES = ("medusa-tiny", "medusa-chain-tiny", "medusa-corpus", "medusa-token-corpus", "medusa-chain-corpus",
                       "medusa-chain2-corpus", "medusa-fusion-corpus", "medusa-fusion-tiny")  # medusa_training.MEDUSA_RECIPES
EAGLE3_RECIPE_NAMES = ("eagle3-tiny", "eagle3-cpu", "eagle3-corpus")  # eagle3_training.EAGLE3_RECIPES
# The names of the retired stand-alone small-Llama recipes now mean the feature head of the same size,
# so scripts written for them keep working.
RECIPE_ALIASES = {"tiny": "feature-tiny", "cpu": "feature-cpu", "full": "feature-full"}


def run(args: argparse.Namespace) -> int:
    if args.recipe in EAGLE3_RECIPE_NAMES:
        from draft_training.eagle3_training import run_eagle3_recipe

        return run_eagle3_recipe(args)
    if args.recipe in MEDUSA_RECIPE_NAMES:
        from draft_training.medusa_training import run_medusa_recipe

        return run_medusa_recipe(args)
    from draft_training.feature_training import run_feature_recipe

    args.recipe = RECIPE_ALIASES.get(args.recipe, args.recipe)
    return run_feature_recipe(args)


def add_train_draft_parser(commands) -> None:
    """Register `specd train-draft` on the top-level sub-command set."""
    parser = commands.add_parser("train-draft", help="distil a small draft model from the target (resumable)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: embedded name, folder, GGUF or hub id")
    parser.add_argument("--recipe", default="feature-cpu", choices=RECIPE_NAMES + MEDUSA_RECIPE_NAMES + EAGLE3_RECIPE_NAMES + tuple(RECIPE_ALIASES),
                        help="an EAGLE-style head reading the target's features: feature-cpu ~70 min on 2 cores, feature-corpus trains on the committed corpus, "
                        "feature-tiny is a test, feature-full is for a GPU (tiny/cpu/full: the same); medusa-corpus / medusa-tiny: "
                        "Medusa heads for the verify service, from the same data (medusa-token-corpus: heads that also read the next token; "
                        "medusa-chain-corpus: and the earlier heads' tokens, Hydra; medusa-chain2-corpus: the same with two blocks a head; "
                        "medusa-fusion-corpus: and the outputs of a low and a middle layer fused into their input, EAGLE-3); "
                        "eagle3-corpus (GPU) / eagle3-cpu / eagle3-tiny: an EAGLE-3 head in the EAGLE authors' layout (--drafter eagle3)")
    parser.add_argument("--work-dir", required=True, help="data cache, checkpoints and log; rerun to resume")
    parser.add_argument("--output", default="", help="draft folder (default: <work-dir>/draft)")
    parser.add_argument("--data-dir", default=str(SHARED_DATA), help="folder with gsm8k_train / humaneval / seed_tasks JSONL")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--gen-minutes", type=float, default=None, help="override the recipe's generation budget")
    parser.add_argument("--tf-minutes", type=float, default=None, help="override the feature-extraction budget")
    parser.add_argument("--train-minutes", type=float, default=None, help="override the training budget: the run's total minutes; "
                        "more than a finished run had trains it on from its step (draft_training/loop.py steps_added)")
    parser.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs (more than a finished run had "
                        "trains it on)")
    parser.add_argument("--reference-rows", type=int, default=None, help="override how many public reference answers the run "
                        "extracts and trains on besides the target's own (0: the target's answers alone)")
    parser.add_argument("--corpus-from", type=int, default=None, help="train on the corpus's records from this one on, in the order "
                        "they were added (e.g. the count a head was last trained on: only the answers new to it)")
    parser.add_argument("--kind-answer-cap", type=int, default=None, help="at most N corpus answers of each task kind, spread "
                        "evenly over the corpus (math and code fill most of it; 0 = all)")
    parser.add_argument("--kind-balance", type=int, default=None, help="answers of thin kinds count up to N times more in an epoch, "
                        "toward an equal share of answer positions a kind (0 = off)")
    parser.add_argument("--ttt-passes", type=int, default=None, help="train drafting steps 1..N on the head's own estimates "
                        "(EAGLE-3's training-time test; costs ~N times a step; default: the recipe's, 1)")
    parser.add_argument("--init-head", default=None, help="train further from this saved head (weights and vocabulary) "
                        "instead of from the target's last layer, e.g. draft_service/heads/<target> (Medusa recipes: verify_service/heads/<target>)")
    parser.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N held-out answers (0 = all)")
    parser.add_argument("--skip-eval", action="store_true", help="save without the held-out evaluation")
    parser.set_defaults(func=run)


def run_corpus(args: argparse.Namespace) -> int:
    from draft_training.corpus import CorpusRecipe, corpus_dir, extend_corpus
    from draft_training.distill_data import Budget
    from specd_engine.models import load_causal_lm

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target, device=args.device, dtype="float32")
    directory = Path(args.output_dir) if args.output_dir else corpus_dir(target.name)
    corpus = extend_corpus(target, directory, Path(args.data_dir), CorpusRecipe(), Budget(args.minutes),
                           batch_size=args.batch_size, written_prompts=args.self_prompts)
    log.info("corpus %s: %d records, %d answer tokens", directory, len(corpus.records), corpus.answer_tokens())
    return 0


def add_corpus_parser(commands) -> None:
    """Register `specd draft-corpus`: extend the committed corpus of the target's own answers."""
    parser = commands.add_parser("draft-corpus", help="add the target's answers to the draft-training corpus (resumable)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: embedded name, folder, GGUF or hub id")
    parser.add_argument("--minutes", type=float, required=True, help="stop after this long (a batch in flight finishes)")
    parser.add_argument("--data-dir", default=str(SHARED_DATA), help="folder with the shared prompt sets")
    parser.add_argument("--output-dir", default="", help="corpus folder (default: draft_training/corpus/<target>)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--batch-size", type=int, default=48, help="prompts answered together (speed only, not the answers)")
    parser.add_argument("--self-prompts", action="store_true", help="once the prompt sets are answered, answer prompts the target "
                        "writes itself from its chat template's user header (Magpie): the sets hold 13,679 training prompts")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:N")
    parser.set_defaults(func=run_corpus)
