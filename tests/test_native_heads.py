"""The Medusa heads' proposals in one native call (verify_service/native_heads.py): what they propose
against the framework's 8-bit proposals, a row's proposals its own, and the start-up choice between them."""

import pytest
import torch

from tests.test_medusa import random_token_heads
from verify_service import native_heads
from verify_service.medusa import INT8



def native_or_skip(heads):
    why = native_heads.unavailable(heads)
    if why:
        pytest.skip(f"no native heads on this machine: {why}")
    return native_heads.NativeHeads(heads)


def test_native_proposals_are_the_frameworks_8_bit_ones_within_rounding(tiny):
    """Same blocks (8 bits, the same kernel), the product in 4 bits with its best columns rescored in
    float32: the chained heads propose what the framework's 8-bit path proposes at nearly every row, with
    confidences near its own. A wrong embedding row, token column or chain order would change most."""
    heads, loaded = random_token_heads(tiny, chained=True)
    native = native_or_skip(heads)
    h = loaded.model.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(64, h, generator=generator) * 3  # [64, H]
    next_tokens = torch.randint(0, heads.config.vocab_size, (64,), generator=generator)
    heads.fix_precision(INT8)
    expected, expected_probs = heads.ranked(features, next_tokens, None, 2)  # [64, K, 2] each
    tokens, probs = native.ranked(features, next_tokens, 2, len(heads.heads))
    assert tokens.shape == expected.shape == probs.shape
    for k in range(len(heads.heads)):
        assert (tokens[:, k, 0] == expected[:, k, 0]).float().mean() >= 0.9, k
    same = tokens[:, 0, 0] == expected[:, 0, 0]
    assert (probs[same, 0, 0] / expected_probs[same, 0, 0]).log().abs().median() < 0.1
    assert bool((probs[:, :, 0] >= probs[:, :, 1]).all()) and bool((probs <= 1.0).all())  # best first, probabilities


def test_a_rows_native_proposals_are_its_own_at_any_row_count_and_depth(tiny):
    """A row's proposals alone and beside 7 other rows are bit-identical, and the first heads of a deeper
    call are a shallower call's (a chained head reads only the heads before it)."""
    heads, loaded = random_token_heads(tiny, chained=True)
    native = native_or_skip(heads)
    features = torch.randn(8, loaded.model.config.hidden_size)
    next_tokens = torch.randint(0, heads.config.vocab_size, (8,))
    tokens, probs = native.ranked(features, next_tokens, 1, 3)
    alone = native.ranked(features[5:6], next_tokens[5:6], 1, 3)
    assert torch.equal(alone[0][0], tokens[5]) and torch.equal(alone[1][0], probs[5])
    shallow = native.ranked(features, next_tokens, 1, 2)
    assert torch.equal(shallow[0], tokens[:, :2]) and torch.equal(shallow[1], probs[:, :2])


def test_unchained_heads_each_start_from_the_rows_features(tiny):
    """Unchained heads read only the row's next token, each from the row's features: natively as by the
    framework (a head that began where the one before ended would propose otherwise)."""
    heads, loaded = random_token_heads(tiny, chained=False)
    native = native_or_skip(heads)
    features = torch.randn(32, loaded.model.config.hidden_size) * 3
    next_tokens = torch.randint(0, heads.config.vocab_size, (32,))
    heads.fix_precision(INT8)
    expected, _ = heads.ranked(features, next_tokens, None, 1)
    tokens, _ = native.ranked(features, next_tokens, 1, len(heads.heads))
    for k in range(len(heads.heads)):
        assert (tokens[:, k, 0] == expected[:, k, 0]).float().mean() >= 0.9, k


def test_ranked_proposes_natively_only_for_the_row_counts_chosen(tiny):
    """MedusaHeads.ranked takes the native call for the row counts tune_product chose it for, the
    framework's elsewhere and before any choice (training and evaluation never take it)."""
    heads, loaded = random_token_heads(tiny, chained=True)
    native = native_or_skip(heads)
    features = torch.randn(4, loaded.model.config.hidden_size)
    next_tokens = torch.randint(0, heads.config.vocab_size, (4,))
    framework = heads.ranked(features, next_tokens, None, 1)
    heads.native, heads.native_rows = native, {1: True, 4: False}
    assert torch.equal(heads.ranked(features[:1], next_tokens[:1], None, 1)[1], native.ranked(features[:1], next_tokens[:1], 1, 3)[1])
    assert torch.equal(heads.ranked(features, next_tokens, None, 1)[1], framework[1])


def test_no_rows_propose_nothing_and_too_many_candidates_are_refused(tiny):
    """An empty batch gets empty proposals; more candidates than the heads' vocabulary holds is a clear error."""
    heads, loaded = random_token_heads(tiny, chained=True)
    native = native_or_skip(heads)
    tokens, probs = native.ranked(torch.empty(0, loaded.model.config.hidden_size), torch.empty(0, dtype=torch.long), 2, 3)
    assert tokens.shape == probs.shape == (0, 3, 2)
    with pytest.raises(ValueError, match="refused"):
        native.ranked(torch.randn(1, loaded.model.config.hidden_size), torch.tensor([1]), heads.config.draft_vocab_size + 1, 1)
