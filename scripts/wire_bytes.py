"""Bytes on the wire per position of a sampled round, as encoded now against the dense float16 row (the
target's warped p) and float32 ids (a head's q), over the first 32 greedy tokens of each held-out prompt.
The head's q is stood in for by the target's own scores over the shipped feature head's vocabulary.

    make wire-bytes WIRE_ARGS="--limit 14 --tokens 32"
"""

from __future__ import annotations

import argparse
import json

import torch

from draft_service.app import make_drafter
from specd_common.distributions import encode_over
from specd_engine.models import load_causal_lm
from specd_common.params import Warp
from specd_engine.warping import encode_rows, warp_probs

HEAD = "draft_service/heads/smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="docs/benchmarks/heldout_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=14)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_causal_lm("embedded:smollm2-135m-instruct", device="cpu", dtype="float32")
    head_vocab = make_drafter("feature", HEAD, device="cpu", dtype="float32", threads=1).head.vocab_ids.cpu().numpy()
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    head_rows = target.model.get_output_embeddings().weight.detach()[head_vocab]  # [V', H]
    states = []  # (logits [T, V], the head's stand-in scores [T, V']) of each answer's positions
    for row in rows:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
        with torch.inference_mode():
            answer = target.model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)
            out = target.model(answer, output_hidden_states=True)
        states.append((out.logits[0, len(ids) - 1 :], out.hidden_states[-1][0, len(ids) - 1 :] @ head_rows.T))
    vocab = states[0][0].shape[-1]
    for temperature in (0.7, 0.8, 1.0):
        warp, sent, q_sent, positions, q_float32 = Warp(temperature=temperature), 0, 0, 0, 0
        for logits, head_scores in states:
            sent += sum(message.ByteSize() for message in encode_rows(warp_probs(logits, warp)))
            for q in warp_probs(head_scores, warp).numpy():
                q_sent += encode_over(head_vocab, q, vocab).ByteSize()
                q_float32 += int((q != 0).sum()) * 7  # a float32 and a ~3-byte varint id per nonzero entry
            positions += len(logits)
        print(f"T = {temperature}: target row {2 * vocab / 1e3:.1f} KB dense float16 → {sent / positions / 1e3:.1f} KB sent; "
              f"head q {q_float32 / positions / 1e3:.1f} KB as float32 ids → {q_sent / positions / 1e3:.1f} KB sent ({positions} positions)")


if __name__ == "__main__":
    main()
