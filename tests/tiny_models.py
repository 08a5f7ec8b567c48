"""Tiny random Llama models with a real (tiny, freshly trained) tokenizer and chat template: no download."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass",
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "hello world, how are you today? I am fine, thank you.",
] * 20


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (~300 tokens) trained on a fixed corpus; deterministic."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(path: Path, seed: int, layers: int = 2, hidden: int = 64, tokenizer=None, head_scale: float = 3.0) -> Path:
    """Save a random Llama (and the tiny tokenizer) to path; the same seed gives the same weights.
    head_scale multiplies the output head: larger makes the next-token distributions more peaked."""
    tokenizer = tokenizer or build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharpen the random logits so greedy and sampled outputs vary meaningfully
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_noisy_copy(source: Path, path: Path, noise: float, seed: int = 7) -> Path:
    """A draft that agrees with `source` only partly: its output head plus Gaussian noise (noise × std)."""
    model = LlamaForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.lm_head.weight
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * noise)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(source).save_pretrained(path)
    return path


def build_feature_head(target: Path, path: Path, vocab_stride: int = 1) -> Path:
    """An untrained feature head for `target` (layer copied from its last layer, fc passing features
    through), scoring every `vocab_stride`-th id plus EOS: a reduced vocabulary, as trained heads have."""
    from draft_service.feature_head import save_head
    from draft_training.feature_training import build_head
    from specd_engine.models import eos_token_ids, load_causal_lm

    loaded = load_causal_lm(str(target), device="cpu", dtype="float32")
    vocab = set(range(0, loaded.model.config.vocab_size, vocab_stride)) | set(eos_token_ids(loaded))
    save_head(build_head(loaded, torch.tensor(sorted(vocab)), str(target)), path)
    return path


def build_medusa_heads(target: Path, path: Path, heads: int = 3) -> Path:
    """Untrained Medusa heads for `target` over its whole vocabulary: each residual block starts as
    the identity, so every head proposes the target's own next token at its row (x_{t+1}, for x_{t+1+k}):
    right exactly where the target repeats a token."""
    from draft_training.medusa_training import MedusaRecipe, build_heads
    from specd_engine.models import load_causal_lm
    from verify_service.medusa import save_heads

    loaded = load_causal_lm(str(target), device="cpu", dtype="float32")
    vocab = torch.arange(loaded.model.config.vocab_size)
    save_heads(build_heads(loaded, vocab, str(target), MedusaRecipe(num_heads=heads)), path)
    return path


def build_eagle3_head(target: Path, path: Path, layers: tuple = (1, 2, 2), seed: int = 0, noise: float = 0.4) -> Path:
    """An EAGLE-3 checkpoint for `target` in the speculators layout over its whole vocabulary (no
    d2t/t2d, as speculators writes it then), reading its decoder layers `layers`; fc picks the last
    of them and the layer adds nothing, so it reaches the target's own final norm and LM head rows
    plus Gaussian noise (noise × their std): at the first drafted position q is close to the target's
    p, as a noisy copy's would be, so q and p overlap but differ. With a third of the vocabulary the
    chi-square test had too little power against wrong rules at 2,000 samples. For a target whose
    last decoder layer is the last one named."""
    from safetensors.torch import load_file, save_file

    from draft_service.eagle3_head import Eagle3Config, write_eagle3_checkpoint

    config = LlamaConfig.from_pretrained(target)
    hidden = config.hidden_size
    write_eagle3_checkpoint(path, Eagle3Config(
        hidden_size=hidden, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=hidden // config.num_attention_heads, intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps, rope_theta=10000.0, rope_scaling=None, vocab_size=config.vocab_size,
        draft_vocab_size=config.vocab_size, target_hidden_size=hidden, feature_layers=layers,
        layout="speculators"), seed=seed, dtype=torch.float32)
    tensors = load_file(str(path / "model.safetensors"))
    model = LlamaForCausalLM.from_pretrained(target)
    rows, generator = model.lm_head.weight.detach(), torch.Generator().manual_seed(seed)  # [V, H]: no d2t, V' = V
    fc = torch.zeros(hidden, len(layers) * hidden)
    fc[:, -hidden:] = torch.eye(hidden)
    tensors.update({"fc.weight": fc, "layers.0.self_attn.o_proj.weight": torch.zeros(hidden, hidden),
                    "layers.0.mlp.down_proj.weight": torch.zeros(hidden, config.intermediate_size),
                    "norm.weight": model.model.norm.weight.detach().clone(),
                    "lm_head.weight": rows + noise * rows.std() * torch.randn(rows.shape, generator=generator)})
    save_file(tensors, str(path / "model.safetensors"))
    return path
