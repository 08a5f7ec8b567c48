"""How often a sampled round would keep the Medusa heads' first draft under each rule a gateway could use.

A sampled round keeps a one-hot draft x with the target's probability p(x) (the coupled rule,
gateway/rejection.py). Two rules could keep more if the heads' distribution q were used: drawing
the draft from q and judging by min(1, p/q) keeps Σ min(p, q) on average; coupling the draft with
the target's own draw through shared exponential noise (an exponential race: y = argmin E_k / p_k,
x = argmin over the heads' candidates of E_k / q_k; exact for any draft, since y is emitted) keeps
P(x = y). This script measures all three on sampled answers of prompts the heads never saw, so a
rule is built only where it pays. q is a head's softmax over its top-c candidates, warped by the
same temperature.

    make sampled-coupling COUPLING_ARGS="--limit 8 --tokens 32"
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from specd_app.bench import load_prompts, machine_facts
from specd_common.config import DEFAULT_TARGET
from specd_engine.models import load_causal_lm
from verify_service.medusa import load_heads

HEADS = "verify_service/heads/smollm2-135m-instruct"


def head_distribution(confidences: np.ndarray, temperature: float) -> np.ndarray:
    """A head's probabilities of its candidates [c] warped by `temperature` and renormalized over them."""
    warped = confidences.astype(np.float64) ** (1.0 / temperature)
    return warped / warped.sum()


def kept_by_rules(p: np.ndarray, candidates: np.ndarray, confidences: np.ndarray, temperature: float,
                  noise: np.ndarray) -> dict:
    """For the target's distribution p [V] of the drafted position and a head's candidates and
    confidences [C] (best first): the probability each rule keeps the draft, per candidate count c.
    noise [D, V]: exponential draws, one race a row."""
    target = np.argmin(noise / np.maximum(p, 1e-300), axis=1)  # [D]: the target's token in each race
    kept = {"one_hot": float(p[candidates[0]])}
    for count in (1, 2, 4, 8):
        if count > len(candidates):
            break
        tokens, q = candidates[:count], head_distribution(confidences[:count], temperature)
        draft = tokens[np.argmin(noise[:, tokens] / q, axis=1)]  # [D]: the heads' token in each race
        kept[f"race_top{count}"] = float(np.mean(draft == target))
        kept[f"drawn_top{count}"] = float(np.minimum(p[tokens], q).sum())
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["docs/benchmarks/unseen_prompts.jsonl", "docs/benchmarks/heldout_prompts.jsonl"])
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of each file")
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens an answer")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--draws", type=int, default=64, help="races a position")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    target = load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32")
    heads = load_heads(Path(HEADS), target.model)
    kept: dict[str, list[float]] = {}
    for row in [row for path in args.prompts for row in load_prompts(path, args.limit)]:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
        with torch.inference_mode():
            answer = target.model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=True,
                                           temperature=args.temperature, top_k=0, top_p=1.0)
            out = target.model(answer, output_hidden_states=True)
            first = len(ids) - 1  # row t scores token t + 1; the heads read row t and token t + 1 and draft token t + 2
            rows = answer.shape[1] - first - 2
            if rows <= 0:
                continue
            candidates, confidences = heads.ranked(out.hidden_states[-1][0, first : first + rows],
                                                   answer[0, first + 1 : first + 1 + rows], candidates=8)  # [rows, K, 8]
            p = torch.softmax(out.logits[0, first + 1 : first + 1 + rows].double() / args.temperature, dim=-1).numpy()  # [rows, V]
        for t in range(rows):
            noise = rng.exponential(size=(args.draws, p.shape[1]))
            for rule, value in kept_by_rules(p[t], candidates[t, 0].numpy(), confidences[t, 0].numpy(), args.temperature,
                                             noise).items():
                kept.setdefault(rule, []).append(value)
    report = dict(command="python scripts/sampled_coupling.py " + shlex.join(sys.argv[1:]), machine=machine_facts(), positions=len(kept.get("one_hot", [])),
                  kept_at_position_1={rule: round(float(np.mean(values)), 4) for rule, values in kept.items()})
    print(json.dumps(report, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
