"""The lean forward (specd_common/lean_forward.py) against transformers' own, on the real default target.

  agreement: greedy decoding of real prompts through CausalLM.forward, one token a pass, with each
             forward: the tokens must be the same; reports the largest logit difference seen.
  timing:    one forward over n new positions after a `--context`-token prompt, for each forward,
             weight layout and n, interleaved (autotune.measure_interleaved: a burst of load hits
             every candidate alike), medians of `--repeats`.

             Each forward runs in its own process, as in a service, the two alternating for --rounds.

Usage: python scripts/lean_forward_bench.py [--threads 2] [--context 200] [--repeats 15] [--rounds 2]
       [--tokens 48] [--output docs/benchmarks/lean_forward_<stop>.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "protos")]

import torch  # noqa: E402

from draft_training.distill_data import chat_prompt_ids  # noqa: E402
from specd_app.bench import emit_report, machine_facts  # noqa: E402
from specd_common import autotune  # noqa: E402
from specd_common.lm import CausalLM  # noqa: E402
from specd_common.models import DEFAULT_TARGET, load_causal_lm  # noqa: E402

PROMPTS = ["Why is the sky blue?", "Write a Python function that checks whether a number is prime.",
           "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?"]
LAYOUTS = (autotune.PLAIN, autotune.ROWS)
FORWARDS = ("lean", "transformers")


def greedy(lm: CausalLM, prompt: list[int], tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """`tokens` greedy tokens, one forward a token, and each pass's logits [V]."""
    session, out, logits = lm.new_session(prompt), [], []
    for _ in range(tokens):
        row = lm.forward(session)[-1]  # [V]
        logits.append(row)
        out.append(int(row.argmax()))
        session.apply_commit(len(session.tokens), [out[-1]])
    return out, logits


def agreement(lean: CausalLM, reference: CausalLM, tokens: int) -> dict:
    """Greedy tokens of PROMPTS by each CausalLM, and the largest logit difference while they agree."""
    tokenizer = lean.loaded.tokenizer
    same, largest = [], 0.0
    for prompt in PROMPTS:
        ids = chat_prompt_ids(tokenizer, prompt)
        ours, our_logits = greedy(lean, ids, tokens)
        theirs, their_logits = greedy(reference, ids, tokens)
        same.append(ours == theirs)
        shared = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))  # logits compare while the prefixes agree
        largest = max([largest] + [float((a - b).abs().max()) for a, b in zip(our_logits[:shared + 1], their_logits[:shared + 1])])
    return {"prompts": len(PROMPTS), "tokens_each": tokens, "identical_greedy": same, "max_logit_difference": largest}


def timing(lm: CausalLM, threads: int, context: int, repeats: int) -> dict:
    """Median ms of one forward over n positions after `context` cached, per layout and n (interleaved)."""
    prompt = [(7 * i) % 40000 + 100 for i in range(context + 1)]
    session = lm.new_session(prompt)

    def run(layout: str, positions: int):
        fixed = autotune.RuntimeChoice("cpu", threads, {1: layout})

        def once() -> None:
            lm.runtime = fixed
            lm.forward(session, list(range(200, 200 + positions - 1)))  # the prompt's last token + n − 1 more
            session.apply_commit(context + 1, [])  # back to the prompt ...
            session.cache.crop(-1)  # ... with its last token unread again: every pass sees the same context
            session.cached = context

        return once

    runs = {(threads, layout, n): run(layout, n) for layout in LAYOUTS for n in autotune.MEASURED_POSITIONS}
    table: dict = {}
    for (_, layout, n), seconds in autotune.measure_interleaved(runs, repeats).items():
        table.setdefault(layout, {})[n] = round(seconds * 1e3, 2)
    return table


def child(forward: str, args) -> None:
    """One process, one model, as in a service: time it with `forward` and print the table as JSON."""
    lm = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"), layouts=set(LAYOUTS), lean=forward == "lean")
    assert (lm.lean is not None) == (forward == "lean"), "the lean forward did not take the default target (see the log)"
    sys.stdout.write(json.dumps(timing(lm, args.threads, args.context, args.repeats)) + "\n")


def timed_in_processes(args) -> dict:
    """Each forward in its own process (two models in one process both ran ~1.6x slower here), the
    forwards alternating for --rounds rounds; per cell the median over rounds."""
    samples: dict = {}
    for _ in range(args.rounds):
        for forward in FORWARDS:
            command = [sys.executable, __file__, "--child", forward, "--threads", str(args.threads),
                       "--context", str(args.context), "--repeats", str(args.repeats)]
            table = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for layout, by_n in table.items():
                for n, ms in by_n.items():
                    samples.setdefault(forward, {}).setdefault(layout, {}).setdefault(int(n), []).append(ms)
    return {forward: {layout: {n: round(statistics.median(v), 2) for n, v in by_n.items()} for layout, by_n in layouts.items()}
            for forward, layouts in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default="")
    parser.add_argument("--child", choices=FORWARDS, default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child, args)
        return
    report = {"command": "python " + " ".join(sys.argv), "machine": machine_facts(),
              "settings": {"threads": args.threads, "context": args.context, "repeats": args.repeats, "rounds": args.rounds},
              "forward_ms": timed_in_processes(args)}
    lean = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"))
    reference = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"), lean=False)
    report["agreement"] = agreement(lean, reference, args.tokens)
    emit_report(report, args.output)


if __name__ == "__main__":
    main()
