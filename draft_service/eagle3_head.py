"""EAGLE-3 heads in the layouts the field publishes (Li et al., "EAGLE-3", 2025).

A head reads the target's hidden states at a low, a middle and a high layer, fused by `fc`, beside
the embedding of the token after them, through one decoder layer whose attention takes both:

    g_t = fc([h_t^(low) ; h_t^(mid) ; h_t^(high)])         [H]   from the target (feature rows [3 Ht])
    a_t = [input_layernorm(e_{t+1}) ; hidden_norm(g_t)]     [2H]  q/k/v read 2H, the residual is g_t
    o_t = layer(a_t, residual g_t)                          [H]   (norm_before_residual: the residual is hidden_norm(g_t))
    logits = lm_head(norm(o_t))                             [V']  draft index i is target token i + d2t[i]

While drafting, the next step reads o_t itself in g's place (not through fc): the layer's output
before the final norm is what is fed back. A step's input pairs (token x_t, feature of t - 1), as
specd's own feature head does, so draft_service/feature_drafter.py serves both.

Layouts (checked against vLLM's `llama_eagle3.py` loader, which maps `midlayer.` to `layers.0.`,
and speculators' Eagle3 config and converter tests; a public checkpoint is never downloaded here):
  * "eagle" (the EAGLE authors' and SpecForge's, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json
    is a LlamaConfig (architectures ["LlamaForCausalLMEagle3"]) plus `draft_vocab_size` and, where the
    target is wider, `target_hidden_size`; weights (model.safetensors or pytorch_model.bin) `fc.weight`,
    `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
    `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
    `norm.weight`, `lm_head.weight`, `d2t` (int64 [V']), `t2d` (bool [V]), sometimes `embed_tokens.weight`.
    Target layers: (2, L // 2, L - 3) of the target's L, as vLLM and SGLang default.
  * "speculators" (vLLM's speculators library): config.json with `speculators_model_type: "eagle3"`,
    the layer's LlamaConfig under `transformer_layer_config`, `draft_vocab_size`,
    `norm_before_residual`, `target_hidden_size`, and `eagle_aux_hidden_state_layer_ids`; weights
    as above with `layers.0.` for `midlayer.`.
Layer ids are in vLLM's numbering, which is transformers' `hidden_states` numbering (j = the output
of decoder layer j, 0 = the embedding) and the verify's `feature_layers` (common.proto).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from draft_service.feature_head import DecoderShape, HeadCache, RMSNorm, rotate_half

CONFIG_FILE = "config.json"
LAYOUT_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}


@dataclass
class Eagle3Config(DecoderShape):
    """A head's shapes, its vocabulary map's sizes and the target layers it reads."""

    rope_scaling: Optional[dict]
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # transformers hidden_states indices fc reads, low..high
    layout: str  # "eagle" or "speculators"
    norm_before_residual: bool = False

    @property
    def feature_size(self) -> int:
        """Width of the target feature rows the head reads: its layers side by side."""
        return len(self.feature_layers) * self.target_hidden_size


def is_eagle3_checkpoint(folder: Path) -> bool:
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        return False
    raw = json.loads(path.read_text())
    return raw.get("speculators_model_type") == "eagle3" or "LlamaForCausalLMEagle3" in raw.get("architectures", [])


def default_feature_layers(target_num_layers: int) -> tuple[int, ...]:
    """The layers vLLM and SGLang read when a head names none: low, middle, high."""
    return (2, target_num_layers // 2, target_num_layers - 3)


def read_eagle3_config(folder: Path, target_num_layers: int) -> Eagle3Config:
    """The head's config from either layout's config.json (ValueError naming what is wrong)."""
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{folder} holds no {CONFIG_FILE}: not an EAGLE-3 checkpoint folder")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type") == "eagle3":
        layout, layer = "speculators", raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{path}: a speculators eagle3 config needs transformer_layer_config (the layer's LlamaConfig)")
        layers = raw.get("eagle_aux_hidden_state_layer_ids")
    elif "LlamaForCausalLMEagle3" in raw.get("architectures", []):
        layout, layer, layers = "eagle", raw, raw.get("eagle_aux_hidden_state_layer_ids")
    else:
        raise ValueError(f"{path}: neither an EAGLE authors' config (architectures LlamaForCausalLMEagle3) nor a speculators one "
                         "(speculators_model_type eagle3)")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        config = Eagle3Config(
            hidden_size=hidden, num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=float(layer.get("rope_theta", 10000.0)),
            rope_scaling=layer.get("rope_scaling"), vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
            feature_layers=tuple(int(i) for i in layers) if layers else default_feature_layers(target_num_layers),
            layout=layout, norm_before_residual=bool(raw.get("norm_before_residual", layer.get("norm_before_residual", False))),
        )
    except KeyError as missing:
        raise ValueError(f"{path}: missing {missing.args[0]}") from None
    if not all(1 <= i <= target_num_layers for i in config.feature_layers):
        raise ValueError(f"{path}: the head reads target layers {list(config.feature_layers)}; this target has 1..{target_num_layers}")
    if config.feature_size == config.hidden_size:  # Eagle3Head.forward tells target rows from its own output by width
        raise ValueError(f"{path}: fc must read several target layers (it reads {list(config.feature_layers)})")
    inverse_frequencies(config)  # refuses a rope scaling it cannot follow
    return config


def inverse_frequencies(config: Eagle3Config) -> torch.Tensor:
    """RoPE's inverse frequencies [d/2]: Llama's default, or Llama 3's scaled ones ("llama3" rope_scaling)."""
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inverse
    if kind != "llama3":
        raise ValueError(f"rope_scaling {kind!r} is not supported (default and llama3 are)")
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    wavelength = 2 * math.pi / inverse
    smooth = ((original / wavelength) - low) / (high - low)
    scaled = torch.where(wavelength > original / low, inverse / factor, inverse)  # long wavelengths: scaled down
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class Eagle3Head(nn.Module):
    """fc + one decoder layer over [embedding ; hidden] + norm + a reduced LM head (the module docstring)."""

    def __init__(self, config: Eagle3Config, embedding: torch.Tensor):
        """embedding [V, H]: the checkpoint's embed_tokens or the target's."""
        super().__init__()
        h, d, c = config.hidden_size, config.head_dim, config
        self.config = config
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj, self.up_proj = nn.Linear(h, c.intermediate_size, bias=False), nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)  # [V, H]
        self.register_buffer("vocab_ids", torch.arange(c.draft_vocab_size), persistent=False)  # [V'] target id of each draft index
        self.register_buffer("inverse_frequencies", inverse_frequencies(c), persistent=False)  # [d/2]

    def forward(self, token_ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                cache: Optional[HeadCache] = None) -> torch.Tensor:
        """token_ids [B, T] (x_t), prev [B, T, F]: the target's fused rows f_{t-1} (F = feature_size, through
        fc) or the head's own previous output (F = hidden_size, fed back while drafting), positions [T] →
        the layer's output [B, T, H] before the final norm. With a cache (B = 1) attends to the cached
        positions too and appends this call's keys and values."""
        c = self.config
        fed_back = prev.shape[-1] == c.hidden_size  # three target layers are never one hidden state wide
        hidden = prev.to(self.fc.weight.dtype) if fed_back else self.fc(prev.to(self.fc.weight.dtype))  # [B, T, H]
        normed = self.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        embedded = self.input_layernorm(self.embedding[token_ids].to(hidden.dtype))  # [B, T, H]
        mixed = torch.cat((embedded, normed), dim=-1)  # [B, T, 2H]
        x = residual + self._attend(mixed, positions, cache)
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def _attend(self, mixed: torch.Tensor, positions: torch.Tensor, cache: Optional[HeadCache]) -> torch.Tensor:
        """Attention of mixed [B, T, 2H] over the cache and itself, causally → [B, T, H]."""
        c = self.config
        batch, length, _ = mixed.shape
        q = self._rope(self.q_proj(mixed).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2), positions)
        k = self._rope(self.k_proj(mixed).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2), positions)
        v = self.v_proj(mixed).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, kv, T, d]
        past = 0
        if cache is not None:
            past = cache.length
            if past:
                k, v = torch.cat((cache.keys[None], k), dim=2), torch.cat((cache.values[None], v), dim=2)  # [1, kv, past + T, d]
            cache.keys, cache.values = k[0], v[0]
        mask = None if past == 0 else torch.ones(length, past + length, dtype=torch.bool, device=mixed.device).tril(diagonal=past)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0 and length > 1,
                                                  enable_gqa=c.num_heads != c.num_kv_heads)  # [B, heads, T, d]
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, c.num_heads * c.head_dim))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [B, h, T, d] at positions [T]."""
        angles = positions.float()[:, None] * self.inverse_frequencies[None, :]  # [T, d/2]
        emb = torch.cat((angles, angles), dim=-1)  # [T, d]
        return (x.float() * emb.cos() + rotate_half(x.float()) * emb.sin()).to(x.dtype)

    def logits(self, estimate: torch.Tensor) -> torch.Tensor:
        """The layer's output [..., H] → float scores over the draft vocabulary [..., V']."""
        return self.lm_head(self.norm(estimate.to(self.lm_head.weight.dtype))).float()


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint in config.layout's names, with its shape (embed_tokens optional)."""
    h, d, i, p = config.hidden_size, config.head_dim, config.intermediate_size, LAYOUT_PREFIX[config.layout]
    return {
        "fc.weight": (h, config.feature_size),
        f"{p}input_layernorm.weight": (h,), f"{p}hidden_norm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        f"{p}self_attn.q_proj.weight": (config.num_heads * d, 2 * h), f"{p}self_attn.k_proj.weight": (config.num_kv_heads * d, 2 * h),
        f"{p}self_attn.v_proj.weight": (config.num_kv_heads * d, 2 * h), f"{p}self_attn.o_proj.weight": (h, config.num_heads * d),
        f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h), f"{p}mlp.down_proj.weight": (h, i),
        "norm.weight": (h,), "lm_head.weight": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,),
    }


def _module_name(name: str, layout: str) -> str:
    """A checkpoint tensor's name → Eagle3Head's attribute path."""
    name = name.removeprefix(LAYOUT_PREFIX[layout])
    return name.removeprefix("self_attn.").removeprefix("mlp.")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors (or every *.safetensors shard), else pytorch_model.bin (weights only)."""
    from safetensors.torch import load_file

    shards = sorted(Path(folder).glob("*.safetensors"))
    if shards:
        return {name: tensor for shard in shards for name, tensor in load_file(str(shard)).items()}
    binary = Path(folder) / "pytorch_model.bin"
    if binary.exists():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} holds no *.safetensors and no pytorch_model.bin")


def load_eagle3(folder: Path, embedding: Optional[torch.Tensor], target_num_layers: int,
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A checkpoint folder as an Eagle3Head in eval mode over `embedding` (the target's [V, H]) unless it
    holds its own embed_tokens; every tensor checked by name and shape (ValueError naming it)."""
    config = read_eagle3_config(folder, target_num_layers)
    tensors = read_tensors(folder)
    own = tensors.pop("embed_tokens.weight", None)
    embedding = own if own is not None else embedding
    if embedding is None or tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"EAGLE-3 head {folder} needs an embedding [{config.vocab_size}, {config.hidden_size}] (its own or the "
                         f"target's); {'none' if embedding is None else list(embedding.shape)} given: is it for this target?")
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"EAGLE-3 head {folder}: tensor {name} is missing ({config.layout} layout)")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"EAGLE-3 head {folder}: tensor {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    head = Eagle3Head(config, embedding)
    with torch.no_grad():
        for name in expected:
            if name not in ("d2t", "t2d"):
                head.get_parameter(_module_name(name, config.layout)).copy_(tensors[name].float())
        head.vocab_ids.add_(tensors["d2t"].long())
    if not (0 <= int(head.vocab_ids.min()) and int(head.vocab_ids.max()) < config.vocab_size):
        raise ValueError(f"EAGLE-3 head {folder}: d2t maps draft ids outside the target's vocabulary of {config.vocab_size}")
    return head.to(dtype).eval()


def write_eagle3_checkpoint(folder: Path, config: Eagle3Config, seed: int = 0, with_embedding: bool = False,
                            dtype: torch.dtype = torch.bfloat16) -> None:
    """A random checkpoint in exactly config.layout's published layout (config.json keys, tensor names,
    shapes and dtypes; d2t int64, t2d bool): what tests write instead of downloading a head. The draft
    vocabulary is a sorted random subset of the target's that always holds ids 0..9."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    rest = torch.randperm(config.vocab_size - 10, generator=generator)[: config.draft_vocab_size - 10] + 10
    chosen = torch.cat((torch.arange(10), rest)).sort().values  # [V'] target ids
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
        elif name not in ("d2t", "t2d"):
            tensors[name] = (torch.randn(shape, generator=generator) / math.sqrt(shape[-1])).to(dtype)
    tensors["d2t"] = chosen - torch.arange(config.draft_vocab_size)  # target id = draft id + d2t[draft id]
    tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, chosen, True)
    if with_embedding:
        tensors["embed_tokens.weight"] = torch.randn((config.vocab_size, config.hidden_size), generator=generator).to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / CONFIG_FILE).write_text(json.dumps(published_config(config), indent=2))


def published_config(config: Eagle3Config) -> dict:
    """config.json as config.layout's publishers write it."""
    layer = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
             "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
             "num_hidden_layers": 1, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
             "rope_scaling": config.rope_scaling, "vocab_size": config.vocab_size, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if config.layout == "eagle":
        return {**layer, "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size}
    layer["architectures"] = ["LlamaForCausalLM"]
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
            "draft_vocab_size": config.draft_vocab_size, "norm_before_residual": config.norm_before_residual,
            "target_hidden_size": config.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "default_proposal_method": "greedy", "verifier": {"name_or_path": "", "architectures": []}}}


def config_record(config: Eagle3Config) -> dict:
    """The config as plain JSON (start-up timings' cache key, logs)."""
    return {**asdict(config), "feature_layers": list(config.feature_layers)}
