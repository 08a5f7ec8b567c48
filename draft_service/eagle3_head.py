"""EAGLE-3 draft heads in the layouts the field publishes: load, check and run them.

Why: EAGLE-3 heads are trained and published for many targets (Li et al., "EAGLE-3", 2025); reading
them as they are published lets the feature drafter (draft_service/feature_drafter.py) serve them
without retraining. Like specd's own head (draft_service/feature_head.py) a head reads the pair
(token x_t, target feature f_{t-1}) and scores x_{t+1}; unlike it, the feature is three target layers
side by side, and what is fed back while drafting is the layer's output before the final norm.

The math, per position (H = hidden_size, F = feature_size = 3 target layers side by side):

    g_t  = fc(f_{t-1})                           [H]   only for the target's features (width F); while
                                                       drafting g_t is the head's own previous output o_{t-1}
    a_t  = [input_layernorm(embed(x_t)) ; hidden_norm(g_t)]        [2H]   q/k/v read this
    h_t  = r_t + o_proj(attention(a_t | a_<t))   [H]   r_t = g_t (r_t = hidden_norm(g_t) if norm_before_residual)
    o_t  = h_t + mlp(post_attention_layernorm(h_t))                [H]   fed back to the next drafting step
    logits_t = lm_head(norm(o_t))                [V']  draft index i is target token i + d2t[i]

Sources checked (public code, read, not copied):
- SafeAILab/EAGLE eagle/model/cnets.py (the EAGLE-3 `Model`, `LlamaDecoderLayeremb`), eagle/model/ea_model.py
  (reads config.json, then pytorch_model.bin or model.safetensors; load_state_dict(strict=False)),
  eagle/model/modeling_llama_kv.py (collects the target's hidden states *before* decoder layers 2, L // 2
  and L - 3: transformers' hidden_states[2], [L // 2], [L - 3], concatenated low..high),
  eagle/traineagle3/cnets.py + config.json (d2t[i] = used_tokens[i] - i over the sorted used ids,
  t2d[j] = j is used; fc bias=False; the training config.json).
- vllm-project/speculators src/speculators/models/eagle3.py (older single-file model), models/eagle3/
  {config,core,model_definitions}.py, models/utils.py (resolve_target_layer_ids: [2, L // 2, L - 3]),
  convert/eagle/eagle3_converter.py (midlayer.* → layers.0.*), convert/dflash/converter.py (speculators'
  layer ids are hidden_states indices; z-lab's are one less), model.py DraftVocabMixin (no d2t/t2d when the
  draft vocabulary is the target's), config.py (config.json = PretrainedConfig dict + pydantic fields;
  transformer_layer_config is serialized with to_diff_dict, so keys equal to LlamaConfig's defaults are absent).
- vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (qkv input 2H, hidden_norm, norm_before_residual,
  fc [3 * target_hidden_size → H] bias=False, returns the pre-norm output for drafting, logits scattered to
  arange + d2t, t2d skipped), models/llama.py (aux state appended before layer idx: hidden_states[idx]),
  transformers_utils/configs/speculators/algos.py (norm_before_residual defaults to True when absent),
  v1/worker/gpu_model_runner.py (_get_eagle3_aux_layers_from_config: top-level ids, then eagle_config's, as is).
- sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (same layer; fc bias from config `bias`;
  the pre-norm output is the aux state fed back), models/llama.py set_eagle3_layers_to_capture (default
  [2, L // 2, L - 3] as is; ids named by the draft's config + 1) and its PR #25454 (ids in the wild come in
  both numberings; + 1 only when the first id is 1); sgl-project/SpecForge (trains with [1, L // 2 - 1, L - 4]
  captured from layer outputs: the same hidden_states [2, L // 2, L - 3]).

Layouts (config.json + weights):
- "eagle" (the EAGLE authors', e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; SpecForge's): a flat Llama config
  with architectures ["LlamaForCausalLMEagle3"] (vLLM's name "Eagle3LlamaForCausalLM" also seen), num_hidden_layers
  1, vocab_size (the target's), draft_vocab_size, optional target_hidden_size, optional
  eagle_config.eagle_aux_hidden_state_layer_ids. Tensors: fc.weight [H, 3 H_t], midlayer.self_attn.{q,k,v}_proj.weight
  [n_heads·d | n_kv·d, 2H], midlayer.self_attn.o_proj.weight [H, n_heads·d], midlayer.mlp.{gate,up}_proj.weight [I, H],
  midlayer.mlp.down_proj.weight [H, I], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H],
  norm.weight [H], lm_head.weight [V', H], d2t int64 [V'], t2d bool [V], sometimes embed_tokens.weight [V, H].
- "speculators" (neuralmagic / RedHatAI): speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
  transformer_layer_config (a Llama config, defaults omitted), draft_vocab_size, norm_before_residual,
  target_hidden_size (null: H), eagle_aux_hidden_state_layer_ids (null: the default), speculators_config
  (algorithm, proposal_methods, verifier). Tensors as above with layers.0. for midlayer.; d2t/t2d absent when
  V' = V. Later speculators options (norm_before_fc, fc_norm, norm_output, more than one layer) are refused.

Target layers (`feature_layers`, what the verify returns side by side: common.proto feature_layers) are
transformers hidden_states indices (0 = the embeddings, l = the output of decoder layer l), 1..L. Default
(2, L // 2, L - 3), so a config that names none needs the target's depth L; speculators' ids and a top-level
id list are such indices already; an eagle_config id list is read like sglang does: + 1 when its first id is 1
(SpecForge's layer-output numbering), as is otherwise. write_eagle3_checkpoint's eagle layout names no layers
(the authors' configs do not). Positions only enter through RoPE, so any common offset of the caller's
positions gives the same outputs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from draft_service.feature_head import DecoderShape, HeadCache, RMSNorm, rotary, unrolled_mask

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
# transformers' LlamaConfig defaults: a speculators transformer_layer_config (to_diff_dict) omits keys equal to them
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False}
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # later speculators options this module does not run


@dataclass
class Eagle3Config(DecoderShape):
    """A head's shapes (hidden_size .. rope_theta: DecoderShape's), the target layers it reads and the
    layout its checkpoint is in."""

    rope_scaling: Optional[dict]
    vocab_size: int  # the target's
    draft_vocab_size: int  # V': the ids lm_head scores
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # transformers hidden_states indices of the target layers fc reads, low..high
    layout: str  # "eagle" or "speculators"
    norm_before_residual: bool = False

    @property
    def feature_size(self) -> int:
        """Width of the target feature rows the head reads: the named layers side by side."""
        return len(self.feature_layers) * self.target_hidden_size


# --- config.json ----------------------------------------------------------------------------------------
def default_feature_layers(target_num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers for a target of L decoder layers: hidden_states (2, L // 2, L - 3)."""
    return tuple(sorted((2, target_num_layers // 2, target_num_layers - 3)))


def detect_layout(raw: dict, path: Path) -> str:
    """'speculators' or 'eagle' from a config.json's keys; ValueError naming the file and keys otherwise."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ValueError(f"{path}: speculators_model_type is {kind!r}, not 'eagle3': not an EAGLE-3 head")
        return "speculators"
    if set(raw.get("architectures") or ()) & set(EAGLE_ARCHITECTURES) or "draft_vocab_size" in raw:
        return "eagle"
    raise ValueError(
        f"{path}: neither an EAGLE authors' config (architectures naming one of {list(EAGLE_ARCHITECTURES)}, or a "
        f"draft_vocab_size key) nor a speculators one (speculators_model_type 'eagle3'); found architectures "
        f"{raw.get('architectures')!r}: not an EAGLE-3 head in a known layout"
    )


def is_eagle3_checkpoint(folder: Path) -> bool:
    """Whether folder holds a config.json in one of the EAGLE-3 layouts this module reads."""
    path = Path(folder) / CONFIG_FILE
    try:
        detect_layout(json.loads(path.read_text()), path)
    except (OSError, ValueError):
        return False
    return True


def read_eagle3_config(folder: Path, target_num_layers: int) -> Eagle3Config:
    """The head's config from folder/config.json in either layout; target_num_layers (the target's decoder
    layers) gives the default layers when the config names none and bounds the ones it names."""
    return _read_config(Path(folder), target_num_layers)


def _read_config(folder: Path, target_num_layers: Optional[int]) -> Eagle3Config:
    path = folder / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{folder}: no {CONFIG_FILE}: not an EAGLE-3 checkpoint")
    raw = json.loads(path.read_text())
    layout = detect_layout(raw, path)
    if layout == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{path}: transformer_layer_config must be an object (the draft layer's Llama config)")
        ids, convert = raw.get("eagle_aux_hidden_state_layer_ids"), False
        norm_before_residual = bool(raw.get("norm_before_residual", True))  # vLLM's default when absent
        where = f"{path} transformer_layer_config"
    else:
        layer, where = raw, str(path)
        ids, convert = raw.get("eagle_aux_hidden_state_layer_ids"), False
        if not ids and isinstance(raw.get("eagle_config"), dict):
            ids, convert = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids"), True
        norm_before_residual = bool(raw.get("norm_before_residual", False))
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ValueError(f"{path}: {flag} is set; this module runs EAGLE-3 heads without it")
    settings = {**LLAMA_DEFAULTS, **{key: value for key, value in layer.items() if value is not None}}
    _check_layer_settings(settings, where)
    hidden, heads = int(settings["hidden_size"]), int(settings["num_attention_heads"])
    vocab = int(settings["vocab_size"])
    theta, scaling = _rope_settings(settings, where)
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(settings.get("num_key_value_heads") or heads),
        head_dim=int(settings.get("head_dim") or hidden // heads), intermediate_size=int(settings["intermediate_size"]),
        rms_norm_eps=float(settings["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling, vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        feature_layers=_feature_layers(ids, convert, target_num_layers, path), layout=layout,
        norm_before_residual=norm_before_residual,
    )


def _check_layer_settings(settings: dict, where: str) -> None:
    """Refuse a draft layer other than the one Llama layer this module runs, naming the key."""
    expected = {"num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, value in expected.items():
        if settings.get(key) != value:
            raise ValueError(f"{where}: {key} is {settings.get(key)!r}; EAGLE-3 heads here have {key} {value!r}")
    if settings.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type is {settings['model_type']!r}; only Llama draft layers are supported")


def _rope_settings(settings: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from transformers v4 keys (rope_theta, rope_scaling) or v5's rope_parameters."""
    parameters = dict(settings.get("rope_parameters") or settings.get("rope_scaling") or {})
    theta = float(parameters.pop("rope_theta", settings["rope_theta"]))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{where}: rope scaling type {kind!r} is not supported (only 'llama3' or none)")
    parameters.setdefault("original_max_position_embeddings", settings["max_position_embeddings"])
    return theta, {"rope_type": "llama3", **{key: value for key, value in parameters.items() if key not in ("type", "rope_type")}}


def _feature_layers(ids: Optional[list], convert: bool, target_num_layers: Optional[int], path: Path) -> tuple[int, ...]:
    """hidden_states indices from a config's id list (None: the default), checked against the target's depth.
    convert: the list is an eagle_config's, which sglang reads as layer outputs (+ 1) when its first id is 1."""
    if not ids:
        if target_num_layers is None:
            raise ValueError(f"{path} names no target layers (eagle_aux_hidden_state_layer_ids): the default depends "
                             "on the target's depth; pass target_num_layers")
        return default_feature_layers(target_num_layers)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of integers, found {ids!r}")
    layers = tuple(sorted(i + 1 if convert and ids[0] == 1 else i for i in ids))
    top = target_num_layers if target_num_layers is not None else math.inf
    if layers[0] < 1 or layers[-1] > top:  # 0 would be the embeddings, which no EAGLE-3 head reads
        raise ValueError(f"{path}: the head reads target layers {list(layers)}; this target has 1..{target_num_layers} "
                         f"(eagle_aux_hidden_state_layer_ids {ids})")
    return layers


# --- rope ---------------------------------------------------------------------------------------------------
def inverse_frequencies(config: Eagle3Config, device: Optional[torch.device] = None) -> torch.Tensor:
    """The RoPE inverse frequencies [d/2] (float32): Llama's, rescaled like transformers' 'llama3' rope init
    (long wavelengths divided by factor, short ones kept, the band between interpolated)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        kind = scaling.get("rope_type", scaling.get("type"))
        raise ValueError(f"rope scaling type {kind!r} is not supported (only 'llama3' or none)")
    try:
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        context = float(scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing.args[0]!r}") from None
    wavelength = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


# --- the head -----------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Grouped-query attention whose projections read [embedding ; hidden] (2H) instead of H."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(2 * h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)


class MLP(nn.Module):
    """Llama's SwiGLU MLP."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer; submodule names follow the published ones (midlayer.* / layers.0.*)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self._inv_freq: dict[str, torch.Tensor] = {}  # per device, float32 whatever the weights' dtype

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: Optional[HeadCache] = None) -> torch.Tensor:
        """embedded [B, T, H] (x_t's embedding), hidden [B, T, H] (fc(f_{t-1}) or the fed-back output),
        positions [T] → the layer's output [B, T, H]. With a cache (B = 1) attends to the cached positions
        too and appends this call's keys/values to it."""
        residual, q, k, v = self._inputs(embedded, hidden, positions)
        length, past = q.shape[2], 0
        if cache is not None:
            past = cache.length
            if past:
                k = torch.cat((cache.keys[None].to(k.dtype), k), dim=2)  # [1, nkv, past + T, d]
                v = torch.cat((cache.values[None].to(v.dtype), v), dim=2)
            cache.keys, cache.values = k[0], v[0]
        # new position i sees every cached position and the new positions ≤ i
        mask = None if past == 0 else torch.ones(length, past + length, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return self._output(residual, q, k, v, mask, causal=past == 0 and length > 1)

    def forward_after(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      earlier: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One pass of the training-time test (Eagle3Head.unrolled): like forward, over keys/values of
        `earlier` passes ([B, nkv, T, d] each) followed by this pass's, as mask [T, (passes + 1) T] allows
        (feature_head.unrolled_mask). Returns the output [B, T, H] and this pass's keys and values."""
        residual, q, k, v = self._inputs(embedded, hidden, positions)
        keys = torch.cat([kv[0] for kv in earlier] + [k], dim=2)
        values = torch.cat([kv[1] for kv in earlier] + [v], dim=2)
        return self._output(residual, q, keys, values, mask, causal=False), (k, v)

    def _inputs(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual [B, T, H] and the queries, keys and values of [input_layernorm(e) ; hidden_norm(g)]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        joint = torch.cat((self.input_layernorm(embedded), normed), dim=-1)  # [B, T, 2H]
        return (residual, *self._project(joint, positions))

    def _output(self, residual: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """Attention of q [B, nh, T, d] over k, v [B, nkv, S, d], then o_proj, the residual and the MLP → [B, T, H]."""
        c = self.config
        batch, _, length, _ = q.shape
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, nh, S, d]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # [B, nh, T, d]
        h = residual + self.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, length, c.num_heads * c.head_dim))
        return h + self.mlp(self.post_attention_layernorm(h))

    def _project(self, joint: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, nh, T, d], keys and values [B, nkv, T, d] of joint [B, T, 2H] at positions [T]."""
        c, attention = self.config, self.self_attn
        batch, length, _ = joint.shape
        q = attention.q_proj(joint).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2)
        k = attention.k_proj(joint).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = attention.v_proj(joint).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return self._rotate(q, positions), self._rotate(k, positions), v

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of x [B, n, T, d] at the config's frequencies (scaled or not), computed once per device."""
        key = str(x.device)
        if key not in self._inv_freq:
            self._inv_freq[key] = inverse_frequencies(self.config, x.device)
        return rotary(x, positions, self._inv_freq[key])


class Eagle3Head(nn.Module):
    """fc + the EAGLE-3 layer + norm + lm_head over the draft vocabulary; x_t's embedding is the target's
    (or the checkpoint's own)."""

    def __init__(self, config: Eagle3Config, embedding: torch.Tensor, vocab_ids: Optional[torch.Tensor] = None,
                 fc_bias: bool = False):
        """embedding [V, H]; vocab_ids [V'] the target id of each draft index (arange + d2t; default: the first
        V' ids); fc_bias: the checkpoint's fc has a bias (sglang reads a config key `bias`)."""
        super().__init__()
        if config.layout not in LAYER_PREFIX:
            raise ValueError(f"unknown EAGLE-3 layout {config.layout!r}; use one of {list(LAYER_PREFIX)}")
        if config.feature_size == config.hidden_size:
            raise ValueError(f"feature_size {config.feature_size} equals hidden_size: target features and the head's "
                             "own outputs could not be told apart")
        inverse_frequencies(config)  # refuses an unsupported rope scaling now, not at the first call
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=fc_bias)
        self.layer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)  # [V, H]
        ids = torch.arange(config.draft_vocab_size) if vocab_ids is None else vocab_ids.long()
        self.register_buffer("vocab_ids", ids, persistent=False)  # [V']

    def forward(self, token_ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor,
                cache: Optional[HeadCache] = None) -> torch.Tensor:
        """token_ids [B, T] (x_t), prev [B, T, F] where F is config.feature_size (the target's fused
        features f_{t-1}, passed through fc) or config.hidden_size (the head's own previous output, fed back
        while drafting, not through fc), positions [T] → the layer's output [B, T, H] before the final norm
        (what is fed back). With a cache (B = 1) attends to cached positions too and appends to it, like
        draft_service/feature_head.py DecoderLayer.forward."""
        dtype = self.fc.weight.dtype
        embedded = self.embedding[token_ids].to(dtype)  # [B, T, H]
        width = prev.shape[-1]
        if width == self.config.feature_size:
            hidden = self.fc(prev.to(dtype))  # [B, T, H]
        elif width == self.config.hidden_size:
            hidden = prev.to(dtype)
        else:
            raise ValueError(f"prev has width {width}; expected the target's features ({self.config.feature_size}) "
                             f"or the head's own output ({self.config.hidden_size})")
        return self.layer(embedded, hidden, positions, cache)

    def unrolled(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test: what drafting steps 1..passes would output at every position.

        token_ids [B, T] (x_t), features [B, T, F] (the target's fused f_{t-1}), positions [T]. Pass 1 is
        forward() over the target's features. Pass j reads (x_t, pass j-1's output at t - 1), as drafting
        step j feeds back the head's own output, and attends like drafting step j at position t: to pass
        1's keys up to t - j + 1 (the committed context), to pass m's key at t - j + m and to itself
        (feature_head.unrolled_mask). Returns [o of pass 1, ..., o of pass `passes`], each [B, T, H] before
        the final norm (logits() reads them); row t of pass j is valid for t ≥ j - 1."""
        dtype = self.fc.weight.dtype
        embedded = self.embedding[token_ids].to(dtype)  # [B, T, H]
        hidden = self.fc(features.to(dtype))  # [B, T, H]
        earlier, outputs = [], []
        for step in range(passes):
            out, kv = self.layer.forward_after(embedded, hidden, positions, earlier,
                                               unrolled_mask(token_ids.shape[1], step, embedded.device))
            earlier.append(kv)
            outputs.append(out)
            hidden = torch.cat((hidden[:, :1], out[:, :-1]), dim=1)  # o_{t-1} fed at t; row 0 is never read again
        return outputs

    def logits(self, estimate: torch.Tensor) -> torch.Tensor:
        """estimate [..., H] (a forward output) → float scores [..., V'] over the draft vocabulary
        (index vocab_ids for target ids)."""
        return self.lm_head(self.norm(estimate.to(self.lm_head.weight.dtype))).float()


# --- checkpoint files ------------------------------------------------------------------------------------------
def expected_shapes(config: Eagle3Config, prefix: Optional[str] = None) -> dict[str, tuple[int, ...]]:
    """The tensors every checkpoint of this config holds, name → shape, in its layout's names."""
    p = LAYER_PREFIX[config.layout] if prefix is None else prefix
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    return {
        "fc.weight": (h, config.feature_size),
        f"{p}self_attn.q_proj.weight": (config.num_heads * d, 2 * h),
        f"{p}self_attn.k_proj.weight": (config.num_kv_heads * d, 2 * h),
        f"{p}self_attn.v_proj.weight": (config.num_kv_heads * d, 2 * h),
        f"{p}self_attn.o_proj.weight": (h, config.num_heads * d),
        f"{p}mlp.gate_proj.weight": (i, h),
        f"{p}mlp.up_proj.weight": (i, h),
        f"{p}mlp.down_proj.weight": (h, i),
        f"{p}input_layernorm.weight": (h,),
        f"{p}hidden_norm.weight": (h,),
        f"{p}post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }


def optional_tensors(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may hold: its own embedding, the vocabulary maps, a bias on fc."""
    return {"embed_tokens.weight": (config.vocab_size, config.hidden_size), "d2t": (config.draft_vocab_size,),
            "t2d": (config.vocab_size,), "fc.bias": (config.hidden_size,)}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of folder's model.safetensors, its *.safetensors shards, or pytorch_model.bin (on the CPU)."""
    from safetensors.torch import load_file

    shards = [folder / SAFETENSORS_FILE] if (folder / SAFETENSORS_FILE).exists() else sorted(folder.glob("*.safetensors"))
    if not shards:
        if not (folder / TORCH_FILE).exists():
            raise ValueError(f"{folder}: no weights: expected {SAFETENSORS_FILE}, *.safetensors shards or {TORCH_FILE}")
        state = torch.load(folder / TORCH_FILE, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{folder / TORCH_FILE}: expected a dict of tensors, found {type(state).__name__}")
        return state
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            if name in state:
                raise ValueError(f"{folder}: tensor {name} appears in more than one shard ({shard.name} again)")
            state[name] = tensor
    return state


def check_tensors(state: dict[str, torch.Tensor], config: Eagle3Config, folder: Path) -> str:
    """Every tensor's name and shape against the config; returns the layer prefix the file uses (either
    layout's, as vLLM maps midlayer. to layers.0.). ValueError naming the tensor, expected and found shape."""
    prefix = LAYER_PREFIX[config.layout]
    other = next(p for layout, p in LAYER_PREFIX.items() if layout != config.layout)
    if not any(name.startswith(prefix) for name in state) and any(name.startswith(other) for name in state):
        prefix = other
    required, optional = expected_shapes(config, prefix), optional_tensors(config)
    missing = [name for name in required if name not in state]
    if missing:
        also = f" (also {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ValueError(f"{folder}: tensor {missing[0]} is missing{also} for an EAGLE-3 head in the {config.layout} layout")
    unexpected = [name for name in state if name not in required and name not in optional]
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensor(s) {', '.join(unexpected)}: not part of an EAGLE-3 head this module runs")
    for name, tensor in state.items():
        shape = required.get(name, optional.get(name))
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{folder}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)} for this config")
    return prefix


def draft_vocab_ids(state: dict[str, torch.Tensor], config: Eagle3Config, folder: Path) -> torch.Tensor:
    """The target id of each draft index [V']: arange + d2t (d2t may be absent only when V' = V),
    checked against the vocabulary and against t2d when present."""
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"{folder}: tensor d2t is missing: the draft vocabulary ({config.draft_vocab_size}) is "
                             f"smaller than the target's ({config.vocab_size})")
        return torch.arange(config.vocab_size)
    d2t = state["d2t"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{folder}: tensor d2t should hold integers, found {d2t.dtype}")
    ids = torch.arange(config.draft_vocab_size) + d2t.long()  # [V']
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise ValueError(f"{folder}: d2t maps draft ids to target ids outside 0..{config.vocab_size - 1}")
    if "t2d" in state:
        t2d = state["t2d"].bool()  # [V]
        if not bool(t2d[ids].all()) or int(t2d.sum()) != config.draft_vocab_size:
            raise ValueError(f"{folder}: t2d disagrees with d2t: it should mark exactly the {config.draft_vocab_size} "
                             "target ids d2t maps to")
    return ids


def head_embedding(state: dict[str, torch.Tensor], config: Eagle3Config, embedding: Optional[torch.Tensor],
                   folder: Path) -> torch.Tensor:
    """x_t's embedding [V, H]: the checkpoint's own when it has one, else the target's. A given target
    embedding must match the head's vocabulary, and its width (H, or target_hidden_size when unused)."""
    own = state.get("embed_tokens.weight")
    width = config.hidden_size if own is None else config.target_hidden_size
    if (embedding is None and own is None) or (embedding is not None and tuple(embedding.shape) != (config.vocab_size, width)):
        found = "none" if embedding is None else list(embedding.shape)
        raise ValueError(f"{folder}: the EAGLE-3 head needs an embedding [{config.vocab_size}, {width}] (the target's, "
                         f"unless the checkpoint holds embed_tokens.weight); {found} given: is it for this target?")
    return own if own is not None else embedding


def load_eagle3(folder: Path, embedding: Optional[torch.Tensor], target_num_layers: Optional[int] = None,
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An EAGLE-3 head from folder in either layout, in eval mode.

    embedding: the target's input embedding [V, H_target] used when the checkpoint has no embed_tokens.weight.
    Reads model.safetensors (also sharded *.safetensors) or pytorch_model.bin (torch.load(weights_only=True)).
    Checks every tensor's name and shape against the config and raises ValueError naming the tensor, expected and
    found shape; checks the embedding's vocab/width. target_num_layers (the target's decoder layers) is needed only
    when the config names no target layers (yuhuili's heads; the default depends on the target's depth)."""
    folder = Path(folder)
    config = _read_config(folder, target_num_layers)
    state = read_tensors(folder)
    prefix = check_tensors(state, config, folder)
    embedded = head_embedding(state, config, embedding, folder)
    head = Eagle3Head(config, embedded, draft_vocab_ids(state, config, folder), fc_bias="fc.bias" in state)
    weights = {("layer." + name[len(prefix):] if name.startswith(prefix) else name): tensor.float()
               for name, tensor in state.items() if name not in ("d2t", "t2d", "embed_tokens.weight")}
    head.load_state_dict(weights, strict=True)
    return head.to(dtype).eval()


# --- writing checkpoints ----------------------------------------------------------------------------------
def save_eagle3(head: Eagle3Head, folder: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """A trained head in its config's published layout (specd's own heads: the EAGLE authors' layout), its
    draft vocabulary as d2t/t2d; the target's embedding is not written (the loader takes the target's).
    Returns the bytes written."""
    layer_prefix = LAYER_PREFIX[head.config.layout]
    state = {(layer_prefix + name[len("layer."):] if name.startswith("layer.") else name): tensor.detach().cpu().to(dtype)
             for name, tensor in head.state_dict().items()}
    ids = head.vocab_ids.cpu()
    write_checkpoint(folder, head.config, state, None if bool((ids == torch.arange(len(ids))).all()) else ids, dtype)
    return sum(path.stat().st_size for path in Path(folder).iterdir())


def write_checkpoint(folder: Path, config: Eagle3Config, state: dict[str, torch.Tensor], draft_ids: Optional[torch.Tensor],
                     dtype: torch.dtype) -> None:
    """config.json as published and model.safetensors: `state` in the layout's names, plus d2t (int64) and t2d
    (bool) from the sorted target ids draft_ids [V'] (None: the whole vocabulary, written as identity maps in
    the eagle layout, omitted in speculators')."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = dict(state)
    if draft_ids is None and config.layout == "eagle":
        draft_ids = torch.arange(config.draft_vocab_size)
    if draft_ids is not None:
        state["d2t"] = draft_ids.long() - torch.arange(config.draft_vocab_size)
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        state["t2d"][draft_ids.long()] = True
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(folder / SAFETENSORS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(published_config(config, dtype), indent=2))


def write_eagle3_checkpoint(folder: Path, config: Eagle3Config, seed: int = 0, with_embedding: bool = False,
                            dtype: torch.dtype = torch.bfloat16) -> None:
    """A random checkpoint in exactly config.layout's published layout (config.json keys as published, tensor names,
    shapes, dtypes; d2t int64, t2d bool) — what tests write instead of downloading a head. The draft vocabulary is
    a sorted random subset of the target's that holds its lowest ids (the first half), so tests can predict some.
    The eagle layout names no target layers (the EAGLE authors' configs do not): it reads the target's default ones."""
    generator = torch.Generator().manual_seed(seed)
    state = {name: _random_tensor(shape, generator).to(dtype) for name, shape in expected_shapes(config).items()}
    if with_embedding:
        state["embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size, generator=generator).to(dtype)
    draft_ids = _draft_vocabulary(config, generator) if config.draft_vocab_size != config.vocab_size else None
    write_checkpoint(folder, config, state, draft_ids, dtype)


def _random_tensor(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights near 1 (but not 1, so using the wrong norm shows), matrices scaled by 1/sqrt(fan-in)."""
    if len(shape) == 1:
        return 1.0 + 0.2 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / math.sqrt(shape[1])


def _draft_vocabulary(config: Eagle3Config, generator: torch.Generator) -> torch.Tensor:
    """A sorted subset [V'] of the target ids: 0..V'/2 - 1, then random ones from the rest."""
    low = config.draft_vocab_size // 2
    rest = low + torch.randperm(config.vocab_size - low, generator=generator)[: config.draft_vocab_size - low]
    return torch.cat((torch.arange(low), rest.sort().values))


def _layer_json(config: Eagle3Config, dtype: torch.dtype) -> dict:
    """The draft layer's Llama config keys, as both layouts write them."""
    raw = {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
           "intermediate_size": config.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
           "max_position_embeddings": 2048, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
           "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}
    if config.rope_scaling:
        raw["rope_scaling"] = dict(config.rope_scaling)
    return raw


def _eagle_json(config: Eagle3Config, dtype: torch.dtype) -> dict:
    """The EAGLE authors' config.json. Like theirs it names no target layers: the head reads the default
    (2, L // 2, L - 3), whatever config.feature_layers says (name others with the speculators layout)."""
    raw = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_json(config, dtype), "use_cache": True,
           "draft_vocab_size": config.draft_vocab_size}
    if config.target_hidden_size != config.hidden_size:
        raw["target_hidden_size"] = config.target_hidden_size
    if config.norm_before_residual:
        raw["norm_before_residual"] = True  # vLLM reads it from the draft's config
    return raw


def published_config(config: Eagle3Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json as config.layout's publishers write it."""
    return _speculators_json(config, dtype) if config.layout == "speculators" else _eagle_json(config, dtype)


def _speculators_json(config: Eagle3Config, dtype: torch.dtype) -> dict:
    """The speculators config.json: pydantic fields next to the transformers ones."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
        "transformer_layer_config": {**_layer_json(config, dtype), "attention_bias": False, "mlp_bias": False},
        "draft_vocab_size": config.draft_vocab_size, "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": None if config.target_hidden_size == config.hidden_size else config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers), "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
