"""Per-position rows the verify returns: the target features of one request's committed positions,
kept by the gateway as raw bytes, and the Medusa heads' proposals.

A feature drafter needs, for a committed sequence x_0..x_{L-1}, the target's hidden states at
positions 0..L-2 (common.proto, TargetFeatures). The verify service returns them for the positions
each pass reads; the gateway keeps those of committed positions (rows past the accepted drafts are
cut off) and forwards to the draft what it has not been sent yet. Holding them all lets a draft
replica that failed be re-primed from position 0. Rows stay opaque float16 bytes: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.v1 import common_pb2


class FeatureLog:
    """Rows 0..rows-1 of one request's target features."""

    def __init__(self) -> None:
        self.hidden_size = 0
        self._data = bytearray()

    @property
    def rows(self) -> int:
        return len(self._data) // (2 * self.hidden_size) if self.hidden_size else 0

    def put(self, message: common_pb2.TargetFeatures) -> None:
        """Store rows from message.start_position on, replacing any held from there."""
        if not message.data:
            return
        if self.hidden_size and message.hidden_size != self.hidden_size:
            raise ValueError(f"target features of width {message.hidden_size} after {self.hidden_size}")
        if message.start_position > self.rows:
            raise ValueError(f"target features start at {message.start_position}; only {self.rows} rows are held")
        self.hidden_size = message.hidden_size
        del self._data[message.start_position * 2 * self.hidden_size :]
        self._data += message.data

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (the committed positions)."""
        if self.hidden_size:
            del self._data[rows * 2 * self.hidden_size :]

    def slice(self, start: int, stop: int) -> common_pb2.TargetFeatures:
        """Rows [start, stop) as a message (empty when there are none)."""
        row = 2 * self.hidden_size
        return common_pb2.TargetFeatures(start_position=start, hidden_size=self.hidden_size, data=bytes(self._data[start * row : stop * row]))


def tree_path_rows(message: common_pb2.TargetFeatures, nodes: int, path: tuple[int, ...]) -> common_pb2.TargetFeatures:
    """A tree pass's features (the committed-but-unread rows, then one row per node in node order) cut
    to what was committed: those first rows, then the kept path's nodes, at consecutive positions."""
    if not message.data:
        return message
    row = 2 * message.hidden_size
    first = len(message.data) // row - nodes  # rows before the nodes
    data = message.data[: first * row] + b"".join(message.data[(first + node) * row : (first + node + 1) * row] for node in path)
    return common_pb2.TargetFeatures(start_position=message.start_position, hidden_size=message.hidden_size, data=data)


@dataclass
class HeadProposals:
    """The Medusa heads' proposals after one position: each head's candidates, best first, and their
    confidences in the same layout ([] from a verify that sends none: HeadDrafts.confidences)."""

    tokens: list[list[int]] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens)


def head_drafts_at(message: common_pb2.HeadDrafts, position: int) -> HeadProposals:
    """The Medusa heads' proposals of the row at `position` (the tokens after that position's next
    token); empty when the message has no such row."""
    return head_drafts_in_row(message, position - message.start_position)


def head_drafts_after_tree(message: common_pb2.HeadDrafts, nodes: int, path: tuple[int, ...]) -> HeadProposals:
    """After a sampled tree pass, whose rows are the features' (the committed-but-unread rows, then
    one per node in node order): the proposals of the kept path's last node, or of the root's row
    when no node was kept."""
    width = message.heads * max(message.candidates, 1)
    rows = len(message.token_ids) // width if width > 0 else 0
    return head_drafts_in_row(message, rows - nodes - 1 + (path[-1] + 1 if path else 0))


def head_drafts_in_row(message: common_pb2.HeadDrafts, row: int) -> HeadProposals:
    """head_drafts_at by the row's index in the message."""
    per_head = max(message.candidates, 1)
    width = message.heads * per_head
    if message.heads <= 0 or row < 0 or (row + 1) * width > len(message.token_ids):
        return HeadProposals()
    mine = slice(row * width, (row + 1) * width)

    def by_head(values) -> list[list]:
        return [list(values[mine][head * per_head : (head + 1) * per_head]) for head in range(message.heads)]

    has_confidences = len(message.confidences) == len(message.token_ids)
    return HeadProposals(by_head(message.token_ids), by_head(message.confidences) if has_confidences else [])
