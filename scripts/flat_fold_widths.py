"""The flat pass beside the ragged pass: its attention by specd's kernel (store_attention.py) where it
runs, over its default store (flat_pass.store_dtype) and over a float32 one, and folded SDPA calls at
key widths of 64, 128 and 256.

A folded row reads the keys it sees padded to whole blocks of `flat_pass.FOLD_KEY_BLOCK`: larger
blocks let more sessions share one attention call, smaller ones pad less; specd's kernel reads each
row's own keys in one call a layer. This times one pass of the int4 default target under the ragged
engine and under each flat one, interleaved round by round, for sessions of spread lengths (as
served: not all at one context) and one or four rows each. One JSON object (docs/design/engine-room.md).

    python scripts/flat_fold_widths.py --repeats 7 --out docs/benchmarks/engine_room/flat_fold_widths.json
    python scripts/flat_fold_widths.py --target TINY_MODEL_DIR --scale 0.25 --repeats 1   (CI)
"""

from __future__ import annotations

import argparse
import functools

import torch

from graphed_pass import print_and_save  # (scripts/, beside this one)
from specd_app.bench import machine_facts
from specd_common.config import DEFAULT_TARGET
from specd_engine import flat_pass, store_attention
from specd_engine.autotune import measure_interleaved
from specd_engine.lm import CausalLM
from specd_engine.models import load_causal_lm
from specd_engine.sessions import Feed

BLOCKS = (64, 128, 256)
SHAPES = {  # name: (cached positions of each session, rows each)
    "1x1 at 256": ([256], 1), "1x1 at 300": ([300], 1), "1x4 at 300": ([300], 4),
    "8x1 spread 130-690": ([130 + 80 * i for i in range(8)], 1), "8x4 spread 130-690": ([130 + 80 * i for i in range(8)], 4),
    "32x1 spread 100-782": ([100 + 22 * i for i in range(32)], 1),
    "8x1 at 1000": ([1000] * 8, 1), "8x4 at 1000": ([1000] * 8, 4),  # long prompts: what reading the store costs
}
CAPACITY = 1024 + 8  # a slot's positions: the longest shape's, and its rows


def pass_run(lm: CausalLM, lengths: list[int], rows: int):
    """A pass over sessions of `lengths` cached positions, `rows` new ones each, run again and again."""
    held = [lm.new_session([(7 * s + j) % (lm.vocab_size - 10) + 10 for j in range(n)]) for s, n in enumerate(lengths)]
    for session in held:
        lm.forward(session)
    feeds = [Feed(session, list(range(1, rows + 1)), logits=rows) for session in held]
    return functools.partial(lm.run_feeds_then_rewind, feeds), held


def pass_timing_args(doc: str, script: str, repeats: int = 7) -> tuple[argparse.Namespace, str]:
    """The in-process pass timings' flags (--target, --scale, --repeats, --out) and the command line as run."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--scale", type=float, default=1.0, help="cached positions (and prompts) times this (a short-context model)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    shown = " ".join(f"--{key} {value}" for key, value in vars(args).items() if value and value != parser.get_default(key))
    return args, f"python scripts/{script} {shown}".strip()


def main() -> None:
    args, command = pass_timing_args(__doc__, "flat_fold_widths.py")
    load = functools.partial(load_causal_lm, args.target, device="cpu")
    ragged, flat = CausalLM(load(), weights="int4"), CausalLM(load(), weights="int4")
    native, native_f32 = CausalLM(load(), weights="int4"), None
    if not native.use_flat_pass(slots=80, capacity=CAPACITY):
        raise RuntimeError("the flat pass does not serve on this machine (the log says why)")
    if native.passes.native:  # the kernel over a float32 store beside its default one
        native_f32 = CausalLM(load(), weights="int4")
        if not native_f32.use_flat_pass(slots=80, capacity=CAPACITY, kv_dtype="float32"):
            raise RuntimeError("the flat pass over a float32 store does not serve on this machine (the log says why)")
    else:
        native = None  # no kernel here: the flat pass folded, as below
    real, store_attention.unavailable = store_attention.unavailable, lambda *args: "asked for folded SDPA"
    try:
        if not flat.use_flat_pass(slots=80, capacity=CAPACITY):
            raise RuntimeError("the flat pass does not fold attention on this machine (the log says why)")
    finally:
        store_attention.unavailable = real
    threads = torch.get_num_threads()
    result = {"command": command, "machine": machine_facts(), "threads": threads, "ms": {},
              "flat_native_store": native.store.kv_dtype if native else ""}
    for name, (lengths, rows) in SHAPES.items():
        lengths = [max(1, round(length * args.scale)) for length in lengths]
        ragged_run, ragged_held = pass_run(ragged, lengths, rows)
        flat_run, flat_held = pass_run(flat, lengths, rows)
        native_run, native_held = pass_run(native, lengths, rows) if native else (None, None)
        f32_run, f32_held = pass_run(native_f32, lengths, rows) if native else (None, None)

        def at_block(block: int):
            def run() -> None:
                flat_pass.FOLD_KEY_BLOCK = block
                flat_run()
            return run

        runs = {(threads, "ragged"): ragged_run} | {(threads, f"flat_fold{block}"): at_block(block) for block in BLOCKS}
        if native_run:
            runs[(threads, "flat_native")] = native_run
            runs[(threads, "flat_native_f32")] = f32_run
        seconds = measure_interleaved(runs, args.repeats)
        result["ms"][name] = {key[1]: round(value * 1e3, 1) for key, value in seconds.items()}
        print(name, result["ms"][name], flush=True)
        del ragged_held, flat_held, native_held, f32_held
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
