"""Saving a trained head (the feature head, Medusa heads): bf16 safetensors plus a JSON config, a few MB."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch


def save_head_files(state: dict, config, folder: Path, weights_file: str, config_file: str) -> int:
    """Floating-point tensors as bf16 (integer ones, e.g. vocabulary ids, kept), the dataclass
    `config` as JSON; returns bytes written."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {name: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for name, v in state.items()}
    save_file(state, str(folder / weights_file))
    (folder / config_file).write_text(json.dumps(asdict(config), indent=2))
    return sum((folder / name).stat().st_size for name in (weights_file, config_file))
