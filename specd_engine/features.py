"""TargetFeatures on the wire: the target's hidden states as float16 rows (see common.proto)."""

from __future__ import annotations

import numpy as np
import torch

from specd.v1 import common_pb2
from specd_common.errors import InvalidArgument


def encode_features(rows: torch.Tensor, start_position: int) -> common_pb2.TargetFeatures:
    """rows [n, H] → TargetFeatures starting at `start_position` (float16, little-endian)."""
    data = rows.detach().to(torch.float16).cpu().numpy().astype("<f2").tobytes()
    return common_pb2.TargetFeatures(start_position=start_position, hidden_size=rows.shape[-1], data=data)


def decode_features(message: common_pb2.TargetFeatures, hidden_size: int) -> torch.Tensor:
    """TargetFeatures → float32 rows [n, H]; INVALID_ARGUMENT when the shape does not fit this model."""
    if not message.data:
        return torch.zeros((0, hidden_size))
    if message.hidden_size != hidden_size:
        raise InvalidArgument(f"target_features.hidden_size is {message.hidden_size}; this drafter reads rows of {hidden_size}")
    if message.start_position < 0 or len(message.data) % (2 * hidden_size):
        raise InvalidArgument(f"target_features must start at a position >= 0 and hold whole rows of {hidden_size} float16 values")
    rows = np.frombuffer(message.data, dtype="<f2").reshape(-1, hidden_size)  # [n, H]
    return torch.from_numpy(rows.astype(np.float32))
