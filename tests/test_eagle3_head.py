"""EAGLE-3 heads in the published layouts (draft_service/eagle3_head.py): what the files hold, what the
loader refuses, and the math against a plain restatement of it written here from the raw tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from draft_service.eagle3_head import (Eagle3Config, inverse_frequencies, is_eagle3_checkpoint, load_eagle3, read_eagle3_config,
                                       write_eagle3_checkpoint)
from draft_service.feature_head import HeadCache

LAYERS = 8  # the target's decoder layers: the default reads hidden_states (2, 8 // 2, 8 - 3)
LAYER_NAMES = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
               "hidden_norm.weight", "post_attention_layernorm.weight"]
PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # a short original context, so every band of the scaling is used


def tiny(layout: str, layers: tuple = (2, 4, 5), **changes) -> Eagle3Config:
    settings = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
                    rope_theta=10000.0, rope_scaling=None, vocab_size=300, draft_vocab_size=100, target_hidden_size=64,
                    feature_layers=layers, layout=layout)
    return Eagle3Config(**{**settings, **changes})


def target_embedding(config: Eagle3Config) -> torch.Tensor:
    return torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(1))  # [V, H]


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# --- an independent restatement of the math ---------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_frequencies(config: Eagle3Config) -> torch.Tensor:
    """transformers' own rope init for the config (its llama3 rule when scaled)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not config.rope_scaling:
        d = config.head_dim
        return 1.0 / config.rope_theta ** (torch.arange(0, d, 2).float() / d)
    llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads, head_dim=config.head_dim,
                        max_position_embeddings=4096, rope_parameters={"rope_theta": config.rope_theta, **config.rope_scaling})
    return ROPE_INIT_FUNCTIONS["llama3"](llama, torch.device("cpu"))[0]


def reference_outputs(state: dict, config: Eagle3Config, embedding: torch.Tensor, tokens: list[int], inputs: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """The layer's outputs [T, H] for all T rows at once, uncached, straight from the checkpoint's tensors:
    inputs [T, H] are the layer's hidden inputs (fc already applied to target rows)."""
    p, w = PREFIX[config.layout], {name: t.float() for name, t in state.items()}
    eps, heads, kv, d = config.rms_norm_eps, config.num_heads, config.num_kv_heads, config.head_dim
    normed = rms(inputs, w[p + "hidden_norm.weight"], eps)
    residual = normed if config.norm_before_residual else inputs
    joint = torch.cat((rms(embedding[tokens].float(), w[p + "input_layernorm.weight"], eps), normed), dim=-1)  # [T, 2H]
    angles = positions.float()[:, None] * reference_frequencies(config)[None]  # [T, d/2]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[:, None], torch.cat((angles.sin(), angles.sin()), -1)[:, None]

    def rotate(x):  # [T, n, d]
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1) * sin

    q = rotate((joint @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d))
    k = rotate((joint @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv, d)).repeat_interleave(heads // kv, dim=1)
    v = (joint @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv, d).repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(len(tokens), len(tokens)).triu(1).bool(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(tokens), heads * d)
    h = residual + attended @ w[p + "self_attn.o_proj.weight"].T
    y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_drafting(state, config, embedding, tokens, rows, positions, fed_back_from: int) -> torch.Tensor:
    """Rows before fed_back_from read the target's rows through fc; later ones the previous output. Each
    output recomputed over the full prefix (no cache)."""
    fc = state["fc.weight"].float()
    inputs = [rows[i] @ fc.T for i in range(fed_back_from)]
    outputs = reference_outputs(state, config, embedding, tokens[:fed_back_from], torch.stack(inputs), positions[:fed_back_from])
    for i in range(fed_back_from, len(tokens)):
        inputs.append(outputs[-1])
        outputs = reference_outputs(state, config, embedding, tokens[: i + 1], torch.stack(inputs), positions[: i + 1])
    return outputs  # [T, H]


# --- the files as published -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_a_checkpoint_holds_its_layouts_names_and_loads_back(tmp_path, layout):
    config = tiny(layout)
    write_eagle3_checkpoint(tmp_path, config, seed=4)
    raw, state = json.loads((tmp_path / "config.json").read_text()), tensors_of(tmp_path)
    assert sorted(state) == sorted([PREFIX[layout] + name for name in LAYER_NAMES]
                                   + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"])
    assert state["fc.weight"].shape == (64, 3 * 64) and state[PREFIX[layout] + "self_attn.q_proj.weight"].shape == (64, 128)
    assert state[PREFIX[layout] + "self_attn.k_proj.weight"].shape == (32, 128) and state["lm_head.weight"].shape == (100, 64)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and state["fc.weight"].dtype == torch.bfloat16
    if layout == "eagle":
        assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 100
        assert "speculators_model_type" not in raw and "eagle_config" not in raw  # the authors' configs name no layers
    else:
        assert raw["speculators_model_type"] == "eagle3" and raw["transformer_layer_config"]["num_hidden_layers"] == 1
        assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and raw["norm_before_residual"] is False
        assert raw["speculators_config"]["algorithm"] == "eagle3"
    assert is_eagle3_checkpoint(tmp_path) and read_eagle3_config(tmp_path, LAYERS) == config
    head = load_eagle3(tmp_path, target_embedding(config), LAYERS)
    ids = torch.arange(100) + state["d2t"]
    assert torch.equal(head.vocab_ids, ids) and bool(state["t2d"][ids].all()) and int(state["t2d"].sum()) == 100
    assert torch.equal(head.vocab_ids[:50], torch.arange(50)) and bool((ids.diff() > 0).all())  # low ids kept, sorted
    tokens, positions = torch.tensor([[3, 7, 250], [1, 2, 3]]), torch.arange(3)
    out = head(tokens, torch.randn(2, 3, config.feature_size), positions)
    again = head(tokens, out, positions)  # fed back: width H, not through fc
    assert out.shape == again.shape == (2, 3, 64) and head.logits(again).shape == (2, 3, 100)
    assert head.logits(again).dtype == torch.float32 and not head.training


def test_the_layers_a_head_reads(tmp_path):
    """Default (2, L // 2, L - 3); speculators' ids and a top-level list as they are; an eagle_config list
    + 1 when it starts at 1 (SpecForge's layer outputs), as is otherwise (as sglang reads them)."""
    write_eagle3_checkpoint(tmp_path / "e", tiny("eagle"))
    assert read_eagle3_config(tmp_path / "e", 6).feature_layers == (2, 3, 3)
    assert read_eagle3_config(tmp_path / "e", 32).feature_layers == (2, 16, 29)
    for ids, expected in (([1, 3, 6], (2, 4, 7)), ([2, 4, 5], (2, 4, 5))):
        edit_config(tmp_path / "e", eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        assert read_eagle3_config(tmp_path / "e", LAYERS).feature_layers == expected
    edit_config(tmp_path / "e", eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    assert read_eagle3_config(tmp_path / "e", LAYERS).feature_layers == (1, 3, 6)
    write_eagle3_checkpoint(tmp_path / "s", tiny("speculators", layers=(1, 5, 7)))
    assert read_eagle3_config(tmp_path / "s", LAYERS).feature_layers == (1, 5, 7)
    with pytest.raises(ValueError, match=r"reads target layers \[1, 5, 7\]; this target has 1..6"):
        read_eagle3_config(tmp_path / "s", 6)
    edit_config(tmp_path / "s", eagle_aux_hidden_state_layer_ids=None)
    assert read_eagle3_config(tmp_path / "s", LAYERS).feature_layers == (2, 4, 5)
    with pytest.raises(ValueError, match="names no target layers"):
        load_eagle3(tmp_path / "s", target_embedding(tiny("speculators")))  # the default needs the target's depth


def test_a_speculators_config_without_llama_defaults_and_with_llama3_rope():
    """transformer_layer_config is written with to_diff_dict: keys equal to LlamaConfig's defaults are absent;
    transformers 5 writes the rope under rope_parameters. The llama3 frequencies are transformers' own."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        layer = {"model_type": "llama", "num_hidden_layers": 1, "vocab_size": 300, "num_key_value_heads": 8,
                 "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}
        (Path(folder) / "config.json").write_text(json.dumps(
            {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 100}))
        config = read_eagle3_config(Path(folder), 32)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (4096, 32, 8, 128)
    assert (config.intermediate_size, config.rms_norm_eps, config.rope_theta) == (11008, 1e-6, 500000.0)
    assert config.norm_before_residual and config.target_hidden_size == 4096  # vLLM's default when absent
    assert config.rope_scaling["factor"] == 8.0 and config.feature_layers == (2, 16, 29)
    assert torch.allclose(inverse_frequencies(config), reference_frequencies(config), rtol=1e-6)
    assert not torch.allclose(inverse_frequencies(config), reference_frequencies(tiny("eagle", head_dim=128, rope_theta=500000.0)))


# --- the math ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,changes", [
    ("eagle", {}),
    ("speculators", {"norm_before_residual": True}),
    ("eagle", {"rope_scaling": LLAMA3}),
    ("speculators", {"target_hidden_size": 48}),  # a wider-or-narrower target: the checkpoint brings its embedding
])
def test_cached_steps_equal_the_math_uncached(tmp_path, layout, changes):
    """Target rows read in two pieces, then three drafting steps each feeding back the previous output,
    through the head's cache, equal the restatement above recomputed over the whole prefix each time."""
    config = tiny(layout, **changes)
    own_embedding = config.target_hidden_size != config.hidden_size
    write_eagle3_checkpoint(tmp_path, config, seed=7, with_embedding=own_embedding, dtype=torch.float32)
    state = tensors_of(tmp_path)
    target = torch.randn(config.vocab_size, config.target_hidden_size, generator=torch.Generator().manual_seed(1))
    head = load_eagle3(tmp_path, target, LAYERS)
    embedding = state["embed_tokens.weight"] if own_embedding else target
    tokens, positions = [5, 17, 3, 299, 42, 7, 11, 0], torch.arange(20, 28)  # any start: what matters is relative
    rows = torch.randn(5, config.feature_size, generator=torch.Generator().manual_seed(2))  # target features f_{t-1}
    cache, outputs = HeadCache(), []
    with torch.inference_mode():
        for start, stop in ((0, 3), (3, 5)):
            outputs.append(head(torch.tensor([tokens[start:stop]]), rows[None, start:stop], positions[start:stop], cache)[0])
        for i in range(5, 8):
            outputs.append(head(torch.tensor([[tokens[i]]]), outputs[-1][None, -1:], positions[i:i + 1], cache)[0])
    got = torch.cat(outputs)  # [8, H]
    assert cache.length == 8 and cache.keys.shape == (2, 8, 16)
    expected = reference_drafting(state, config, embedding, tokens, rows, positions, fed_back_from=5)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    norm = rms(got, state["norm.weight"], config.rms_norm_eps)
    assert torch.allclose(head.logits(got), norm @ state["lm_head.weight"].T, atol=1e-4)


def test_a_bfloat16_head_keeps_float32_rope(tmp_path):
    """The head cast to bfloat16 (the drafter's speed choice) still agrees with float32 to bf16 precision."""
    config = tiny("speculators", rope_scaling=LLAMA3)
    write_eagle3_checkpoint(tmp_path, config, seed=2)
    embedding = target_embedding(config)
    exact, fast = load_eagle3(tmp_path, embedding, LAYERS), load_eagle3(tmp_path, embedding, LAYERS, dtype=torch.bfloat16)
    tokens, rows, positions = torch.tensor([[4, 9, 200, 31]]), torch.randn(1, 4, config.feature_size), torch.arange(1000, 1004)
    with torch.inference_mode():
        assert torch.allclose(fast(tokens, rows, positions).float(), exact(tokens, rows, positions), atol=0.1, rtol=0.05)


# --- files and refusals --------------------------------------------------------------------------------------------
def test_pytorch_model_bin_and_shards_load_alike(tmp_path):
    from safetensors.torch import save_file

    config = tiny("eagle")
    write_eagle3_checkpoint(tmp_path, config, seed=5)
    state, embedding = tensors_of(tmp_path), target_embedding(config)
    tokens, rows, positions = torch.tensor([[4, 9, 200]]), torch.randn(1, 3, config.feature_size), torch.arange(3)
    expected = load_eagle3(tmp_path, embedding, LAYERS)(tokens, rows, positions)
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert torch.equal(load_eagle3(tmp_path, embedding, LAYERS)(tokens, rows, positions), expected)
    (tmp_path / "pytorch_model.bin").unlink()
    names = sorted(state)
    save_file({name: state[name] for name in names[:6]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({name: state[name] for name in names[6:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert torch.equal(load_eagle3(tmp_path, embedding, LAYERS)(tokens, rows, positions), expected)


def test_a_draft_vocabulary_equal_to_the_targets_needs_no_maps(tmp_path):
    config = tiny("speculators", draft_vocab_size=300)
    write_eagle3_checkpoint(tmp_path, config)
    assert "d2t" not in tensors_of(tmp_path)  # speculators saves no identity maps
    assert torch.equal(load_eagle3(tmp_path, target_embedding(config), LAYERS).vocab_ids, torch.arange(300))


def refused(folder: Path, match: str, embedding: torch.Tensor | None = None, **state_changes) -> None:
    from safetensors.torch import save_file

    if state_changes:
        state = tensors_of(folder)
        for name, tensor in state_changes.items():
            name = name.replace("__", ".")
            if tensor is None:
                state.pop(name)
            else:
                state[name] = tensor
        save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_eagle3(folder, target_embedding(tiny("eagle")) if embedding is None else embedding, LAYERS)


@pytest.mark.parametrize("change,match", [
    ({"midlayer__self_attn__q_proj__weight": torch.zeros(64, 64)},
     r"tensor midlayer.self_attn.q_proj.weight has shape \[64, 64\], expected \[64, 128\]"),
    ({"fc__weight": torch.zeros(64, 128)}, r"tensor fc.weight has shape \[64, 128\], expected \[64, 192\]"),
    ({"norm__weight": None}, r"tensor norm.weight is missing"),
    ({"midlayer__self_attn__q_norm__weight": torch.ones(16)}, r"unexpected tensor\(s\) midlayer.self_attn.q_norm.weight"),
    ({"d2t": None}, r"tensor d2t is missing"),
    ({"d2t": torch.full((100,), 250)}, r"d2t maps draft ids to target ids outside 0..299"),
    ({"t2d": torch.ones(300, dtype=torch.bool)}, r"t2d disagrees with d2t"),
])
def test_tensors_that_do_not_fit_are_named(tmp_path, change, match):
    write_eagle3_checkpoint(tmp_path, tiny("eagle"))
    refused(tmp_path, match, **change)


def test_configs_and_embeddings_that_do_not_fit_are_named(tmp_path):
    write_eagle3_checkpoint(tmp_path, tiny("speculators"))
    refused(tmp_path, r"needs an embedding \[300, 64\].*\[7, 64\] given", embedding=torch.zeros(7, 64))
    raw = json.loads((tmp_path / "config.json").read_text())
    for changes, match in (
        ({"transformer_layer_config": {**raw["transformer_layer_config"], "num_hidden_layers": 2}}, "num_hidden_layers is 2"),
        ({"transformer_layer_config": {**raw["transformer_layer_config"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
         "rope scaling type 'yarn' is not supported"),
        ({"norm_before_fc": True}, "norm_before_fc is set"),
        ({"speculators_model_type": "eagle"}, "speculators_model_type is 'eagle', not 'eagle3'"),
        ({"speculators_model_type": None, "draft_vocab_size": None, "architectures": ["LlamaForCausalLM"]},
         r"config.json: neither an EAGLE authors' config"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({key: value for key, value in {**raw, **changes}.items() if value is not None}))
        refused(tmp_path, match)
    assert not is_eagle3_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").unlink()
    refused(tmp_path, r"no weights: expected model.safetensors, \*.safetensors shards or pytorch_model.bin")
    (tmp_path / "config.json").unlink()
    refused(tmp_path, "no config.json")
    assert not is_eagle3_checkpoint(tmp_path)


def test_a_checkpoint_without_embedding_needs_the_targets(tmp_path):
    config = tiny("eagle")
    write_eagle3_checkpoint(tmp_path, config)
    with pytest.raises(ValueError, match=r"needs an embedding \[300, 64\].*none given"):
        load_eagle3(tmp_path, None, LAYERS)
    write_eagle3_checkpoint(tmp_path / "own", config, with_embedding=True)
    head = load_eagle3(tmp_path / "own", None, LAYERS)  # its own embed_tokens
    assert torch.equal(head.embedding, tensors_of(tmp_path / "own")["embed_tokens.weight"].float())
