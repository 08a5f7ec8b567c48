"""Where a verify pass's time goes on this machine, as rows and sessions grow (docs/design/engine-room.md).

Three parts, one JSON line each, on one torch thread (an int4 verify's passes run on one thread count):
  attention  whether SDPA gives a one-query row the same bits alone and among other sessions' rows
             (keys padded and masked to the longest): at its own key count, and padded to multiples
             of the CPU kernel's key block; a chain's rows in one call against each alone; and what
             padding costs one row over 200 keys
  products   the decoder's four products at the target's shapes (the whole stack of layers) for M rows
             in each kernel this torch build has on a CPU: int4 groups (what the default verify serves),
             float32 plain, rows (x·Wᵀ from Wᵀ), cols (W·xᵀ), oneDNN-prepacked, bfloat16, int8 rows
             (bfloat16 inputs, as served); whether a row's result is bit-identical alone and among 8
             (batch invariance); and the served int8 LM head for M rows
  sessions   passes of CausalLM (int4 where the target allows) over S sessions of PROMPT positions,
             one new position each, and over one session's chain of n positions (a verify's): the
             whole pass, the pass without the SDPA calls, and without attention at all (no KV
             appends either), interleaved, each the fastest of a few passes

    make pass-anatomy ANATOMY_ARGS="--rows 1 2 4 8 --sessions 1 8 --positions 4"
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from specd_common.config import DEFAULT_TARGET
from specd_engine import lean_forward
from specd_engine.autotune import measure_interleaved
from specd_engine.lm import CausalLM
from specd_engine.sessions import Feed
from specd_engine.models import load_causal_lm

GROUP = 32  # int4 group size, as specd_engine/quantized.py packs


def product_kernels(shapes: list[tuple[int, int]]) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """name → f(x [M, in] float32, layer) giving [M, out], one random weight per shape and kernel."""
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.05 for n, k in shapes]  # [out, in]
    transposed = [w.t().contiguous() for w in dense]  # [in, out]
    prepacked = [w.to_mkldnn() for w in dense]
    halves = [w.to(torch.bfloat16) for w in dense]
    int8 = [(torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n).to(torch.bfloat16)) for n, k in shapes]
    int4 = []
    for n, k in shapes:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        int4.append((packed, (torch.randn(k // GROUP, n, 2) * 0.01).to(torch.bfloat16).contiguous()))
    return {
        "int4": lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), int4[i][0], GROUP, int4[i][1]),
        "float32_plain": lambda x, i: F.linear(x, dense[i]),
        "float32_rows": lambda x, i: x @ transposed[i],
        "float32_cols": lambda x, i: torch.mm(dense[i], x.t()).t().contiguous(),
        "float32_prepacked": lambda x, i: torch._C._nn.mkldnn_linear(x.to_mkldnn(), prepacked[i]).to_dense(),
        "bfloat16": lambda x, i: F.linear(x.to(torch.bfloat16), halves[i]),
        "int8": lambda x, i: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), int8[i][0], int8[i][1]),
    }


@torch.inference_mode()
def products(model, rows: list[int], repeats: int) -> dict:
    """ms of the decoder's products over every layer for each M, per kernel; batch invariance per kernel."""
    config = model.config
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    shapes = [(qkv, hidden), (hidden, config.num_attention_heads * head_dim), (2 * inner, hidden), (hidden, inner)]
    layers = config.num_hidden_layers
    kernels = product_kernels(shapes)
    out = {"layers": layers, "shapes_out_in": shapes, "ms": {name: {} for name in kernels}, "row_alone_equals_row_among_8": {},
           "lm_head_int8_ms": {}}
    head = product_kernels([(config.vocab_size, hidden)])["int8"]  # the served LM head (quantized.Int8Linear)
    for m in rows:  # every kernel and the head timed round by round (autotune.measure_interleaved), one thread
        inputs, head_input = [torch.randn(m, k) for _, k in shapes], torch.randn(m, hidden)
        runs = {(1, name): functools.partial(_stack, kernel, inputs) for name, kernel in kernels.items()}
        runs[(1, "lm_head")] = functools.partial(head, head_input, 0)
        seconds = measure_interleaved(runs, repeats)
        for name in kernels:
            out["ms"][name][m] = round(seconds[(1, name)] * 1e3 * layers, 3)
        out["lm_head_int8_ms"][m] = round(seconds[(1, "lm_head")] * 1e3, 3)
    for name, kernel in kernels.items():
        x = torch.randn(8, shapes[0][1])
        among = kernel(x, 0)
        out["row_alone_equals_row_among_8"][name] = all(torch.equal(among[i : i + 1], kernel(x[i : i + 1], 0)) for i in range(8))
    return out


def _stack(kernel: Callable[[torch.Tensor, int], torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """One layer's products: kernel over each input in turn."""
    for index, x in enumerate(inputs):
        kernel(x, index)


KEY_BLOCK = 512  # torch's CPU flash attention reduces over keys in blocks of this many (fewer: one block)


def _padded(keys: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [1, Hkv, n, D] zero-padded to `length` positions, and the bool mask [1, 1, 1, length] of the real ones."""
    out = keys.new_zeros((1, keys.shape[1], length, keys.shape[3]))
    out[:, :, : keys.shape[2]] = keys
    mask = torch.zeros((1, 1, 1, length), dtype=torch.bool)
    mask[..., : keys.shape[2]] = True
    return out, mask


@torch.inference_mode()
def attention_invariance(heads: int, kv_heads: int, dim: int) -> dict:
    """Whether SDPA gives a one-query row the same bits alone and inside a batch of other sessions' rows
    (keys zero-padded to the batch's longest, masked): at the row's own key count, and with every row's
    keys padded to a multiple of KEY_BLOCK; and whether a chain's rows in one call match each row alone."""
    torch.manual_seed(0)
    lengths = [1, 5, 37, 200, 300, 513, 700, 1030, 1536]
    queries = [torch.randn(1, heads, 1, dim) for _ in lengths]
    keys = [torch.randn(1, kv_heads, n, dim) for n in lengths]
    values = [torch.randn(1, kv_heads, n, dim) for n in lengths]
    sdpa = functools.partial(F.scaled_dot_product_attention, scale=dim ** -0.5, enable_gqa=heads != kv_heads)
    blocked = lambda n: -(-n // KEY_BLOCK) * KEY_BLOCK
    out = {}
    for name, own in (("own_length", lambda n: n), ("padded_to_key_blocks", blocked)):
        alone = []
        for q, k, v, n in zip(queries, keys, values, lengths):
            (kp, mask), (vp, _) = _padded(k, own(n)), _padded(v, own(n))
            alone.append(sdpa(q, kp, vp, attn_mask=mask))
        width = 2 * blocked(max(lengths))
        parts = [(_padded(k, width), _padded(v, width)) for k, v in zip(keys, values)]
        batched = sdpa(torch.cat(queries), torch.cat([kp for (kp, _), _ in parts]), torch.cat([vp for _, (vp, _) in parts]),
                       attn_mask=torch.cat([mask for (_, mask), _ in parts]))
        out[name] = all(torch.equal(batched[i : i + 1], row) for i, row in enumerate(alone))
    rows, n = 4, lengths[4]
    (kp, _), (vp, _) = _padded(keys[4], KEY_BLOCK), _padded(values[4], KEY_BLOCK)
    chain_mask = torch.zeros((1, 1, rows, KEY_BLOCK), dtype=torch.bool)
    for r in range(rows):
        chain_mask[0, 0, r, : n - rows + 1 + r] = True
    q = torch.randn(1, heads, rows, dim)
    together = sdpa(q, kp, vp, attn_mask=chain_mask)
    out["chain_rows_in_one_call"] = all(torch.equal(together[:, :, r : r + 1], sdpa(q[:, :, r : r + 1], kp, vp, attn_mask=chain_mask[:, :, r : r + 1]))
                                        for r in range(rows))
    (kp, mask), (vp, _) = _padded(keys[3], KEY_BLOCK), _padded(values[3], KEY_BLOCK)  # 200 keys, padded to 512
    seconds = measure_interleaved({(1, "own_length"): lambda: sdpa(queries[3], keys[3], values[3]),
                                   (1, "padded_to_key_blocks"): lambda: sdpa(queries[3], kp, vp, attn_mask=mask)}, 200)
    out["one_row_over_200_keys_us"] = {name: round(value * 1e6, 1) for (_, name), value in seconds.items()}
    return out


def _no_sdpa(layer, index, q, k, v, segments, masks):
    """_attend_each without attention: the KV appends only (the output is not the model's)."""
    for segment in segments:
        rows = slice(segment.start, segment.start + segment.n)
        segment.cache.update(k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None], index)  # [1, Hkv, n, D]
    return q.new_zeros(q.shape)


def _no_attention(layer, index, q, k, v, segments, masks):
    return q.new_zeros(q.shape)


def sessions(target: str, counts: list[int], positions: list[int], prompt: int, repeats: int) -> dict:
    """ms of passes over S sessions × n new positions each (a verify's chain: every position's logits),
    whole, without SDPA and without attention; the variants interleaved, each the fastest of 3 passes."""
    lm = CausalLM(load_causal_lm(target, device="cpu"), weights="auto")
    variants = {"whole": lean_forward._attend_each, "no_sdpa": _no_sdpa, "no_attention": _no_attention}
    out = {"weights": lm.weights, "prompt": prompt, "ms": {}}
    shapes = [(count, 1) for count in counts] + [(1, n) for n in positions if n > 1]
    try:
        for count, n in shapes:
            held = [lm.new_session([(7 * s + j) % 4000 + 10 for j in range(prompt)]) for s in range(count)]
            best = {name: [] for name in variants}
            for _ in range(repeats):
                for name, attend in variants.items():
                    lean_forward._attend_each = attend
                    fastest = float("inf")
                    for _ in range(3):
                        feeds = [Feed(session, list(range(5, 5 + n)), logits=n) for session in held]
                        started = time.perf_counter()
                        lm.run_feeds_then_rewind(feeds)
                        fastest = min(fastest, (time.perf_counter() - started) * 1e3)
                    best[name].append(fastest)
            out["ms"][f"{count}x{n}"] = {name: round(statistics.median(times), 3) for name, times in best.items()}
    finally:
        lean_forward._attend_each = variants["whole"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32], help="session counts, one position each")
    parser.add_argument("--positions", type=int, nargs="+", default=[4], help="positions of one session's chain pass")
    parser.add_argument("--prompt", type=int, default=200, help="positions each session holds")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_causal_lm(args.target, device="cpu").model
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    print(json.dumps({"attention": attention_invariance(
        config.num_attention_heads, config.num_key_value_heads, head_dim)}), flush=True)
    print(json.dumps({"products": products(model, args.rows, args.repeats)}), flush=True)
    print(json.dumps({"sessions": sessions(args.target, args.sessions, args.positions, args.prompt, args.repeats)}), flush=True)


if __name__ == "__main__":
    main()
