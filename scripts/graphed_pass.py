"""A fixed-shape pass of the target over a static KV cache, eager and replayed as a CUDA graph.

What the engine room's GPU path would be (docs/design/engine-room.md): every session's rows in one
pass, one attention call per layer over a KV store allocated up front, written in place, no host
sync inside the pass. This probe times that pass for a few (sessions × rows) shapes, eagerly and, on
CUDA, captured once and replayed (torch.cuda.CUDAGraph), and checks that the replay gives the eager
pass's logits bit for bit and that the static pass's next tokens agree with transformers' forward on
a prompt. It is a measurement, not the serving path: one JSON object, for `make gpu-check`.

    python scripts/graphed_pass.py --device cuda --dtype bfloat16 --out graphed.json
    python scripts/graphed_pass.py --device cpu --target TINY_MODEL_DIR --context 64   (CI)
    python scripts/graphed_pass.py --device cpu --dtype float32 --context 512 --against-engine
                                    (beside specd's own pass today, CausalLM, on the same weights)
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Callable

import torch
import torch.nn.functional as F

from specd_common.config import DEFAULT_TARGET
from specd_engine.autotune import measure_interleaved
from specd_engine.lean_forward import rms_norm, rotate, signed_sin
from specd_engine.models import load_causal_lm, synchronize

SHAPES = ((1, 1), (1, 4), (8, 1), (8, 4), (32, 1))  # (sessions, rows each): decode, a verify's chain, batches


class StaticPass:
    """The target's forward over `sessions` × `rows` new positions with a static KV cache of `context`
    positions a session ([L, sessions, context, Hkv, D], written in place by index). Shapes are fixed
    once built, so the pass can be captured as a CUDA graph. Llama-shaped models only."""

    def __init__(self, model: torch.nn.Module, sessions: int, rows: int, context: int):
        config, base = model.config, model.model
        self.model, self.sessions, self.rows, self.context = model, sessions, rows, context
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        device, dtype = model.device, next(model.parameters()).dtype
        self.layers = [
            (layer.input_layernorm.weight, torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                      layer.self_attn.v_proj.weight]),  # [(Hq + 2 Hkv) D, C]
             layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
             torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]), layer.mlp.down_proj.weight)
            for layer in base.layers
        ]
        shape = (len(self.layers), sessions, context, self.kv_heads, self.dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.ids = torch.zeros((sessions, rows), dtype=torch.long, device=device)  # inputs, copied in before a replay
        self.starts = torch.zeros(sessions, dtype=torch.long, device=device)  # each session's first new position
        self.session_of_row = torch.arange(sessions, device=device).repeat_interleave(rows)  # [S·T]
        self.offsets = torch.arange(rows, device=device)  # [T]
        self.key_positions = torch.arange(context, device=device)  # [K]

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        """Logits [S, T, V] of the rows in self.ids at self.starts; their keys and values written."""
        s, t = self.sessions, self.rows
        positions = self.starts[:, None] + self.offsets  # [S, T]
        mask = (self.key_positions <= positions[:, :, None])[:, None]  # [S, 1, T, K]: causal over the store
        x = self.model.model.embed_tokens(self.ids)  # [S, T, C]
        cos, sin = self.model.model.rotary_emb(x, positions)  # [S, T, D] each
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [S, 1, T, D]
        flat_positions = positions.reshape(-1)  # [S·T]
        for index, (norm1, qkv_w, o_w, norm2, gate_up_w, down_w) in enumerate(self.layers):
            h = rms_norm(x, norm1, self.eps)
            qkv = F.linear(h, qkv_w).view(s, t, self.heads + 2 * self.kv_heads, self.dim).transpose(1, 2)  # [S, H', T, D]
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.keys[index].index_put_((self.session_of_row, flat_positions), k.transpose(1, 2).reshape(s * t, self.kv_heads, self.dim))
            self.values[index].index_put_((self.session_of_row, flat_positions), v.transpose(1, 2).reshape(s * t, self.kv_heads, self.dim))
            attended = F.scaled_dot_product_attention(q, self.keys[index].transpose(1, 2), self.values[index].transpose(1, 2),
                                                      attn_mask=mask, enable_gqa=self.heads != self.kv_heads)  # [S, Hq, T, D]
            x = x + F.linear(attended.transpose(1, 2).reshape(s, t, self.heads * self.dim), o_w)
            gate, up = F.linear(rms_norm(x, norm2, self.eps), gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        return self.model.lm_head(rms_norm(x, self.model.model.norm.weight, self.eps))  # [S, T, V]


def median_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each run, interleaved round by round (autotune.measure_interleaved: a warm-up
    round first, the device synchronized after each run), on the current thread count."""
    threads = torch.get_num_threads()
    seconds = measure_interleaved({(threads, name): run for name, run in runs.items()}, repeats)
    return {name: round(seconds[(threads, name)] * 1e3, 3) for name in runs}


@torch.inference_mode()
def agrees_with_transformers(model: torch.nn.Module, context: int) -> bool:
    """The static pass's greedy next tokens over an 8-token prompt fed at once equal transformers' forward's."""
    prompt = torch.arange(1, 9, device=model.device)[None] % model.config.vocab_size  # [1, 8]
    static = StaticPass(model, 1, prompt.shape[1], context)
    static.ids.copy_(prompt)
    ours = static().argmax(-1)
    theirs = model(input_ids=prompt).logits.argmax(-1)
    return bool(torch.equal(ours, theirs))


def measure(model: torch.nn.Module, device: torch.device, context: int, repeats: int) -> dict:
    """Per shape: eager ms, and on CUDA graphed ms with the replay's logits against the eager pass's."""
    shapes = {}
    for sessions, rows in SHAPES:
        static = StaticPass(model, sessions, rows, context)
        static.ids.copy_(torch.randint(0, model.config.vocab_size, static.ids.shape, device=device))
        static.starts.fill_(context // 2)  # half the store cached: attention over a realistic span
        if device.type != "cuda":
            shapes[f"{sessions}x{rows}"] = {"eager_ms": median_ms({"eager": static}, repeats)["eager"]}
            continue
        eager = static().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for _ in range(3):
                static()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = static()
        graph.replay()
        synchronize(device)
        entry = {f"{name}_ms": ms for name, ms in median_ms({"eager": static, "graphed": graph.replay}, repeats).items()}
        entry["graph_equals_eager"] = bool(torch.equal(captured, eager))
        entry["speedup"] = round(entry["eager_ms"] / entry["graphed_ms"], 2)
        shapes[f"{sessions}x{rows}"] = entry
    return shapes


def engine_passes(loaded, context: int, repeats: int) -> dict:
    """Per shape: ms of specd's own pass today (CausalLM.run_feeds, the ragged pass of
    docs/design/batching.md, float weights) over the same sessions × rows with context // 2 cached:
    the static pass's comparison on the same device and weights. It changes the model in place
    (the lean forward fuses its products), so it runs after the static passes."""
    from specd_engine.lm import CausalLM, Feed

    lm = CausalLM(loaded, weights="float")
    vocab, cached = loaded.model.config.vocab_size, context // 2
    shapes = {}
    for sessions, rows in SHAPES:
        held = [lm.new_session([(7 * s + j) % vocab for j in range(cached + 1)]) for s in range(sessions)]

        run = functools.partial(lm.run_feeds_then_rewind, [Feed(session, list(range(1, rows + 1)), logits=rows) for session in held])
        shapes[f"{sessions}x{rows}"] = {"engine_ms": median_ms({"engine": run}, repeats)["engine"]}
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=1024, help="positions a session's static cache holds")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="", help="write the JSON here too")
    parser.add_argument("--against-engine", action="store_true", help="also time specd's own pass (CausalLM) at each shape")
    args = parser.parse_args()
    loaded = load_causal_lm(args.target, device=args.device, dtype=args.dtype)
    model, device = loaded.model, loaded.device
    result = {"device": str(device), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
              "context": args.context, "agrees_with_transformers": None, "shapes": {}}
    try:
        result["agrees_with_transformers"] = agrees_with_transformers(model, args.context)
        result["shapes"] = measure(model, device, args.context, args.repeats)
        if args.against_engine:
            for shape, entry in engine_passes(loaded, args.context, args.repeats).items():
                result["shapes"][shape].update(entry)
    except Exception as error:  # a device window must still record what ran
        result["error"] = repr(error)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
