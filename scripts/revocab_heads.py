"""A saved head with its draft vocabulary chosen again from the corpus (docs/draft-training.md).

A feature head or Medusa heads score only V' of the target's ids (the rows of the target's frozen LM
head they read: `vocab_ids`), chosen when their first run began from the answers it had then. The
corpus grew since, and its mix with it (code, roleplay and self-written prompts came later), so a
token the target often chooses may be one the head can never propose. The trained weights do not
depend on which rows are scored (the heads output a hidden state; the rows are looked up at load),
so the vocabulary can be chosen again without training:

    .venv/bin/python scripts/revocab_heads.py --heads verify_service/heads/smollm2-135m-instruct --size 8192 --output OUT

The new ids are the `size` most frequent answer tokens of every corpus answer (plus EOS), as
`specd train-draft` chooses them (`feature_training.choose_vocab`). Writes the head's weights with
the new `vocab_ids`, its config with the new size, and `revocab.json` (command, coverage of the
corpus's answer tokens before and after).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from draft_service import feature_head
from specd_common.config import DEFAULT_TARGET
from verify_service import medusa

KINDS_OF_HEADS = {medusa.CONFIG_FILE: medusa.WEIGHTS_FILE, feature_head.CONFIG_FILE: feature_head.WEIGHTS_FILE}


def head_files(folder: Path) -> tuple[str, str]:
    """(config file, weights file) of the head saved in `folder`."""
    for config_file, weights_file in KINDS_OF_HEADS.items():
        if (folder / config_file).exists():
            return config_file, weights_file
    raise SystemExit(f"{folder} holds no feature head or Medusa heads (none of {sorted(KINDS_OF_HEADS)})")


def coverage(counts: torch.Tensor, vocab_ids: torch.Tensor) -> float:
    """Share of the counted answer tokens that are in `vocab_ids`."""
    return float(counts[vocab_ids.long()].sum() / counts.sum())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="a saved feature head or Medusa heads folder")
    parser.add_argument("--size", type=int, default=8192, help="V': ids the head scores")
    parser.add_argument("--output", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    args = parser.parse_args(argv)

    from safetensors.torch import load_file, save_file

    from draft_training.corpus import Corpus, corpus_dir
    from draft_training.feature_training import choose_vocab
    from specd_common.models import eos_token_ids, load_causal_lm

    source, output = Path(args.heads), Path(args.output)
    config_file, weights_file = head_files(source)
    config = json.loads((source / config_file).read_text())
    state = load_file(str(source / weights_file))
    target = load_causal_lm(args.target, device="cpu", dtype="float32")
    records = [{"tokens": torch.as_tensor(r.tokens, dtype=torch.long), "start": r.start}
               for r in Corpus.open(corpus_dir(target.name)).records]
    vocab_size = config["vocab_size"]
    vocab_ids = choose_vocab(records, args.size, vocab_size, eos_token_ids(target))  # [V'] sorted
    counts = sum(torch.bincount(r["tokens"][r["start"]:], minlength=vocab_size) for r in records).float()  # [V]

    output.mkdir(parents=True, exist_ok=True)
    for extra in source.iterdir():
        if extra.is_file() and extra.name not in (config_file, weights_file):
            shutil.copy2(extra, output / extra.name)
    save_file(dict(state, vocab_ids=vocab_ids.long().contiguous()), str(output / weights_file))
    (output / config_file).write_text(json.dumps(dict(config, draft_vocab_size=len(vocab_ids)), indent=2))
    note = {"command": " ".join(["python", "scripts/revocab_heads.py", *argv]), "from": str(source),
            "corpus_answers": len(records), "corpus_answer_tokens": int(counts.sum()),
            "coverage_before": round(coverage(counts, state["vocab_ids"]), 4), "coverage_after": round(coverage(counts, vocab_ids), 4),
            "ids_kept": len(set(state["vocab_ids"].tolist()) & set(vocab_ids.tolist())), "size": len(vocab_ids)}
    (output / "revocab.json").write_text(json.dumps(note, indent=2) + "\n")
    json.dump(note, sys.stdout, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
