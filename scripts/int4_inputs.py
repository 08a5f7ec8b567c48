"""How far each instruction set's int4 products move the target from its float32 self.

The int4 tiles round a product's inputs to bfloat16 (AMX, AVX-512 BF16) or to bytes a group of 32 inputs
(AVX-512 VNNI: absmax / 127, llama.cpp's Q8 blocks), and the weights to 4 bits either way. This greedily
answers prompts with the float32 target, then scores the same tokens (teacher-forced) with the int4
target on every instruction set the tiles run on here, and reports per instruction set the next-token
argmax agreement with float32 and the mean KL(p_float32 || p_int4), and how often the instruction sets
agree with each other. With --prompt-attention each instruction set is scored twice, its prompt rows'
attention by the 16-lane code and by bfloat16 dot products (store_attention.prompt_dots; with --flat, the
verify's flat pass and native decoder, where they take effect). One JSON object (docs/design/engine-room.md).

    python scripts/int4_inputs.py --limit 8 --tokens 48 --out docs/benchmarks/engine_room/int4_inputs_epyc.json
    python scripts/int4_inputs.py --flat --prompt-attention --prompts docs/benchmarks/long_prompts.jsonl --limit 8 --tokens 32
    python scripts/int4_inputs.py --target TINY_MODEL_DIR --prompt-ids 8 --limit 2 --tokens 4   (CI)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from specd_app.bench import load_prompts, machine_facts
from specd_common.config import DEFAULT_TARGET
from specd_engine import int4_tiles, store_attention
from specd_engine.lm import CausalLM
from specd_engine.models import load_causal_lm

PROMPT_FILES = ("docs/benchmarks/unseen_prompts.jsonl", "docs/benchmarks/heldout_prompts.jsonl")


def answer(lm: CausalLM, prompt: list[int], tokens: int, forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Next-token logits [tokens, V] along the greedy answer to `prompt` (or along `forced`), and the answer."""
    session = lm.new_session(prompt)
    logits, ids = [], []
    for step in range(tokens):
        row = lm.forward(session)[-1].float()  # [V]
        logits.append(row)
        ids.append(int(row.argmax()) if forced is None else forced[step])
        session.apply_commit(len(session.tokens), [ids[-1]])
    return torch.stack(logits), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of each prompt file")
    parser.add_argument("--tokens", type=int, default=48, help="answer tokens scored a prompt")
    parser.add_argument("--prompt-ids", type=int, default=0, help="instead of the prompt files: --limit prompts of this many token ids (a tiny model)")
    parser.add_argument("--prompts", nargs="+", default=list(PROMPT_FILES), help="prompt files (the first --limit of each)")
    parser.add_argument("--flat", action="store_true", help="the int4 target serves flat passes, as a verify does (the native decoder where it runs)")
    parser.add_argument("--prompt-attention", action="store_true", help="each instruction set with prompt rows by the 16-lane code and by dot products")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    reference = CausalLM(load_causal_lm(args.target, device="cpu", dtype="float32"))
    loaded = load_causal_lm(args.target, device="cpu")
    quantized = CausalLM(loaded, weights="int4")
    if args.flat:
        quantized.use_flat_pass(4)
    # variant → (instruction set, prompt rows' attention kernel or None: as the process has it)
    kernels = store_attention.PROMPT_KERNELS if args.prompt_attention and store_attention.prompt_dots() else (None,)
    variants = {isa if kernel is None else f"{isa}, prompt {kernel}": (isa, kernel)
                for isa in int4_tiles.runnable_instruction_sets() for kernel in kernels}
    if args.prompt_ids:
        prompts = [[(7 * p + 3 * j) % (quantized.vocab_size - 10) + 10 for j in range(args.prompt_ids)] for p in range(args.limit)]
    else:
        rows = [row for path in args.prompts for row in load_prompts(path, args.limit)]
        prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"] for row in rows]
    agree = dict.fromkeys(variants, 0)
    kl = dict.fromkeys(variants, 0.0)
    together, positions = 0, 0

    def score() -> None:
        nonlocal together, positions
        for prompt in prompts:
            logits, ids = answer(reference, prompt, args.tokens)
            log_p = logits.log_softmax(-1)
            choices = []
            for name, (isa, kernel) in variants.items():
                if kernel is not None:
                    store_attention.use_for_prompts(kernel)
                with int4_tiles.instruction_set_as(isa):
                    got, _ = answer(quantized, prompt, args.tokens, ids)
                choices.append(got.argmax(-1))
                agree[name] += int((choices[-1] == logits.argmax(-1)).sum())
                kl[name] += float((log_p.exp() * (log_p - got.log_softmax(-1))).sum())
            together += int(torch.stack(choices).eq(choices[0]).all(0).sum()) if choices else 0
            positions += len(ids)

    quantized.run(score)  # the model thread: one OpenMP team (specd_engine/model_thread.py)
    result = dict(command="python scripts/int4_inputs.py " + shlex.join(sys.argv[1:]), machine=machine_facts(), prompts=len(prompts),
                  positions=positions, flat=args.flat, variants=list(variants),
                  vs_float32={name: dict(argmax_agreement=round(agree[name] / positions, 4), mean_kl=round(kl[name] / positions, 5)) for name in variants},
                  variants_agree=round(together / positions, 4) if positions else None)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
