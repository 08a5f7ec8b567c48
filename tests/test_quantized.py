"""`--weights int4` (specd_engine/quantized.py): 4-bit decoder products and an 8-bit LM head on the CPU.

What the exactness of speculation rests on here: a position's logits must not depend on how many
positions its pass holds, or a verify over k + 1 positions would judge drafts by another model
than its own one-position decoding."""

from __future__ import annotations

import pytest
import torch

from specd_engine import int4_tiles, quantized
from tests.conftest import start_cluster
from tests.test_services import FIXED, PROMPTS, generate


def q4_1_blocks(rows: int, columns: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [rows, columns] made as a Q4_1 GGUF stores it: per 32 inputs, d · q + m with d and m in
    float16 and q in 0..15, each block holding both 0 and 15 (its min and max). Returns (weight, q)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, columns // quantized.GROUP, quantized.GROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, columns // quantized.GROUP, 1, generator=generator) * 0.01 + 1e-3).half().float()
    m = (torch.randn(rows, columns // quantized.GROUP, 1, generator=generator) * 0.05).half().float()
    return (d * q + m).reshape(rows, columns), q.reshape(rows, columns).int()


def test_a_q4_1_weight_keeps_its_own_levels():
    """Requantizing an already 4-bit weight finds its blocks' own q, scale and zero."""
    weight, q = q4_1_blocks(32, 64)
    found, scale, zero = quantized.quantize_groups(weight)
    assert torch.equal(found, q)
    rebuilt = ((found.reshape(32, 2, 32) - 8) * scale[..., None] + zero[..., None]).reshape(32, 64)
    assert torch.allclose(rebuilt, weight, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer", [quantized.Int4Linear, quantized.Int8Linear])
def test_a_quantized_product_scores_each_row_alone(layer):
    """Each row's output is the same whatever rows share its call, and near the float product."""
    weight, _ = q4_1_blocks(48, 96, seed=1)
    product = layer(weight)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    together = product(x)  # [9, 48]
    for row in range(9):
        assert torch.equal(product(x[row : row + 1]), together[row : row + 1])
    assert torch.equal(product(x[2:5]), together[2:5])
    reference = x @ weight.T
    assert (together - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize("shape", [(48, 96), (192, 576), (576, 1536)])
def test_a_packed_weight_unpacks_to_what_the_kernel_multiplies_by(shape):
    """Int4Linear.dequantized reads the packed nibbles back (their order read from the packing itself) and
    must give the very weights the int4 kernel multiplies by: its product by the identity, bit for bit."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
    linear = quantized.Int4Linear(weight, tiles=False)
    eye = torch.eye(linear.in_features, dtype=torch.bfloat16)
    by_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, linear.packed, quantized.GROUP, linear.scales_zeros)
    assert torch.equal(linear.dequantized(), by_kernel.float().t())
    assert torch.equal(quantized.unpack_levels(linear.packed, *shape).to(torch.int32), quantized.quantize_groups(weight)[0])


needs_tiles = pytest.mark.skipif(bool(int4_tiles.unavailable()), reason=f"int4 tiles: {int4_tiles.unavailable()}")
ISAS_HERE = int4_tiles.runnable_instruction_sets() or ["none here"]  # every instruction set the tiles run on here
PROMPT_TILES_HERE = [quantized.PROMPT_TILES] if int4_tiles.prompt_kernel() else []  # the prompt tiles, where they run (AMX)


@pytest.fixture(params=ISAS_HERE)
def tile_isa(request):
    """Each instruction set this machine runs the tile kernel on (AMX and AVX-512 BF16 on an AMX Xeon), in turn."""
    if request.param == "none here":
        pytest.skip(f"int4 tiles: {int4_tiles.unavailable()}")
    with int4_tiles.instruction_set_as(request.param):
        yield request.param


def assert_each_row_its_own(product, x: torch.Tensor, together: torch.Tensor, rows, counts) -> None:
    """product(rows of x) gives each of `rows` the bits it has in `together` (product(x)) in every run of
    `counts` consecutive rows that holds it (the run ending at it), and the first 37 rows on one thread too."""
    for row in rows:
        for count in counts:
            start = max(0, row - count + 1)
            if start + count <= x.shape[0]:
                assert torch.equal(product(x[start : start + count])[row - start], together[row]), (row, count)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x[:37]), together[:37])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(48, 96), (192, 576), (576, 1536), (16, 32)])
def test_the_tile_layout_unpacks_to_its_levels_and_scales(shape):
    """int4_tiles.pack's layout reads back to the very levels, scales and zeros (no kernel needed)."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    q, scale, zero = quantized.quantize_groups(weight)
    nibbles, tile_scale, tile_zero = int4_tiles.pack(q, scale, zero)
    assert nibbles.numel() == shape[0] * shape[1] // 2
    assert torch.equal(int4_tiles.unpack(nibbles, *shape).to(torch.int32), q)
    assert torch.equal(tile_scale.permute(0, 2, 1).reshape(scale.shape), scale.to(torch.bfloat16))
    assert torch.equal(tile_zero.permute(0, 2, 1).reshape(zero.shape), zero.to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (576, 1536)])
def test_the_tile_kernel_gives_a_row_its_own_bits_at_any_count_and_thread_count(shape, tile_isa):
    """specd's tile product (AMX or AVX-512 BF16): near the float product of the weights it holds, and each row's bits the same
    alone, in a block of 16, past a block (a zero-padded last block) and on one thread."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.05
    tiles, reference_kernel = quantized.Int4Linear(weight, tiles=True), quantized.Int4Linear(weight, tiles=False)
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(6))
    together = tiles.rows(x)  # [70, out] float32, rounded to bfloat16
    as_bfloat16 = tiles.rows(x.to(torch.bfloat16))  # the kernel's own rounding of float32 rows is torch's cast's
    assert together.dtype == torch.float32 and as_bfloat16.dtype == torch.bfloat16 and torch.equal(together, as_bfloat16.float())
    reference = x.to(torch.bfloat16).float() @ tiles.dequantized().T
    scale = reference.abs().max()
    assert (together.float() - reference).abs().max() < 0.01 * scale
    assert (reference_kernel.rows(x).float() - together.float()).abs().max() < 0.01 * scale
    assert_each_row_its_own(tiles.rows, x, together, rows=(0, 5, 69, 16, 17), counts=(1, 5, 16, 37, 70))


@pytest.mark.skipif(not PROMPT_TILES_HERE, reason="the prompt tiles run on AMX's tile unit, which this CPU lacks")
@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (576, 1536), (16, 32)])
def test_the_prompt_tiles_give_a_row_its_own_bits_near_the_dequantized_weight_s_product(shape):
    """int4_tiles.prompt_product: within bfloat16 rounding of the rows times Int4Linear.dequantized(), float32 rows
    as their bfloat16 cast, and each row's bits the same alone, in a block, past blocks of 16 and 32 rows (a
    zero-padded last block, a lone last row block or output block) and on one thread."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 0.05
    linear = quantized.Int4Linear(weight, tiles=True)
    linear.use_prompt_tiles(True)
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(8))
    together = linear.prompt_product(x)  # [70, out] float32, rounded to bfloat16
    assert together.dtype == torch.float32 and torch.equal(together, linear.prompt_product(x.to(torch.bfloat16)).float())
    assert torch.equal(together, together.to(torch.bfloat16).float())
    reference = x.to(torch.bfloat16).float() @ linear.dequantized().T
    assert (together - reference).abs().max() < 0.01 * reference.abs().max()
    assert_each_row_its_own(linear.prompt_product, x, together, rows=(0, 5, 15, 16, 31, 32, 47, 69), counts=(1, 5, 16, 33, 48, 70))
    assert linear.separate_prompt_rows and not quantized.Int4Linear(weight, tiles=True).separate_prompt_rows


def test_an_8_bit_weight_packs_from_a_transposed_view_on_either_kernel():
    """Int8Linear of a transposed view (the Medusa heads' vocabulary columns are one): PyTorch's int8 kernel
    needs contiguous levels (a verify with heads failed to start on a CPU without the tiles), and both
    kernels give the rows of the weight as if it had been contiguous."""
    columns = torch.randn(576, 96, generator=torch.Generator().manual_seed(11))  # [H, V']: the weight is its transpose
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(12))
    kernels = [False] + ([True] if not int4_tiles.unavailable() else [])
    for tiles in kernels:
        assert torch.equal(quantized.Int8Linear(columns.T, tiles=tiles)(x), quantized.Int8Linear(columns.T.contiguous(), tiles=tiles)(x))


def test_the_8_bit_tile_kernel_matches_pytorch_s_and_gives_a_row_its_own_bits(tile_isa):
    """int4_tiles.product8 (the LM head): within bfloat16 rounding of PyTorch's int8 kernel over the same
    levels, and each row's bits the same alone, in a block of 16 and past it."""
    weight = torch.randn(96, 576, generator=torch.Generator().manual_seed(7))
    tiles, reference_kernel = quantized.Int8Linear(weight, tiles=True), quantized.Int8Linear(weight, tiles=False)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(8))
    together = tiles(x)  # [37, 96]
    reference = reference_kernel(x)
    assert (together - reference).abs().max() <= 0.01 * reference.abs().max()
    for row, count in ((0, 1), (3, 5), (15, 16), (20, 37), (36, 37)):
        start = row - count + 1 if row >= count - 1 else 0
        assert torch.equal(tiles(x[start : start + count])[row - start], together[row])


@pytest.mark.skipif(not {"amx", "avx512-bf16"} <= set(ISAS_HERE), reason="AMX and AVX-512 BF16 are not both here: nothing to compare")
def test_the_two_instruction_sets_agree_within_bfloat16_rounding():
    """On a CPU with both (an AMX Xeon), the AVX-512 BF16 products are the AMX ones but for how each sums a
    group's pairs: outputs within a bfloat16 step or two, int4 and 8-bit alike."""
    weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(9)) * 0.05
    int4, int8 = quantized.Int4Linear(weight, tiles=True), quantized.Int8Linear(weight, tiles=True)
    x = torch.randn(21, 576, generator=torch.Generator().manual_seed(10))
    outputs = {}
    for isa in int4_tiles.runnable_instruction_sets():
        with int4_tiles.instruction_set_as(isa):
            outputs[isa] = (int4.rows(x), int8(x))
    (amx4, amx8), (vector4, vector8) = outputs["amx"], outputs["avx512-bf16"]
    assert (amx4 - vector4).abs().max() <= 2 ** -6 * amx4.abs().max() and (amx8 - vector8).abs().max() <= 2 ** -6 * amx8.abs().max()


@pytest.mark.skipif("avx512-vnni" not in ISAS_HERE, reason="the 8-bit-input products run on AVX-512 VNNI, which this CPU lacks")
@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (576, 1536)])
def test_the_vnni_products_sum_each_rows_8_bit_groups_exactly(shape):
    """int4_tiles on AVX-512 VNNI: each row's group of 32 inputs as bytes round(x / d), d = max|x| / 127, summed
    with the weight's levels exactly, then scaled by the group's d, scale and zero: the kernel's rows within
    their bfloat16 rounding of that math in float64, for rows of several magnitudes, a zero group among them,
    float32 and bfloat16 rows alike. A nibble read against the wrong input would miss by far more."""
    with int4_tiles.instruction_set_as("avx512-vnni"):
        n, k = shape
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(13)) * 0.05
        linear = quantized.Int4Linear(weight, tiles=True)
        x = torch.randn(19, k, generator=torch.Generator().manual_seed(14)) * torch.logspace(-3, 2, 19)[:, None]
        x[4, 32:64] = 0.0  # a group with nothing in it
        x = x.to(torch.bfloat16).float()  # so that float32 and bfloat16 rows are the same inputs
        got = linear.rows(x)  # [19, n]
        assert torch.equal(got, linear.rows(x.to(torch.bfloat16)).float())
        groups = x.view(-1, k // 32, 32)  # [M, G, 32]
        largest = groups.abs().amax(dim=-1, keepdim=True)  # float32, as the kernel's
        step = largest / 127.0
        # tensor by tensor: a correctly rounded quotient, as the kernel's (a scalar over a tensor is 127 · (1 / x) in torch)
        inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, torch.zeros_like(largest))
        levels = (groups * inverse).round().to(torch.float64)  # to nearest even, as the kernel's conversion
        q = int4_tiles.unpack(linear.nibbles, n, k).to(torch.float64).view(n, k // 32, 32)  # [N, G, 32]
        scale = linear.tile_scale.permute(0, 2, 1).reshape(n, k // 32).double()  # [N, G]
        zero = linear.tile_zero.permute(0, 2, 1).reshape(n, k // 32).double()
        sums = torch.einsum("mgk,ngk->mng", levels, q)  # [M, N, G], exact
        expected = (step.double().squeeze(-1)[:, None, :] * (scale * sums + (zero - 8 * scale) * levels.sum(-1)[:, None, :])).sum(-1)
        assert (got.double() - expected).abs().max() <= 2 ** -8 * expected.abs().max()
        assert ((got.double() - expected).abs() <= 2 ** -8 * expected.abs() + 1e-6 * expected.abs().max()).all()


def test_prompt_rows_are_a_view_where_consecutive_and_score_alike_either_way():
    """lean_forward.row_index: consecutive rows index as a slice (no gather), others as a tensor; a product
    over prompt rows and round rows gives each row the same bits whichever index the pass holds."""
    from specd_engine import lean_forward

    assert lean_forward.row_index([3, 4, 5]) == slice(3, 6)
    assert torch.equal(lean_forward.row_index([0, 2, 3]), torch.tensor([0, 2, 3]))
    weight, _ = q4_1_blocks(48, 96, seed=3)
    linear = quantized.Int4Linear(weight)
    linear.use_dense(torch.bfloat16)
    h = torch.randn(7, 96, generator=torch.Generator().manual_seed(4))  # rounds' rows 0-2, prompt rows 3-6
    as_views = lean_forward.product(linear, h, lean_forward.PromptRows(slice(3, 7), slice(0, 3)))
    gathered = lean_forward.product(linear, h, lean_forward.PromptRows(torch.arange(3, 7), torch.arange(3)))
    assert torch.equal(as_views, gathered)
    assert torch.equal(as_views[3:], linear.prompt_product(h[3:])) and torch.equal(as_views[:3], linear(h[:3]))
    assert torch.equal(lean_forward.product(linear, h, None).float(), linear(h))  # the int4 kernel's bfloat16, promoted exactly


def test_a_gguf_s_weight_bits_are_read_once_and_remembered_beside_its_conversion(tmp_path, monkeypatch):
    """Parsing the default target's GGUF for its weight types took 4.6 s of an 18 s verify start (a
    supervised restart's mark is 15 s): the answer is kept under the conversion's key and read back."""
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.models import stored_weight_bits

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    assert stored_weight_bits(DEFAULT_TARGET) == 4
    remembered = list((tmp_path / "converted").glob("*.weight-bits"))
    assert len(remembered) == 1 and remembered[0].read_text() == "4"
    remembered[0].write_text("8")  # what a later start reads instead of the file
    assert stored_weight_bits(DEFAULT_TARGET) == 8


def test_a_shape_the_kernel_cannot_pack_is_refused_with_the_reason():
    assert "out % 16" in quantized.unsupported(torch.zeros(20, 64))
    with pytest.raises(ValueError, match="in % 32"):
        quantized.Int8Linear(torch.zeros(16, 40))


def test_an_int4_target_scores_a_position_alike_in_a_pass_of_any_size(tiny):
    """CausalLM with int4 weights: six positions scored in one pass give the bits they get one at a time
    (every row one query over its keys padded to whole blocks: lean_forward._sdpa_padded), and a tree's nodes the bits of decoding along their path."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert isinstance(lm.lean.layers[0].qkv, quantized.Int4Linear) and isinstance(lm.lean.lm_head, quantized.Int8Linear)
    prompt, extra = [(7 * i) % 50 + 3 for i in range(60)], [11, 2, 30, 8, 41, 17]
    together_session, alone_session = lm.new_session(prompt), lm.new_session(prompt)
    lm.forward(together_session)
    lm.forward(alone_session)
    together = lm.forward(together_session, extra)  # [4, V]: the rows of the four new positions
    alone = torch.cat([lm.forward(alone_session, [token])[-1:] for token in extra])
    assert together.shape == alone.shape and torch.equal(together, alone)


@pytest.mark.parametrize("prompt_kernel", [None, "bfloat16"] + PROMPT_TILES_HERE)
def test_an_int4_row_scores_alike_beside_other_sessions_prompt_chunks_and_trees(tiny, prompt_kernel):
    """One ragged pass holding chains, a tree and a prompt chunk of sessions at different lengths (some
    crossing a key block in the pass): each session's logits are the bits it gets decoding alone, with
    prompt rows through the int4 products or a dense weight (quantized.Int4Linear.prompt_product)."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    lm.use_prompt_kernel(prompt_kernel)
    prompts = [[(3 * i + s) % 50 + 3 for i in range(length)] for s, length in enumerate((13, 30, 62, 95))]
    extra = [11, 2, 30, 8, 41]
    alone = []
    for prompt in prompts[:3]:
        session = lm.new_session(prompt)
        lm.forward(session)
        alone.append(torch.cat([lm.forward(session, [token])[-1:] for token in extra]))  # [5, V]
    walk = lm.new_session(prompts[3])
    lm.forward(walk)
    tree_alone = [lm.forward(walk, [token])[-1] for token in (7, 9)]  # along the tree's path 7 -> 9

    sessions = [lm.new_session(prompt) for prompt in prompts[:3]]
    for session in sessions:
        lm.forward(session)
    tree_session, chunked = lm.new_session(prompts[3]), lm.new_session(prompts[1], prefill=False)
    lm.forward(tree_session)
    feeds = [lm.chain_feed(session, extra) for session in sessions]
    feeds += [lm.tree_feed(tree_session, [7, 9, 4], [-1, 0, 0]), lm.prefill_feed(chunked, 20)]
    together = lm.run_feeds(feeds)
    for mine, theirs in zip(together[:3], alone):
        assert torch.equal(mine[-len(extra):], theirs)
    assert torch.equal(together[3][1], tree_alone[0]) and torch.equal(together[3][2], tree_alone[1])
    assert together[4] is None and chunked.cached == 16  # a budget of 20 cut at whole prompt tiles (lean_forward.PROMPT_TILE)


def test_a_machine_whose_attention_rounds_by_batch_gives_each_row_its_own_call(tiny, monkeypatch):
    """The start-up probe (lean_forward.queries_batch_alike): where SDPA rounds a query by the queries
    batched beside it, an int4 verify gives every row its own attention call and stays exact; the
    same skew with batched calls changes a chain's bits, so the probe is what keeps it exact."""
    import torch.nn.functional as F

    from specd_engine import lean_forward
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    real = F.scaled_dot_product_attention

    def skewed(query, *args, **kwargs):  # a batch of rows rounds otherwise than one alone (a prompt tile is one batch entry)
        out = real(query, *args, **kwargs)
        return out + 1e-3 if query.shape[0] > 1 else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", skewed)
    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    assert lm.lean.query_per_call and not lean_forward.queries_batch_alike(lm.lean.layers[0], torch.device("cpu"))
    prompt, extra = [(5 * i) % 50 + 3 for i in range(60)], [11, 2, 30, 8, 41, 17]

    def chain_and_alone() -> tuple[torch.Tensor, torch.Tensor]:
        chain, one_by_one = lm.new_session(prompt), lm.new_session(prompt)
        lm.forward(chain)
        lm.forward(one_by_one)
        return lm.forward(chain, extra), torch.cat([lm.forward(one_by_one, [token])[-1:] for token in extra])

    together, alone = chain_and_alone()
    assert torch.equal(together, alone)
    lm.lean.query_per_call = False
    together, alone = chain_and_alone()
    assert not torch.equal(together, alone)


def test_the_default_target_in_int4_scores_chains_and_trees_as_its_one_position_passes():
    """The real default target (its own copy: packing changes a model in place): a chain of six drafts
    and a tree score each position with the bits that decoding one position at a time gives it. On
    this target, with one attention call over a chain's rows unpadded, they differed by up to 0.5 in the logits."""
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(DEFAULT_TARGET, device="cpu", dtype="float32"), weights="int4")
    prompt = lm.loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    chain, one_by_one = lm.new_session(prompt), lm.new_session(prompt)
    lm.forward(chain)
    lm.forward(one_by_one)
    drafts = [504, 3632, 28, 2216, 216, 314]
    together = lm.forward(chain, drafts)[-len(drafts):]  # [6, V]
    alone = torch.cat([lm.forward(one_by_one, [token])[-1:] for token in drafts])
    assert torch.equal(together, alone)

    tokens, parents = [504, 3632, 1046, 28], [-1, 0, 0, 1]  # two children of the root, a grandchild
    tree_session = lm.new_session(prompt)
    lm.forward(tree_session)
    rows = lm.forward_tree(tree_session, tokens, parents)  # [5, V]: after the committed tokens, then after each node
    for node, path in ((1, [504, 3632]), (2, [504, 1046]), (3, [504, 3632, 28])):
        walk = lm.new_session(prompt)
        lm.forward(walk)
        for token in path:
            last = lm.forward(walk, [token])[-1]
        assert torch.equal(rows[1 + node], last), node


def test_int4_weights_need_the_lean_forward(tiny):
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    with pytest.raises(ValueError, match="lean forward"):
        CausalLM(load_causal_lm(str(tiny.target)), lean=False, weights="int4")


@pytest.mark.parametrize("forward", ["auto", "ragged", "flat"])
def test_greedy_speculation_on_an_int4_verify_equals_its_own_target_only(tiny, forward):
    """Through the services (real gRPC): drafts judged by the int4 verify keep its own greedy output,
    its passes ragged or flat (specd_engine/flat_pass.py; auto: flat where specd's attention kernel runs).
    The first token costs no pass of its own (CausalLM.prescores: the gateway's first round is plain and free)."""
    from specd_engine import flat_pass

    running = start_cluster(tiny.target, "model", tiny.draft_noisy, weights="int4", forward=forward)
    lm = running.verify.servicer.scorer.lm
    flat = forward == "flat" or forward == "auto" and not flat_pass.why_not_by_default(lm)
    assert (lm.store is not None) == flat and lm.prescores
    passes, run = [], lm.passes.run
    lm.passes.run = lambda *args, **kwargs: passes.append(1) or run(*args, **kwargs)
    try:
        stub = running.stub()
        for prompt in PROMPTS:
            del passes[:]
            speculative = generate(stub, text=prompt, max_new_tokens=40, draft_length_policy=FIXED)
            speculative_passes = len(passes)
            del passes[:]
            target_only = generate(stub, text=prompt, max_new_tokens=40, disable_speculation=True)
            assert list(speculative.token_ids) == list(target_only.token_ids), prompt
            assert speculative.stats.draft_tokens > 0 and speculative.stats.target_passes < len(speculative.token_ids)
            # the prefill's pass scored the first token, and the first round ran none
            assert len(passes) == len(target_only.token_ids) and speculative_passes == speculative.stats.target_passes, prompt
    finally:
        running.stop()


def test_auto_weights_are_int4_only_for_a_model_stored_in_4_bits(tiny):
    """--weights auto: the default target's GGUF stores its decoder in Q4_1, so int4 where it serves; a
    float model, or a GGUF of wider types, stays float; a GPU stays float whatever the file."""
    from specd_app.cli import weights_for
    from specd_common.config import DEFAULT_TARGET
    from specd_engine.lm import CausalLM
    from specd_engine.models import gguf_type_bits, load_causal_lm, stored_weight_bits

    assert stored_weight_bits(DEFAULT_TARGET) == 4 and weights_for("auto", DEFAULT_TARGET) == "auto"
    assert stored_weight_bits(str(tiny.target)) is None and weights_for("auto", str(tiny.target)) == "float"
    assert [gguf_type_bits(name) for name in ("Q4_1", "IQ4_XS", "Q5_K", "Q8_0", "BF16", "F32")] == [4, 4, 5, 8, 16, 32]
    assert weights_for("float", DEFAULT_TARGET) == "float" and weights_for("int4", str(tiny.target)) == "int4"
    assert CausalLM(load_causal_lm(str(tiny.target)), weights="auto").weights == "int4"  # the CPU, the lean forward
    assert CausalLM(load_causal_lm(str(tiny.target)), lean=False, weights="auto").weights == "float"


@pytest.mark.parametrize("prompt_kernel", [None, "bfloat16", "float32"] + PROMPT_TILES_HERE)
def test_an_int4_prompt_scores_alike_in_chunks_of_any_size(tiny, prompt_kernel):
    """A busy pass's budget (4), chunks of 16 and 40 and an idle pass's (512) prefill an int4 prompt, and
    score its last token (the first round's row 0), to the same bits: chunks are cut at whole prompt tiles, each tile one attention call over its keys padded to
    whole blocks (lean_forward.prompt_tiles), and a dense prompt product takes blocks of one size
    (quantized.PROMPT_BLOCK), so the answer does not depend on the load the prompt arrived into. A chunk
    that would start inside a tile is refused."""
    from specd_engine import lean_forward
    from specd_engine.lm import CausalLM
    from specd_engine.sessions import Feed
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    lm.use_prompt_kernel(prompt_kernel)
    if prompt_kernel and not quantized.prompt_rows_alike(lm.lean.layers[0].qkv):  # the start-up probe would refuse it
        assert quantized.choose_prompt_kernel(lm.lean.layers, 1, lambda name, runs, repeats: {
            (1, "int4"): 9.0, (1, "bfloat16"): 1.0, (1, "float32"): 1.0}) is None
        return
    prompt = [(5 * i) % 40 + 3 for i in range(150)]
    scored = []
    for budget, chunk in ((4, 16), (16, 16), (40, 32), (512, 150)):  # the last token too (CausalLM.prescores)
        session = lm.new_session(prompt, prefill=False)
        chunks = []
        while lm.unprefilled(session):
            feed = lm.prefill_feed(session, budget)
            chunks.append(len(feed.tokens))
            lm.run_feeds([feed])
        assert max(chunks) == chunk and all(size % lean_forward.PROMPT_TILE == 0 for size in chunks[:-1]), budget
        scored.append(lm.forward(session, [7, 9]))
    assert all(torch.equal(scored[0], other) for other in scored[1:])
    session = lm.new_session(prompt, prefill=False)
    lm.run_feeds([Feed(session, session.tokens[:21], logits=0)])  # a chunk cut inside a tile, past prefill_feed
    with pytest.raises(ValueError, match="tile boundaries"):
        lm.run_feeds([Feed(session, session.tokens[21:40], logits=0)])


@pytest.mark.parametrize("prompt_kernel", [None, "bfloat16"] + PROMPT_TILES_HERE)
def test_an_int4_prefill_scores_the_prompts_last_token_for_the_first_round(tiny, prompt_kernel, monkeypatch):
    """CausalLM.prescores: an int4 prefill caches the whole prompt and keeps its last row's scores. The first
    round reads them as its row 0: with no drafts it runs no pass, and a chain or tree scores its drafts
    with the bits of decoding them one at a time. A commit that moves the sequence drops the row, and a
    replica replaying the request (prompt_length) scores the next position with the original's bits."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    lm.use_prompt_kernel(prompt_kernel)
    prompt, extra = [(7 * i) % 50 + 3 for i in range(45)], [11, 2, 30]
    session = lm.new_session(prompt)
    assert lm.prescores and session.cached == len(prompt) and session.scored is not None
    passes, ragged = [], lm.lean.forward_ragged
    monkeypatch.setattr(lm.lean, "forward_ragged", lambda *args, **kwargs: passes.append(1) or ragged(*args, **kwargs))
    first = lm.forward(session)  # [1, V]
    assert not passes and first.shape == (1, lm.vocab_size) and session.scored is None
    one_by_one = torch.cat([first] + [lm.forward(session, [token]) for token in extra])  # nothing pending: each its own row
    chain = lm.forward(lm.new_session(prompt), extra)  # [4, V]
    assert torch.equal(chain, one_by_one)
    node_rows = lm.forward_tree(lm.new_session(prompt), [11, 2, 5], [-1, 0, 0])  # 11 -> 2, and 11 -> 5
    assert torch.equal(node_rows[:3], chain[:3])

    moved = lm.new_session(prompt)
    moved.apply_commit(len(prompt), [])  # the sequence as it is: the row stays
    assert moved.scored is not None and moved.cached == len(prompt)
    moved.apply_commit(len(prompt), [11])
    assert moved.scored is None and moved.cached == len(prompt) and moved.pending() == [11]
    assert torch.equal(lm.forward(moved), chain[1:2])
    replayed = lm.new_session(prompt + [11], prompt_length=len(prompt))
    assert replayed.scored is None and replayed.cached == len(prompt)
    assert torch.equal(lm.forward(replayed), chain[1:2])

    featured = lm.new_session(prompt, keep_features=True)  # the Prefill's features: every prompt position but the last
    assert featured.fed_start == 0 and featured.fed_features.shape[0] == len(prompt) - 1
    lm.forward(featured, extra)  # the first round's: the last prompt position's (the prefill's row) and the drafts'
    assert featured.fed_start == len(prompt) - 1 and featured.fed_features.shape[0] == 1 + len(extra)
    single = lm.new_session(prompt[:1], keep_features=True)
    assert single.scored is not None and single.fed_features.shape[0] == 0
    assert lm.forward(single).shape == (1, lm.vocab_size) and single.fed_start == 0 and single.fed_features.shape[0] == 1


def test_prompt_rows_take_the_dense_weight_and_replayed_tokens_the_int4_one(tiny):
    """With a dense prompt product the prompt scores otherwise than in int4 (the dense path serves it), and a
    session primed with the prompt plus tokens it generated (a replica replaying a request, prompt_length
    = the prompt's) scores the next position with the bits of the session that decoded them; primed as if
    all were prompt (the control), it need not."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    prompt, generated = [(7 * i) % 50 + 3 for i in range(70)], [11, 2, 30, 8, 41, 17, 5, 9]
    int4_only = lm.forward(lm.new_session(prompt))
    lm.use_prompt_kernel("bfloat16")
    assert lm.lean.layers[0].qkv.dense.dtype == torch.bfloat16
    original = lm.new_session(prompt)
    assert not torch.equal(lm.forward(original), int4_only)
    for token in generated[:-1]:
        lm.forward(original, [token])
    following = lm.forward(original, generated[-1:])[-1]  # after the last generated token
    replayed = lm.new_session(prompt + generated[:-1], prompt_length=len(prompt))
    assert torch.equal(lm.forward(replayed, generated[-1:])[-1], following)
    all_prompt = lm.new_session(prompt + generated[:-1])
    assert not torch.equal(lm.forward(all_prompt, generated[-1:])[-1], following)
    lm.use_prompt_kernel(None)
    assert lm.lean.layers[0].qkv.dense is None


def test_the_prompt_kernel_is_chosen_by_its_timings(tiny, monkeypatch):
    """choose_prompt_kernel keeps a dense weight only where a block of prompt rows is PROMPT_MARGIN
    cheaper through it than through PyTorch's int4 kernel, the fastest one, and leaves none otherwise; with
    the tile kernel, the prompt tiles only where they run (AMX) and are cheaper (they keep no copy)."""
    from specd_engine.lm import CausalLM
    from specd_engine.models import load_causal_lm

    if not int4_tiles.unavailable():  # the tile products: the prompt tiles where they run and are cheaper, else none
        tiled = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
        tiled_products = quantized.int4_products(tiled.lean.layers)
        if PROMPT_TILES_HERE:
            def tile_timings(int4: float, tiles: float):
                return lambda name, runs, repeats: {key: {"int4": int4, "tiles": tiles}[key[1]] for key in runs()}

            assert quantized.choose_prompt_kernel(tiled.lean.layers, 1, tile_timings(1.0, 1.0)) is None
            assert not any(product.separate_prompt_rows for product in tiled_products)
            assert quantized.choose_prompt_kernel(tiled.lean.layers, 1, tile_timings(2.0, 1.0)) == quantized.PROMPT_TILES
            assert all(product.prompt_tiles and product.dense is None for product in tiled_products)
        else:
            assert quantized.choose_prompt_kernel(tiled.lean.layers, 1, lambda name, runs, repeats: pytest.fail("timed")) is None
    monkeypatch.setattr(int4_tiles, "_choice", "torch")
    lm = CausalLM(load_causal_lm(str(tiny.target)), weights="int4")
    layers, products = lm.lean.layers, quantized.int4_products(lm.lean.layers)
    assert not products[0].tiles

    def timings(int4: float, bf16: float, f32: float):
        return lambda name, runs, repeats: {(1, "int4"): int4, (1, "bfloat16"): bf16, (1, "float32"): f32}

    assert quantized.choose_prompt_kernel(layers, 1, timings(1.0, 0.9, 2.0)) is None  # not PROMPT_MARGIN cheaper
    assert all(product.dense is None for product in products)
    alike = quantized.prompt_rows_alike
    chosen = quantized.choose_prompt_kernel(layers, 1, timings(3.0, 2.0, 1.0))
    assert chosen == "float32" and all(product.dense.dtype == torch.float32 for product in products) or not alike(products[0])
    assert quantized.choose_prompt_kernel(layers, 1, lambda name, runs, repeats: {}) is None  # no time left to measure


def test_a_prepacked_prompt_weight_gives_the_plain_weight_s_bits():
    """quantized.prompt_weight reorders a bfloat16 prompt weight once for oneDNN (where this CPU's oneDNN
    runs bfloat16; else it stays plain): prompt rows get the same bits through it as through the plain
    weight, one row, a whole block and more than one block."""
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    packed = quantized.prompt_weight(weight)
    assert packed.is_mkldnn == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for rows in (1, quantized.PROMPT_BLOCK, quantized.PROMPT_BLOCK + 36):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(quantized.dense_product(x, packed), quantized.dense_product(x, weight)), rows
    assert not quantized.prompt_weight(weight.float()).is_mkldnn  # float32 prompt weights stay as MKL reads them
