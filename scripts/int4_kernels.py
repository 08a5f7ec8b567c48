"""The int4 target's passes with specd's tile kernel beside PyTorch's int4 kernel.

specd_engine/int4_tiles.py multiplies every row of a pass by a weight tile at once (Intel AMX, or
AVX-512 VNNI with 8-bit input groups or AVX-512 BF16 where the CPU has no AMX; the tiles are timed on
each instruction set this machine runs); PyTorch's kernel computes each row on its own, and its prompt
rows take a dense bfloat16 copy of the weights where the machine's GEMM is cheaper
(quantized.choose_prompt_kernel). This times, interleaved round by round in one process, the
target's int4 products and 8-bit LM head alone at several row counts, one ragged pass of the int4
default target with each kernel for sessions of spread lengths and one or four rows each, and a
prompt's prefill; and checks that the kernels give a row the same logits alone and beside other
sessions. Where the tiles do not run
(no AMX, no compiler) it times PyTorch's kernel alone and says why. One JSON object
(docs/design/engine-room.md).

    python scripts/int4_kernels.py --repeats 7 --out docs/benchmarks/engine_room/int4_kernels.json
    python scripts/int4_kernels.py --target TINY_MODEL_DIR --scale 0.1 --repeats 1   (CI)
"""

from __future__ import annotations

import functools

import torch

from flat_fold_widths import pass_run, pass_timing_args  # (scripts/, beside this one)
from graphed_pass import median_ms, print_and_save
from specd_app.bench import machine_facts
from specd_engine import int4_tiles
from specd_engine import quantized
from specd_engine.lm import CausalLM
from specd_engine.models import load_causal_lm

SHAPES = {  # name: (cached positions of each session, rows each)
    "1x1 at 256": ([256], 1), "1x4 at 256": ([256], 4), "4x1 spread 130-370": ([130 + 80 * i for i in range(4)], 1),
    "8x1 spread 130-690": ([130 + 80 * i for i in range(8)], 1), "8x4 spread 130-690": ([130 + 80 * i for i in range(8)], 4),
    "32x1 spread 100-782": ([100 + 22 * i for i in range(32)], 1),
}
PROMPTS = (45, 400)  # prompt lengths whose prefill is timed
PRODUCT_ROWS = (1, 4, 8, 32, 64)  # rows the products alone are timed at


def products_run(lm: CausalLM, rows: int):
    """Every int4 product of the target's layers, then its LM head, over `rows` random rows (on the model
    thread, as a pass runs them)."""
    products = quantized.int4_products(lm.lean.layers)
    inputs = {width: torch.randn(rows, width) for width in {product.in_features for product in products}}
    head_rows = torch.randn(rows, lm.lean.lm_head.in_features)
    return lambda: lm.run(lambda: ([product.rows(inputs[product.in_features]) for product in products], lm.lean.lm_head(head_rows)))


def prefill_run(lm: CausalLM, length: int):
    """A new session's prefill of `length` prompt tokens (the session dropped after)."""
    prompt = [(5 * j) % (lm.vocab_size - 10) + 10 for j in range(length)]
    return lambda: lm.new_session(prompt)


def same_alone_and_beside(lm: CausalLM, lengths: list[int]) -> bool:
    """The first session's next-position logits alone and in one pass beside the others'."""
    prompts = [[(7 * s + j) % (lm.vocab_size - 10) + 10 for j in range(n)] for s, n in enumerate(lengths)]
    alone = lm.forward(lm.new_session(prompts[0]), [3])
    together = lm.forward_batch([(lm.new_session(prompt), [3]) for prompt in prompts])[0]
    # on the model thread: a parallel torch operator on this one would start a second OpenMP team, and
    # libgomp then stops its workers spinning: every later pass ~50% slower (engine-room.md)
    return lm.run(torch.equal, alone, together)


def on_isa(isa: str | None, run):
    """`run` with the tiles' products on the instruction set `isa` (None: as they are)."""
    def timed():
        with int4_tiles.instruction_set_as(isa):
            return run()
    return timed


def main() -> None:
    args, command = pass_timing_args(__doc__, "int4_kernels.py", repeats=9)
    load = functools.partial(load_causal_lm, args.target, device="cpu")
    models = {}  # kernel → its CausalLM: PyTorch's everywhere, the tiles where this machine runs them
    if not int4_tiles.unavailable():
        models["tiles"] = CausalLM(load(), weights="int4")
    int4_tiles.use("torch")
    models["torch"] = CausalLM(load(), weights="int4")
    int4_tiles.use("auto")
    threads = torch.get_num_threads()
    for lm in models.values():
        lm.tune(threads=threads)  # PyTorch's prompt rows take a dense weight where the GEMM is cheaper, as a verify chooses
    # kernel → (its CausalLM, the tiles' instruction set): the tiles once on each instruction set this machine runs
    kernels = {"torch": (models["torch"], None), **{f"tiles {isa}": (models.get("tiles"), isa) for isa in int4_tiles.runnable_instruction_sets()}}
    scaled = lambda values: [max(1, round(value * args.scale)) for value in values]  # noqa: E731
    result = {"command": command, "machine": machine_facts(), "threads": threads, "tiles_unavailable": int4_tiles.unavailable(),
              "tiles_instruction_set": int4_tiles.instruction_set(), "torch_prompt_kernel": models["torch"].passes.prompt_kernel,
              "products_ms": {}, "ms": {},
              "same_alone_and_beside": {kernel: on_isa(isa, lambda lm=lm: same_alone_and_beside(lm, scaled([300, 120, 700, 64])))()
                                        for kernel, (lm, isa) in kernels.items()}}
    for rows in PRODUCT_ROWS:
        result["products_ms"][f"{rows} rows"] = median_ms({kernel: on_isa(isa, products_run(lm, rows)) for kernel, (lm, isa) in kernels.items()},
                                                          args.repeats)
        print(f"products and LM head, {rows} rows", result["products_ms"][f"{rows} rows"], flush=True)
    for name, (lengths, rows) in SHAPES.items():
        runs = {kernel: pass_run(lm, scaled(lengths), rows) for kernel, (lm, _) in kernels.items()}  # kernel → (run, sessions held)
        result["ms"][name] = median_ms({kernel: on_isa(kernels[kernel][1], run) for kernel, (run, _) in runs.items()}, args.repeats)
        print(name, result["ms"][name], flush=True)
        del runs
    for length in scaled(PROMPTS):
        runs = {kernel: on_isa(isa, prefill_run(lm, length)) for kernel, (lm, isa) in kernels.items()}
        result["ms"][f"prefill {length}"] = median_ms(runs, args.repeats)
        print(f"prefill {length}", result["ms"][f"prefill {length}"], flush=True)
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
