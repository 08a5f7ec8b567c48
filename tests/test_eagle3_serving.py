"""EAGLE-3 heads served through the three services: a checkpoint in a published layout (written the
way a user's folder holds it, by draft_service/eagle3_head.write_eagle3_checkpoint) loads in the draft
service, the draft names the target layers it reads, the verify returns exactly those layers' hidden
states side by side, and greedy output equals target-only and transformers'."""

from __future__ import annotations

import grpc
import pytest
import torch
import torch.nn.functional as F

from draft_service.eagle3_head import Eagle3Config, write_eagle3_checkpoint
from specd.v1 import common_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specd_engine.features import decode_features
from tests.conftest import start_cluster
from tests.test_services import PROMPTS, assert_greedy_exact_with_drafts
from tests.tiny_models import build_model, build_tokenizer

LAYERS = 8  # the EAGLE-3 default reads hidden_states (2, L // 2, L - 3) = (2, 4, 5)
DEFAULT_LAYERS = (2, 4, 5)


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("eagle3") / "target", seed=11, layers=LAYERS, tokenizer=build_tokenizer())


def head_config(target, layout: str) -> Eagle3Config:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    return Eagle3Config(hidden_size=config.hidden_size, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                        head_dim=config.hidden_size // config.num_attention_heads, intermediate_size=config.intermediate_size,
                        rms_norm_eps=config.rms_norm_eps, rope_theta=10000.0, rope_scaling=None, vocab_size=config.vocab_size,
                        draft_vocab_size=config.vocab_size // 2, target_hidden_size=config.hidden_size,
                        feature_layers=DEFAULT_LAYERS, layout=layout)


@pytest.fixture(scope="module", params=["eagle", "speculators"])
def eagle3_cluster(request, deep_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"eagle3-{request.param}")
    write_eagle3_checkpoint(folder, head_config(deep_target, request.param), seed=5)
    running = start_cluster(deep_target, "eagle3", folder)
    yield running
    running.stop()


def test_the_draft_names_the_layers_its_head_reads(eagle3_cluster):
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.draft.port}"))
    info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    assert info.drafter == "eagle3" and info.wants_target_features
    assert tuple(info.target_feature_layers) == DEFAULT_LAYERS


def test_the_verify_returns_the_layers_a_session_asks_for(eagle3_cluster, deep_target):
    """Rows are hidden_states[2], [4], [5] side by side (float16 on the wire), at the positions each call
    read; a session that names no layers on the same verify still gets the final hidden state."""
    from transformers import AutoModelForCausalLM

    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.verify.port}"))
    prompt, drafts = [5, 6, 7, 8, 9, 10], [11, 12]
    prefill = stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="l1", prompt_token_ids=prompt, return_features=True,
                                                           feature_layers=list(DEFAULT_LAYERS)), timeout=30)
    reply = stub.Verify(verify_pb2.VerifyRequest(session_id="l1", commit=common_pb2.Commit(prefix_length=len(prompt)),
                                                 draft_token_ids=drafts, return_features=True), timeout=30)
    plain = stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="l2", prompt_token_ids=prompt, return_features=True), timeout=30)
    for session in ("l1", "l2"):
        stub.Release(common_pb2.ReleaseRequest(session_id=session), timeout=10)
    model = AutoModelForCausalLM.from_pretrained(deep_target).eval()
    with torch.inference_mode():
        states = model(torch.tensor([prompt + drafts]), output_hidden_states=True).hidden_states  # L + 1 of [1, 8, H]
    hidden = model.config.hidden_size
    expected = torch.cat([states[layer][0] for layer in DEFAULT_LAYERS], dim=-1)  # [8, 3H]
    got = torch.cat((decode_features(prefill.features, 3 * hidden), decode_features(reply.features, 3 * hidden)))
    assert reply.features.start_position == len(prompt) - 1 and got.shape == expected.shape
    assert torch.allclose(got, expected, atol=2e-2)
    assert torch.allclose(decode_features(plain.features, hidden), states[-1][0, : len(prompt) - 1], atol=2e-2)


def test_layers_the_target_does_not_have_are_invalid_argument(eagle3_cluster):
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(f"127.0.0.1:{eagle3_cluster.verify.port}"))
    for layers, features in (([2, LAYERS + 1], True), ([0], True), ([2], False)):
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(verify_pb2.VerifyPrefillRequest(session_id="bad", prompt_token_ids=[5, 6], return_features=features,
                                                         feature_layers=layers), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "feature_layers" in error.value.details()


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_with_an_eagle3_head_equals_target_only_and_transformers(eagle3_cluster, deep_target, prompt):
    assert_greedy_exact_with_drafts(eagle3_cluster, deep_target, prompt, 24)


# --- the checkpoint, alone ------------------------------------------------------------------------
def tiny_config(layout: str, layers: tuple = (2, 3, 5), norm_before_residual: bool = False) -> Eagle3Config:
    return Eagle3Config(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                        rope_theta=10000.0, rope_scaling=None, vocab_size=120, draft_vocab_size=40, target_hidden_size=32,
                        feature_layers=layers, layout=layout, norm_before_residual=norm_before_residual)


def reference_outputs(tensors: dict, config: Eagle3Config, embedding: torch.Tensor, tokens: list[int],
                      target_rows: torch.Tensor, fed_back_from: int) -> torch.Tensor:
    """The EAGLE-3 layer's outputs [n, H] written out from the raw tensors, one position at a time over
    full (uncached) attention: position i reads token tokens[i] with target_rows[i] through fc, or from
    `fed_back_from` on the previous position's output. An independent restatement of the math."""
    p = "midlayer." if config.layout == "eagle" else "layers.0."
    w = {name: t.float() for name, t in tensors.items()}

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    def rope(x, position):  # x [heads, d]
        d = x.shape[-1]
        angles = position / config.rope_theta ** (torch.arange(0, d, 2).float() / d)
        cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
        return x * cos + torch.cat((-x[:, d // 2 :], x[:, : d // 2]), dim=-1) * sin

    keys, values, outputs = [], [], []
    for i, token in enumerate(tokens):
        g = w["fc.weight"] @ target_rows[i] if i < fed_back_from else outputs[-1]  # [H]
        a = torch.cat((norm(embedding[token].float(), w[f"{p}input_layernorm.weight"]), norm(g, w[f"{p}hidden_norm.weight"])))
        heads, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
        q = rope((w[f"{p}self_attn.q_proj.weight"] @ a).view(heads, d), i)
        keys.append(rope((w[f"{p}self_attn.k_proj.weight"] @ a).view(kv, d), i))
        values.append((w[f"{p}self_attn.v_proj.weight"] @ a).view(kv, d))
        k = torch.stack(keys).repeat_interleave(heads // kv, dim=1)  # [i + 1, heads, d]
        v = torch.stack(values).repeat_interleave(heads // kv, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q, k) / d ** 0.5, dim=-1)  # [heads, i + 1]
        x = g + w[f"{p}self_attn.o_proj.weight"] @ torch.einsum("ht,thd->hd", weights, v).reshape(-1)
        y = norm(x, w[f"{p}post_attention_layernorm.weight"])
        mlp = w[f"{p}mlp.down_proj.weight"] @ (F.silu(w[f"{p}mlp.gate_proj.weight"] @ y) * (w[f"{p}mlp.up_proj.weight"] @ y))
        outputs.append(x + mlp)
    return torch.stack(outputs)


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_cached_steps_equal_the_math_written_out(tmp_path, layout):
    """Reading 5 positions with the target's rows in two pieces, then drafting 2 steps from its own
    output, gives what the formulas give; the draft vocabulary maps through d2t inside t2d."""
    from safetensors.torch import load_file

    from draft_service.eagle3_head import load_eagle3
    from draft_service.feature_head import HeadCache

    config = tiny_config(layout)
    write_eagle3_checkpoint(tmp_path, config, seed=3, dtype=torch.float32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    embedding = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(1))
    head = load_eagle3(tmp_path, embedding, target_num_layers=6)
    assert torch.equal(head.vocab_ids, torch.arange(config.draft_vocab_size) + tensors["d2t"])
    assert tensors["t2d"][head.vocab_ids].all() and int(tensors["t2d"].sum()) == config.draft_vocab_size
    tokens, rows = [5, 17, 3, 99, 42, 7, 11], torch.randn(5, config.feature_size, generator=torch.Generator().manual_seed(2))
    cache, outputs = HeadCache(), []
    with torch.inference_mode():
        for start, stop in ((0, 3), (3, 5)):
            outputs.append(head(torch.tensor([tokens[start:stop]]), rows[None, start:stop], torch.arange(start, stop), cache)[0])
        for position in (5, 6):
            outputs.append(head(torch.tensor([[tokens[position]]]), outputs[-1][None, -1:], torch.tensor([position]), cache)[0])
    got = torch.cat(outputs)  # [7, H]
    expected = reference_outputs(tensors, config, embedding, tokens, rows, fed_back_from=5)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    logits = head.logits(got[-1])
    norm = tensors["norm.weight"] * got[-1] * torch.rsqrt(got[-1].pow(2).mean() + config.rms_norm_eps)
    assert torch.allclose(logits, tensors["lm_head.weight"] @ norm, atol=1e-4)


def test_a_checkpoint_that_does_not_fit_is_refused_naming_what(tmp_path):
    from safetensors.torch import load_file, save_file

    from draft_service.eagle3_head import load_eagle3

    config = tiny_config("eagle")
    embedding = torch.zeros(config.vocab_size, config.hidden_size)
    write_eagle3_checkpoint(tmp_path, config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    torch.save(tensors, tmp_path / "pytorch_model.bin")  # the older file format: loads alike
    (tmp_path / "model.safetensors").rename(tmp_path / "held")
    assert load_eagle3(tmp_path, embedding, target_num_layers=6).config.feature_layers == (2, 3, 3)  # (2, L // 2, L - 3)
    (tmp_path / "pytorch_model.bin").unlink()
    bad = {**tensors, "midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"midlayer.self_attn.q_proj.weight has shape \[32, 32\], expected \[32, 64\]"):
        load_eagle3(tmp_path, embedding, target_num_layers=6)
    save_file({name: t for name, t in tensors.items() if name != "d2t"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor d2t is missing"):
        load_eagle3(tmp_path, embedding, target_num_layers=6)
    with pytest.raises(ValueError, match="needs an embedding"):
        load_eagle3(tmp_path, torch.zeros(7, config.hidden_size), target_num_layers=6)
    named = tmp_path / "named"
    write_eagle3_checkpoint(named, tiny_config("speculators", layers=(2, 3, 5)))
    with pytest.raises(ValueError, match=r"reads target layers \[2, 3, 5\]; this target has 1..4"):
        load_eagle3(named, embedding, target_num_layers=4)
    (named / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}')
    with pytest.raises(ValueError, match="neither an EAGLE authors' config"):
        load_eagle3(named, embedding, target_num_layers=6)
