"""The engine's flat pass (specd_engine/flat_pass.py) beside its ragged pass, and on CUDA as graphs.

What the engine room's GPU path costs (docs/design/engine-room.md): for a few (sessions × rows)
shapes, one pass of the ragged engine (`--forward auto`), of the flat engine run eagerly, and on
CUDA of the flat engine replayed as CUDA graphs (the replay's logits checked bit for bit against
the eager flat pass), each session holding `context // 2` positions; then a prompt prefilled and its
first token, ragged (int4: 16-position chunks) against flat (one chunk). The flat engine's greedy
next tokens over a prompt are checked against transformers' forward. One JSON object, for `make
gpu-check`; timings interleaved round by round (autotune.measure_interleaved).

    python scripts/graphed_pass.py --device cuda --dtype bfloat16 --out graphed.json
    python scripts/graphed_pass.py --device cpu --target TINY_MODEL_DIR --context 64   (CI)
    python scripts/graphed_pass.py --device cpu --weights int4 --context 400 --repeats 7  (a CPU's table)
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from specd_common.config import DEFAULT_TARGET
from specd_engine import flat_pass
from specd_engine.autotune import measure_interleaved
from specd_engine.lm import CausalLM
from specd_engine.sessions import Feed
from specd_engine.models import load_causal_lm

SHAPES = ((1, 1), (1, 4), (8, 1), (8, 4), (32, 1))  # (sessions, rows each): decode, a verify's chain, batches
PROMPT = 200  # tokens of the prefilled prompt


def median_ms(runs: dict, repeats: int) -> dict:
    """Median ms of each run, interleaved round by round (a warm-up round first, the device
    synchronized after each run), on the current thread count."""
    threads = torch.get_num_threads()
    seconds = measure_interleaved({(threads, name): run for name, run in runs.items()}, repeats)
    return {name: round(seconds[(threads, name)] * 1e3, 3) for name in runs}


def engines(args: argparse.Namespace) -> dict:
    """The ragged and the flat CausalLM, each over its own copy of the target (the lean forward fuses
    a model's products in place)."""
    load = functools.partial(load_causal_lm, args.target, device=args.device, dtype=args.dtype)
    ragged, flat = CausalLM(load(), weights=args.weights), CausalLM(load(), weights=args.weights)
    if not flat.use_flat_pass(slots=2 * max(sessions for sessions, _ in SHAPES) + 2, capacity=args.context + PROMPT):
        raise RuntimeError("the flat pass failed its start-up probe (the log says why)")
    return {"ragged": ragged, "flat": flat}


def pass_runs(lm: CausalLM, sessions: int, rows: int, context: int):
    """A pass over `sessions` sessions' `rows` new positions each, run again and again."""
    vocab, cached = lm.vocab_size, context // 2
    held = [lm.new_session([(7 * s + j) % vocab for j in range(cached + 1)]) for s in range(sessions)]
    for session in held:
        lm.forward(session)
    feeds = [Feed(session, list(range(1, rows + 1)), logits=rows) for session in held]
    return functools.partial(lm.run_feeds_then_rewind, feeds), held


def prefill_then_first(lm: CausalLM) -> None:
    """A PROMPT-token prompt prefilled in the engine's own chunks, then its first token."""
    session = lm.new_session([(3 * j) % lm.vocab_size for j in range(PROMPT)], prefill=False)
    while lm.unprefilled(session):
        lm.run_feeds([lm.prefill_feed(session, 512)])
    lm.forward(session)


def measure(lms: dict, context: int, repeats: int) -> dict:
    """Per shape: ragged_ms, flat_ms and on CUDA graphed_ms with graph_equals_eager; then `prefill`."""
    ragged, flat = lms["ragged"], lms["flat"]
    shapes = {}
    for sessions, rows in SHAPES:
        ragged_run, _ = pass_runs(ragged, sessions, rows, context)
        flat_run, held = pass_runs(flat, sessions, rows, context)
        graphs, flat.passes.graphs = flat.passes.graphs, None
        runs = {"ragged": ragged_run, "flat": flat_run}
        entry = {}
        if graphs is not None:
            eager = flat_run()
            flat.passes.graphs = graphs
            entry["graph_equals_eager"] = all(torch.equal(a, b) for a, b in zip(eager, flat_run()))
            flat.passes.graphs = None

            def graphed(graphs=graphs, run=flat_run):
                flat.passes.graphs = graphs
                try:
                    run()
                finally:
                    flat.passes.graphs = None

            runs["graphed"] = graphed
        entry.update({f"{name}_ms": ms for name, ms in median_ms(runs, repeats).items()})
        flat.passes.graphs = graphs
        shapes[f"{sessions}x{rows}"] = entry
        del held, runs, flat_run  # their sessions' slots go back
    shapes["prefill"] = {f"{name}_ms": ms for name, ms in median_ms(
        {name: functools.partial(prefill_then_first, lm) for name, lm in lms.items()}, repeats).items()}
    return shapes


@torch.inference_mode()
def agrees_with_transformers(flat: CausalLM, reference: torch.nn.Module) -> bool:
    """The flat engine's greedy next tokens over an 8-token prompt and 3 more positions equal
    transformers' forward's over the same tokens."""
    ids = [j % flat.vocab_size for j in range(1, 12)]
    session = flat.new_session(ids[:8])
    ours = torch.cat([flat.forward(session), flat.forward(session, ids[8:])]).argmax(-1)  # [4]
    theirs = reference(input_ids=torch.tensor([ids], device=flat.loaded.device)).logits[0, 7:].argmax(-1)  # [4]
    return bool(torch.equal(ours.cpu(), theirs.cpu()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="float", choices=["float", "int4"])
    parser.add_argument("--context", type=int, default=1024, help="positions a session's slot holds; half are cached")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="", help="write the JSON here too")
    args = parser.parse_args()
    result = {"device": args.device, "dtype": args.dtype, "weights": args.weights, "context": args.context,
              "key_block": flat_pass.KEY_BLOCK, "agrees_with_transformers": None, "shapes": {}}
    try:
        lms = engines(args)
        result["dtype"] = str(lms["flat"].lean.embed.weight.dtype).replace("torch.", "")
        reference = load_causal_lm(args.target, device=args.device, dtype=args.dtype).model
        result["agrees_with_transformers"] = agrees_with_transformers(lms["flat"], reference)
        del reference
        result["shapes"] = measure(lms, args.context, args.repeats)
    except Exception as error:  # a device window must still record what ran
        result["error"] = repr(error)
    print_and_save(result, args.out)


def print_and_save(result: dict, out: str) -> None:
    """The result as one JSON line on stdout, and in `out` where given."""
    text = json.dumps(result)
    print(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
