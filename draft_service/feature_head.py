"""An EAGLE-style feature head: drafts from the target's own last hidden states.

Why: a stand-alone small draft must relearn the language from scratch and agrees with the target
about a quarter of the time at this size (docs/draft-training.md). The target's final hidden
state already holds its next-token decision; a one-layer head that reads it only has to predict how
it moves one token on (Li et al., "EAGLE", 2024).

Alignment (the one thing to get right): the head's input at position t is the pair
(token x_t, target feature f_{t-1}); its output f̂_t estimates the target's feature at t, and
head(f̂_t) scores x_{t+1}. While drafting, f̂ stands in for f one step at a time.

    e_t = embed(x_t)                         [H]   the target's frozen embedding
    h_t = fc([e_t ; f_{t-1}])                [H]
    h_t = decoder_layer(h_t | h_<t)          [H]   one Llama layer, its own KV cache
    f̂_t = norm(h_t)                          [H]
    logits_t = f̂_t · W[vocab_ids]ᵀ           [V']  the target's frozen LM head, restricted to the
                                                   V' most frequent target choices (cost)

Only fc, the layer and the norm are trained and saved (a few MB); the embedding and LM head are the
target's and are read from it at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specd_engine.head_files import save_head_files

WEIGHTS_FILE = "feature_head.safetensors"
CONFIG_FILE = "feature_head.json"


@dataclass
class DecoderShape:
    """One Llama decoder layer's shapes: a head's layer (specd's feature head, an EAGLE-3 head)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float


@dataclass
class FeatureHeadConfig(DecoderShape):
    """Shapes (the target's, so the layer can start from one of its layers) and the target it serves."""

    vocab_size: int  # the target's
    draft_vocab_size: int  # V': ids scored by the head
    target: str = ""  # the target spec it was trained for (embedded name, folder, hub id)
    vocab_digest: str = ""  # the target tokenizer's digest, checked at load

    @property
    def feature_size(self) -> int:
        """Width of the target feature rows the head reads: the final hidden state."""
        return self.hidden_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers those rows come from: () for the final hidden state (common.proto)."""
        return ()

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, target: str = "", vocab_digest: str = "") -> "FeatureHeadConfig":
        rope = getattr(target_config, "rope_parameters", None) or {}
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", heads),
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target=target,
            vocab_digest=vocab_digest,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Llama's default form) of x [..., T, d] at positions [T]."""
    dim = x.shape[-1]
    return rotary(x, positions, 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)))


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., T, d] at positions [T] with inverse frequencies inv_freq [d/2]
    (Llama's, or a scaled set: draft_service/eagle3_head.py)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, d]
    return (x.float() * emb.cos() + rotate_half(x.float()) * emb.sin()).to(x.dtype)


@dataclass
class HeadCache:
    """The head's keys and values for one session: [kv_heads, length, head_dim] each (None when empty)."""

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        if self.keys is not None and length < self.length:
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]


class DecoderLayer(nn.Module):
    """One pre-norm Llama layer (grouped-query attention with RoPE, SwiGLU MLP)."""

    def __init__(self, config: FeatureHeadConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.config = config
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Optional[HeadCache] = None) -> torch.Tensor:
        """x [B, T, H] at positions [T] → [B, T, H]. With a cache (B = 1), attends to the cached
        positions too and appends this call's keys/values to it."""
        length = x.shape[1]
        q, k, v = self._project(x, positions)
        past = 0
        if cache is not None:
            past = cache.length
            if past:
                k = torch.cat((cache.keys[None], k), dim=2)  # [1, nkv, past + T, d]
                v = torch.cat((cache.values[None], v), dim=2)
            cache.keys, cache.values = k[0], v[0]
        # new position i sees every cached position and new positions ≤ i
        mask = None if past == 0 else torch.ones(length, past + length, dtype=torch.bool, device=x.device).tril(diagonal=past)
        return self._attend_and_mix(x, q, k, v, mask, causal=past == 0 and length > 1)

    def forward_after(self, x: torch.Tensor, positions: torch.Tensor, earlier: list[tuple[torch.Tensor, torch.Tensor]],
                      mask: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: x [B, T, H] attends to the keys/values of earlier passes over the same
        positions ([B, nkv, T, d] each) and its own, as `mask` [T, (len(earlier) + 1) T] allows.
        Returns the output [B, T, H] and this pass's keys/values, for the passes after it."""
        q, k, v = self._project(x, positions)
        keys = torch.cat([kv[0] for kv in earlier] + [k], dim=2)  # [B, nkv, (passes) T, d]
        values = torch.cat([kv[1] for kv in earlier] + [v], dim=2)
        return self._attend_and_mix(x, q, keys, values, mask, causal=False), (k, v)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, nh, T, d], keys and values [B, nkv, T, d] of x [B, T, H] at positions [T]."""
        c = self.config
        batch, length, _ = x.shape
        y = self.input_norm(x)
        q = rope(self.q_proj(y).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2), positions, c.rope_theta)
        k = rope(self.k_proj(y).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2), positions, c.rope_theta)
        v = self.v_proj(y).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def _attend_and_mix(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """The residual attention (q [B, nh, T, d] over k, v [B, nkv, S, d], mask [T, S] or causal) and MLP."""
        c = self.config
        batch, length, _ = x.shape
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, nh, S, d]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # [B, nh, T, d]
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, length, c.num_heads * c.head_dim))
        y = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class FeatureHead(nn.Module):
    """fc + one decoder layer + norm (trained), over the target's frozen embedding and LM head rows."""

    def __init__(self, config: FeatureHeadConfig, embedding: torch.Tensor, lm_head: torch.Tensor, vocab_ids: torch.Tensor):
        """embedding [V, H] and lm_head [V, H] are the target's; vocab_ids [V'] the ids the head scores."""
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)  # [V, H]
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # [V']
        self.register_buffer("head_rows", lm_head.detach().float()[vocab_ids.long()], persistent=False)  # [V', H]

    def forward(self, token_ids: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
                cache: Optional[HeadCache] = None) -> torch.Tensor:
        """token_ids [B, T] (x_t), prev_features [B, T, H] (f_{t-1}), positions [T] → f̂ [B, T, H]."""
        return self.norm(self.layer(self._fused(self.embedding[token_ids], prev_features), positions, cache))

    def _fused(self, embedded: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc([e_t ; f_{t-1}]), embedded [B, T, H] and prev_features [B, T, H] → [B, T, H]."""
        return self.fc(torch.cat((embedded, prev_features.to(embedded.dtype)), dim=-1))

    def unrolled(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): what drafting steps 1..passes would estimate at every position.

        token_ids [B, T] (x_t), features [B, T, H] (f_{t-1}, the target's), positions [T]. Pass 1 is
        forward(). Pass j reads (x_t, pass j-1's estimate of f_{t-1}) and attends like drafting step j
        at position t: to pass 1's keys up to t - j + 1 (the committed context, real features), to pass
        m's key at t - j + m for 1 < m < j (the earlier drafted positions) and to itself. Returns
        [f̂ of pass 1, ..., f̂ of pass `passes`], each [B, T, H]; row t of pass j is valid for t ≥ j - 1."""
        embedded = self.embedding[token_ids]  # [B, T, H]
        earlier, estimates, previous = [], [], features
        for step in range(passes):
            h = self._fused(embedded, previous)  # [B, T, H]
            out, kv = self.layer.forward_after(h, positions, earlier, unrolled_mask(token_ids.shape[1], step, h.device))
            earlier.append(kv)
            estimates.append(self.norm(out))
            previous = torch.cat((features[:, :1], estimates[-1][:, :-1]), dim=1)  # f̂_{t-1} at t; row 0 keeps the real one
        return estimates

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] → scores over the head's vocabulary [..., V'] (index with vocab_ids for token ids)."""
        return (features.to(self.head_rows.dtype) @ self.head_rows.T).float()

    def trained_state(self) -> dict:
        """What gets saved: the trained weights and the vocabulary map (not the target's matrices)."""
        return {name: value for name, value in self.state_dict().items()}

    @torch.no_grad()
    def init_from_target_layer(self, target_layer, target_norm) -> None:
        """Start the decoder layer from one of the target's layers (same shapes), the norm from its final norm,
        and fc as [0 ; I] so the untrained head passes the target feature straight through."""
        own = self.layer
        attention, mlp = target_layer.self_attn, target_layer.mlp
        for mine, theirs in (
            (own.q_proj, attention.q_proj), (own.k_proj, attention.k_proj), (own.v_proj, attention.v_proj),
            (own.o_proj, attention.o_proj), (own.gate_proj, mlp.gate_proj), (own.up_proj, mlp.up_proj),
            (own.down_proj, mlp.down_proj),
        ):
            mine.weight.copy_(theirs.weight.float())
        own.input_norm.weight.copy_(target_layer.input_layernorm.weight.float())
        own.post_norm.weight.copy_(target_layer.post_attention_layernorm.weight.float())
        self.norm.weight.copy_(target_norm.weight.float())
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, h:] = torch.eye(h)


def unrolled_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """Which keys pass `step` (0 = the first) of FeatureHead.unrolled may read: [T, (step + 1) T], True = may
    attend. Query t sees pass 0's keys at positions ≤ t - step and pass m's (1 ≤ m ≤ step) at t - step + m."""
    query = torch.arange(length, device=device)[:, None]  # [T, 1]
    key = torch.arange(length, device=device)[None, :]  # [1, T]
    blocks = [key <= query - step] + [key == query - step + m for m in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def target_matrices(target_model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] (the same tensor when tied)."""
    return target_model.get_input_embeddings().weight, target_model.get_output_embeddings().weight


def save_head(head: FeatureHead, folder: Path) -> int:
    """Weights (bf16 safetensors, vocab_ids kept int64) + config; returns bytes written."""
    return save_head_files(head.trained_state(), head.config, folder, WEIGHTS_FILE, CONFIG_FILE)


def is_feature_head(folder: Path) -> bool:
    return (Path(folder) / CONFIG_FILE).exists()


def load_head(folder: Path, target_model, dtype: torch.dtype = torch.float32) -> FeatureHead:
    """A saved head bound to the target's embedding and LM head, in eval mode."""
    embedding, lm_head = target_matrices(target_model)
    return load_head_over(folder, embedding, lm_head, dtype)


def load_head_over(folder: Path, embedding: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype = torch.float32) -> FeatureHead:
    """A saved head over the target's embedding [V, H] and LM head [V, H] alone (the serving path
    reads just these two from the target's files: specd_engine/models.py read_model_matrices)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = FeatureHeadConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    state = load_file(str(folder / WEIGHTS_FILE))
    if embedding.shape[1] != config.hidden_size or embedding.shape[0] != config.vocab_size:
        raise ValueError(
            f"feature head {folder} was trained for a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.hidden_size}; this target has {embedding.shape[0]} and {embedding.shape[1]}"
        )
    head = FeatureHead(config, embedding, lm_head, state["vocab_ids"])
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head.to(dtype).eval()
