"""The Medusa heads' proposals in float32, in 8 bits and natively: what each costs as served, what each proposes.

The verify measures at start-up which precision each row count's heads take (MedusaHeads.tune_product),
with the weights hot in cache; served, a proposal follows a pass that streamed the target's weights, so
its own weights come from memory. This times, on the model thread, a proposal of every head right after
a decoding pass of the int4 target, for one row and four, with the blocks and products in float32 and
in int8 (specd's AMX tiles where they serve), and in one native call (verify_service/native_heads.py,
where it runs), interleaved. And it runs the target greedily over prompts, then asks each for
proposals at every answer row (teacher-forced: the answer's own next token as the token input) and
reports how often they agree, how often each head's proposal is the answer's token, and how often a
chain of proposals is the answer's tokens up to each depth (what a round keeps). One JSON object
(docs/design/medusa-heads.md).

    python scripts/heads_precision.py --out docs/benchmarks/never_loses/heads_precision.json
    python scripts/heads_precision.py --target TINY_MODEL_DIR --heads HEADS_DIR --prompts P.jsonl --limit 1 --tokens 4 --repeats 1   (CI)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphed_pass import print_and_save  # (scripts/, beside this one)
from specd_app.bench import load_prompts, machine_facts
from specd_common.config import DEFAULT_MEDUSA_HEADS, DEFAULT_TARGET
from specd_engine.lm import CausalLM
from specd_engine.models import load_causal_lm
from verify_service import native_heads
from verify_service.medusa import FLOAT32, INT8, MedusaHeads, load_heads

PROMPTS = ["docs/benchmarks/unseen_prompts.jsonl", "docs/benchmarks/heldout_prompts.jsonl"]
ROWS = (1, 4)  # a greedy (or coupled sampled) session's row, and a sampled chain's
WARMUP = 3  # timings dropped: first calls allocate
NATIVE = "native"  # the proposal in one native call (verify_service/native_heads.py)


def ways(heads: MedusaHeads) -> tuple[str, ...]:
    """The proposals compared: float32, int8 and, where it runs, native."""
    return (FLOAT32, INT8) if native_heads.unavailable(heads) else (FLOAT32, INT8, NATIVE)


def prepare(heads: MedusaHeads, way: str) -> None:
    """The heads' weights packed for `way` (untimed: packing takes longer than a proposal)."""
    if way != NATIVE:
        heads.fix_precision(way)


def proposals_of(heads: MedusaHeads, way: str, native, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every head's best proposal [rows, K] the given way (prepared)."""
    if way == NATIVE:
        return native.ranked(features, tokens, 1, len(heads.heads))[0][..., 0]
    return heads.propose(features, tokens)


def cold_proposals(lm: CausalLM, heads: MedusaHeads, repeats: int) -> dict:
    """ms of a proposal of every head after a one-row decoding pass, by rows and precision (medians)."""
    def work() -> dict:
        session = lm.new_session([(5 * j) % (lm.vocab_size - 10) + 10 for j in range(200)])
        native = native_heads.NativeHeads(heads) if NATIVE in ways(heads) else None
        times: dict[str, list[float]] = {}
        for _ in range(repeats + WARMUP):
            for rows in ROWS:
                features = torch.randn(rows, heads.config.hidden_size)
                tokens = torch.randint(0, heads.config.vocab_size, (rows,))
                for way in ways(heads):
                    prepare(heads, way)
                    lm.forward(session, [5])  # a pass streams the target's weights, as serving does
                    start = time.perf_counter()
                    proposals_of(heads, way, native, features, tokens)
                    times.setdefault(f"{rows} row(s), {way}", []).append((time.perf_counter() - start) * 1e3)
        return {name: round(statistics.median(values[WARMUP:]), 2) for name, values in times.items()}
    return lm.run(work)  # on the model thread: torch work on another would start a second OpenMP team


@torch.inference_mode()
def agreement(loaded, heads: MedusaHeads, prompts: list[dict], tokens: int) -> dict:
    """Over every answer row of the target's greedy answers: how often int8's (and native) proposals equal
    float32's, how often each way's head k proposes the answer's token k + 1 after the row's next one,
    and how often its heads 1..k all do (a chain a round keeps up to depth k)."""
    compared = ways(heads)
    native = native_heads.NativeHeads(heads) if NATIVE in compared else None
    k_heads = len(heads.heads)
    same = {way: [0] * k_heads for way in compared[1:]}
    hits = {way: [0] * k_heads for way in compared}
    chains = {way: [0] * k_heads for way in compared}
    tokenizer, model, rows = loaded.tokenizer, loaded.model, 0
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # [1, P]
        answer = model.generate(ids, max_new_tokens=tokens, do_sample=False)[0]  # [P + n]
        hidden = model(answer[None], output_hidden_states=True).hidden_states[-1][0]  # [P + n, H]: after the final norm
        at = list(range(ids.shape[1] - 1, answer.shape[0] - k_heads - 1))  # rows whose heads' tokens are all in the answer
        if not at:
            continue
        proposed = {}
        for way in compared:
            prepare(heads, way)
            proposed[way] = proposals_of(heads, way, native, hidden[at], answer[[row + 1 for row in at]])  # [rows, K]
        for way, proposals in proposed.items():
            chain = torch.ones(len(at), dtype=torch.bool)
            for k in range(k_heads):
                hit = proposals[:, k] == answer[[row + 2 + k for row in at]]
                chain &= hit
                hits[way][k] += int(hit.sum())
                chains[way][k] += int(chain.sum())
                if way in same:
                    same[way][k] += int((proposals[:, k] == proposed[FLOAT32][:, k]).sum())
        rows += len(at)
    share = lambda counts: [round(count / max(rows, 1), 4) for count in counts]  # noqa: E731
    return {"rows": rows, **{f"{way}_equals_float32_by_head": share(counts) for way, counts in same.items()},
            "top1_by_head": {way: share(counts) for way, counts in hits.items()},
            "chain_by_depth": {way: share(counts) for way, counts in chains.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--heads", default=str(DEFAULT_MEDUSA_HEADS))
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--limit", type=int, default=12, help="first N prompts of each file")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens a prompt")
    parser.add_argument("--repeats", type=int, default=22)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    shown = " ".join(f"--{key} {' '.join(value) if isinstance(value, list) else value}" for key, value in vars(args).items()
                     if value and value != parser.get_default(key))
    # every torch call on the model's thread: one on this thread too starts a second OpenMP team, whose
    # workers then sleep between parallel regions and made the int4 passes here ~2x slower (engine-room.md)
    lm = CausalLM(load_causal_lm(args.target, device="cpu"), weights="int4")
    loaded = lm.run(load_causal_lm, args.target, device="cpu", dtype="float32")
    heads = lm.run(load_heads, args.heads, loaded.model)
    prompts = [prompt for path in args.prompts for prompt in load_prompts(path, args.limit)]
    result = {"command": f"python scripts/heads_precision.py {shown}".strip(), "machine": machine_facts(),
              "threads": torch.get_num_threads(), "agreement": lm.run(agreement, loaded, heads, prompts, args.tokens)}
    result["proposal_ms_after_a_pass"] = cold_proposals(lm, heads, args.repeats)
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
