"""The draft architecture: a small Llama speaking the target's vocabulary, initialised from the target.

Why this shape: it is an ordinary transformers LlamaForCausalLM, so the existing ModelDrafter serves
it unchanged (`--drafter model --model <dir>`) and the gateway's vocabulary check passes (the
target's tokenizer is saved with it). The width is chosen for cost and size: the tied 49,152-row
embedding/head dominates both, so a narrow model (192) keeps one forward a small fraction of the
target's and the bf16 folder under 25 MB. The embedding starts as the target's embedding projected
onto its top principal directions, so token similarity is known from step one and the tied head
starts as a low-rank copy of the target's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass
class DraftShape:
    """Width and depth of the draft."""

    hidden: int = 192
    layers: int = 2
    heads: int = 3
    kv_heads: int = 1
    intermediate: int = 512


def draft_config(target_config, shape: DraftShape) -> LlamaConfig:
    """A Llama config with the target's vocabulary, special ids, context and RoPE, at the draft's size."""
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=getattr(target_config, "rope_parameters", None),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
        tie_word_embeddings=True,
    )


@torch.no_grad()
def projected_embeddings(target_embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embedding [V, H] projected onto its top `width` right singular vectors → [V, width].

    Not rescaled: the tied head then starts with the target's logit scale in the kept directions.
    """
    weight = target_embeddings.float()  # [V, H]
    width = min(width, weight.shape[1])
    _, _, vh = torch.linalg.svd(weight, full_matrices=False)  # vh [H, H]
    projected = weight @ vh[:width].T  # [V, width]
    return projected


def build_draft(target_model, shape: DraftShape, seed: int = 0) -> LlamaForCausalLM:
    """A fresh draft for this target, embedding initialised from the target's (see module doc)."""
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target_model.config, shape))
    projected = projected_embeddings(target_model.get_input_embeddings().weight, shape.hidden)  # [V, ≤hidden]
    with torch.no_grad():
        draft.get_input_embeddings().weight[:, : projected.shape[1]] = projected
    draft.tie_weights()
    parameters = sum(p.numel() for p in draft.parameters())
    log.info("draft: %d layers, hidden %d, %.1f M parameters", shape.layers, shape.hidden, parameters / 1e6)
    return draft
