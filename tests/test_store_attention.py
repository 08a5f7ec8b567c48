"""specd's attention over the KV store in place (specd_engine/store_attention.py, native/attention.c)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specd_engine import store_attention

LAYER = SimpleNamespace(heads=9, kv_heads=3, head_dim=64, scaling=64 ** -0.5)  # the default target's shape
why_not = store_attention.unavailable(LAYER, torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(bool(why_not), reason=f"store attention: {why_not}")


STORES = (torch.float32, torch.bfloat16)  # a bfloat16 store's scores come from the tile unit where the CPU has AMX


def store(slots: int = 6, capacity: int = 1100, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (slots, LAYER.kv_heads, capacity, LAYER.head_dim)
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int, columns: list[int]) -> torch.Tensor:
    """One row's attention in float64 over the given columns of its slot: [Hq, D]."""
    group = LAYER.heads // LAYER.kv_heads
    k, v = keys[slot][:, columns].double(), values[slot][:, columns].double()  # [Hkv, n, D]
    query = q.double().view(LAYER.kv_heads, group, LAYER.head_dim)[None]
    return F.scaled_dot_product_attention(query, k[None], v[None], scale=LAYER.scaling)[0].reshape(LAYER.heads, LAYER.head_dim).float()


def test_rows_attend_their_own_slot_s_keys_within_float32_rounding():
    keys, values = store()
    generator = torch.Generator().manual_seed(1)
    slots = torch.tensor([0, 3, 3, 5, 1], dtype=torch.long)
    seen = torch.tensor([1, 17, 18, 700, 1100], dtype=torch.int32)
    q = torch.randn((5, LAYER.heads, LAYER.head_dim), generator=generator)
    out = store_attention.attend(LAYER, keys, values, q, slots, seen, None)
    for r in range(5):
        expected = reference(q[r], keys, values, int(slots[r]), list(range(int(seen[r]))))
        assert (out[r] - expected).abs().max() < 2e-6, r


@pytest.mark.parametrize("dtype", STORES)
def test_a_tree_node_reads_its_compacted_columns(dtype):
    keys, values = store(dtype=dtype)
    q = torch.randn((2, LAYER.heads, LAYER.head_dim), generator=torch.Generator().manual_seed(2))
    path = list(range(40)) + [42, 45]  # committed columns, then the node's ancestors and itself
    columns = torch.arange(64).repeat(2, 1)
    columns[1, : len(path)] = torch.tensor(path)
    out = store_attention.attend(LAYER, keys, values, q, torch.tensor([2, 2]), torch.tensor([41, len(path)], dtype=torch.int32), columns)
    assert (out[1] - reference(q[1], keys, values, 2, path)).abs().max() < 2e-6
    assert (out[0] - reference(q[0], keys, values, 2, list(range(41)))).abs().max() < 2e-6


@pytest.mark.parametrize("dtype", STORES)
def test_a_row_s_bits_are_its_own_alone_beside_any_rows_and_on_any_thread_count(dtype):
    keys, values = store(slots=32, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    rows = 33
    q = torch.randn((rows, LAYER.heads, LAYER.head_dim), generator=generator)
    slots = torch.randint(0, 32, (rows,), generator=generator)
    seen = torch.randint(1, 1100, (rows,), generator=generator).to(torch.int32)
    together = store_attention.attend(LAYER, keys, values, q, slots, seen, None)
    for r in (0, 7, 32):
        assert torch.equal(store_attention.attend(LAYER, keys, values, q[r : r + 1], slots[r : r + 1], seen[r : r + 1], None)[0], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(store_attention.attend(LAYER, keys, values, q, slots, seen, None), together)
    finally:
        torch.set_num_threads(threads)


def test_a_row_that_would_read_outside_the_store_is_refused():
    """Past its slot's columns, a slot the store lacks, a tree column past the end: an error, nothing read."""
    keys, values = store(slots=2, capacity=64)
    q = torch.zeros((1, LAYER.heads, LAYER.head_dim))
    seen = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    for slot, count, columns in ((0, 65, None), (2, 8, None), (-1, 8, None), (1, 2, torch.tensor([[0, 64]]))):
        with pytest.raises(ValueError, match="refused"):
            store_attention.attend(LAYER, keys, values, q, torch.tensor([slot]), seen(count), columns)
    assert store_attention.attend(LAYER, keys, values, q, torch.tensor([1]), seen(2), torch.tensor([[0, 63]])).isfinite().all()
    assert "query heads" in store_attention.unavailable(SimpleNamespace(heads=9, kv_heads=3, head_dim=40, scaling=1.0),
                                                        torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", STORES)
def test_rows_of_one_slot_read_its_keys_together_and_keep_the_bits_each_has_alone(dtype):
    """A chain's rows, a prompt chunk's and lone decode rows in one call (the kernel reads a run of one
    slot's rows together): every row's bits are the ones it has in a call of its own, on any thread count."""
    keys, values = store(slots=6, dtype=dtype)
    generator = torch.Generator().manual_seed(4)
    slots = torch.tensor([4] * 4 + [1] + [2] * 16 + [5] * 3 + [4], dtype=torch.long)
    seen = torch.tensor([300, 301, 302, 303, 9] + list(range(17, 33)) + [1, 2, 1099, 64], dtype=torch.int32)
    q = torch.randn((len(slots), LAYER.heads, LAYER.head_dim), generator=generator)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            together = store_attention.attend(LAYER, keys, values, q, slots, seen, None)
            for r in range(len(slots)):
                alone = store_attention.attend(LAYER, keys, values, q[r : r + 1], slots[r : r + 1], seen[r : r + 1], None)[0]
                assert torch.equal(alone, together[r]), (count, r)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 3, 5, 20, 23):
        assert (together[r] - reference(q[r], keys, values, int(slots[r]), list(range(int(seen[r]))))).abs().max() < 2e-6


@pytest.mark.parametrize("dtype", STORES)
def test_a_shape_other_than_the_default_target_s_attends_within_float32_rounding(dtype):
    """4 query heads a key head of D = 128: the kernel's general path, not the one shaped for the default target."""
    layer = SimpleNamespace(heads=8, kv_heads=2, head_dim=128, scaling=128 ** -0.5)
    generator = torch.Generator().manual_seed(5)
    keys, values = (torch.randn((3, 2, 600, 128), generator=generator).to(dtype) for _ in range(2))
    slots, seen = torch.tensor([1, 1, 1, 0]), torch.tensor([500, 501, 502, 37], dtype=torch.int32)
    q = torch.randn((4, 8, 128), generator=generator)
    out = store_attention.attend(layer, keys, values, q, slots, seen, None)
    for r in range(4):
        k, v = keys[slots[r], :, : seen[r]].double(), values[slots[r], :, : seen[r]].double()
        expected = F.scaled_dot_product_attention(q[r].double().view(2, 4, 128)[None], k[None], v[None], scale=layer.scaling)
        assert (out[r] - expected[0].reshape(8, 128).float()).abs().max() < 2e-6, r


@pytest.mark.parametrize("kernel", store_attention.KERNELS)
def test_a_bfloat16_store_reads_as_the_float32_store_of_its_values(kernel):
    """Keys and values kept in bfloat16 are read exactly: with the 16-lane code a row's bits are those of
    the float32 kernel over the same rounded values; with the tile unit's scores (AMX) they are within
    float32 rounding of them (its sums run in another order), and a row's bits are its own either way."""
    keys, values = store()
    generator = torch.Generator().manual_seed(6)
    slots = torch.tensor([0, 3, 3, 3, 5], dtype=torch.long)
    seen = torch.tensor([1, 700, 701, 702, 1100], dtype=torch.int32)
    q = torch.randn((5, LAYER.heads, LAYER.head_dim), generator=generator)
    kept_keys, kept_values = keys.bfloat16(), values.bfloat16()
    chosen = store_attention._choice
    try:
        store_attention.use(kernel)
        out = store_attention.attend(LAYER, kept_keys, kept_values, q, slots, seen, None)
        float32 = store_attention.attend(LAYER, kept_keys.float(), kept_values.float(), q, slots, seen, None)
        if store_attention.tiles():
            assert (out - float32).abs().max() < 2e-6
            for r in range(5):
                assert (out[r] - reference(q[r], kept_keys.float(), kept_values.float(), int(slots[r]), list(range(int(seen[r]))))).abs().max() < 2e-6
        else:
            assert torch.equal(out, float32)
        assert torch.equal(out[4:], store_attention.attend(LAYER, kept_keys, kept_values, q[4:], slots[4:], seen[4:], None))
    finally:
        store_attention.use(chosen)
    with pytest.raises(ValueError, match="keys and values of one of"):
        store_attention.attend(LAYER, kept_keys, values, q, slots, seen, None)
    with pytest.raises(ValueError, match="must be one of"):
        store_attention.use("tiles please")


@pytest.mark.parametrize("dtype", STORES)
def test_the_kernel_writes_a_pass_s_keys_as_the_store_s_own_cast_does_before_any_row_reads(dtype):
    """With `new`, the rows' keys and values go into their columns first, with the bits `.to(dtype)` gives
    them (NaN, infinities and denormals included), and a chain's rows read the keys written beside them:
    the same outputs as writing with torch and attending after."""
    keys, values = store(slots=4, capacity=256, dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    slots = torch.tensor([1, 1, 1, 3], dtype=torch.long)
    writes = torch.tensor([100, 101, 102, 0], dtype=torch.long)
    seen = (writes + 1).to(torch.int32)
    q = torch.randn((4, LAYER.heads, LAYER.head_dim), generator=generator)
    k, v = (torch.randn((4, LAYER.kv_heads, LAYER.head_dim), generator=generator) for _ in range(2))
    k[3, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -3e-39, 3.3895e38])  # row 3 alone reads them
    v[0, 2, :3] = torch.tensor([1e-41, 1.00390625, 1.01171875])  # a denormal and two ties to even
    by_torch_keys, by_torch_values = keys.clone(), values.clone()
    by_torch_keys[slots, :, writes] = k.to(dtype)
    by_torch_values[slots, :, writes] = v.to(dtype)
    expected = store_attention.attend(LAYER, by_torch_keys, by_torch_values, q, slots, seen, None)
    out = store_attention.attend(LAYER, keys, values, q, slots, seen, None, (k, v, writes))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(keys.view(bits), by_torch_keys.view(bits)) and torch.equal(values.view(bits), by_torch_values.view(bits))
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))  # row 3's special values too
    assert out[:3].isfinite().all()
    with pytest.raises(ValueError, match="refused"):
        store_attention.attend(LAYER, keys, values, q[:1], slots[:1], seen[:1], None, (k[:1], v[:1], torch.tensor([256])))


needs_dots = pytest.mark.skipif(not store_attention.prompt_dots(), reason="prompt rows take dot products only on AVX-512 BF16 without AMX")


def bf16_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int, seen: int, layer=LAYER) -> torch.Tensor:
    """A prompt row's attention as dots_run computes it, in float64: the query and the softmax weights rounded to
    bfloat16 (the store's keys and values already are) → [Hq, D]."""
    group = layer.heads // layer.kv_heads
    k, v = keys[slot][:, :seen].double(), values[slot][:, :seen].double()  # [Hkv, n, D]
    query = q.to(torch.bfloat16).double().view(layer.kv_heads, group, layer.head_dim)  # [Hkv, group, D]
    scores = query @ k.transpose(1, 2) * layer.scaling  # [Hkv, group, n]
    unnormalized = torch.exp(scores - scores.amax(-1, keepdim=True))  # p_j = exp(s_j - m)
    out = unnormalized.to(torch.bfloat16).double() @ v / unnormalized.sum(-1, keepdim=True)
    return out.reshape(layer.heads, layer.head_dim).float()


@needs_dots
@pytest.mark.parametrize("layer", [LAYER, SimpleNamespace(heads=8, kv_heads=2, head_dim=128, scaling=128 ** -0.5)])
def test_prompt_rows_take_bfloat16_dot_products_within_their_rounding(layer):
    """dots_run's math: bfloat16 queries and weights, float32 sums, over a row's own keys (an odd count too)."""
    generator = torch.Generator().manual_seed(7)
    shape = (3, layer.kv_heads, 700, layer.head_dim)
    keys, values = (torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([1] * 19 + [2], dtype=torch.long)
    seen = torch.tensor(list(range(481, 500)) + [7], dtype=torch.int32)
    q = torch.randn((20, layer.heads, layer.head_dim), generator=generator)
    prompt = torch.ones(20, dtype=torch.bool)
    out = store_attention.attend(layer, keys, values, q, slots, seen, None, prompt=prompt)
    exact = store_attention.attend(layer, keys, values, q, slots, seen, None)
    assert not torch.equal(out, exact)  # the prompt rows did take the other kernel
    for r in range(20):
        assert (out[r] - bf16_reference(q[r], keys, values, int(slots[r]), int(seen[r]), layer)).abs().max() < 2e-3, r


@needs_dots
def test_a_prompt_row_s_bits_are_its_own_in_any_chunk_beside_any_rows_and_on_any_thread_count():
    """A prompt of 40 rows attended in chunks of 1, 4, 16 and 40, beside a decode row of the same slot and
    another session's prompt rows: every prompt row has the bits it has alone; the decode row keeps the 16-lane
    code's bits (prompt rows take dot products, generated rows do not)."""
    keys, values = store(slots=4, capacity=200, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(8)
    q = torch.randn((40, LAYER.heads, LAYER.head_dim), generator=generator)
    seen = torch.arange(1, 41, dtype=torch.int32)
    slot = torch.full((40,), 3, dtype=torch.long)
    alone = torch.stack([store_attention.attend(LAYER, keys, values, q[r : r + 1], slot[:1], seen[r : r + 1], None,
                                                prompt=torch.ones(1, dtype=torch.bool))[0] for r in range(40)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for chunk in (1, 4, 16, 40):
                for start in range(0, 40, chunk):
                    rows = slice(start, start + chunk)
                    n = len(range(40)[rows])
                    extra_q = torch.randn((6, LAYER.heads, LAYER.head_dim), generator=generator)
                    together = store_attention.attend(
                        LAYER, keys, values, torch.cat([extra_q[:3], q[rows], extra_q[3:]]),
                        torch.cat([torch.tensor([0, 0, 3]), slot[rows], torch.tensor([1, 1, 1])]),
                        torch.cat([torch.tensor([5, 6, 150], dtype=torch.int32), seen[rows], torch.tensor([9, 10, 11], dtype=torch.int32)]),
                        None, prompt=torch.tensor([True, True, False] + [True] * n + [True] * 3))
                    assert torch.equal(together[3 : 3 + n], alone[rows]), (count, chunk, start)
                    decode = store_attention.attend(LAYER, keys, values, extra_q[2:3], torch.tensor([3]), torch.tensor([150], dtype=torch.int32), None)
                    assert torch.equal(together[2], decode[0])
    finally:
        torch.set_num_threads(threads)
