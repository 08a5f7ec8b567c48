"""Devices on the CUDA path, tested where no GPU is: each service's device on `specd up`'s and
`specd bench`'s command lines, the device a timing waits on, the memory a draft's KV budget reads,
transformers' inputs on the model's device and dtype, and the feature drafter reading only the two
matrices it needs of its target (issue 44). tests/test_gpu.py runs the same paths on a device."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from specd_app import cli, stack

REPO = Path(__file__).resolve().parents[1]
PORTS = {"gateway": 1, "draft": 2, "verify": 3}


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("count, verify, draft", [(0, "cpu", "cpu"), (1, "cuda:0", "cuda:0"), (2, "cuda:0", "cuda:1"), (4, "cuda:0", "cuda:1")])
def test_auto_spreads_draft_and_verify_over_the_visible_gpus(monkeypatch, count, verify, draft):
    monkeypatch.setattr("specd_engine.models.visible_cuda_devices", lambda: count)
    assert stack.service_devices() == {"verify": verify, "draft": draft}
    assert stack.service_devices("cuda:3", "auto", count=count) == {"verify": "cuda:3", "draft": draft}


def test_up_passes_each_service_its_device_and_dtype_on_its_command_line(monkeypatch):
    monkeypatch.setattr("specd_engine.models.visible_cuda_devices", lambda: 2)
    args = cli.build_parser().parse_args(["up", "--drafter", "ngram"])
    assert (args.verify_device, args.draft_device) == ("auto", "auto")
    commands = stack.service_commands("127.0.0.1", PORTS, "t", "ngram", "", 0, 3, stack.service_devices(args.verify_device, args.draft_device))
    assert flag(commands["verify"], "--device") == "cuda:0" and flag(commands["draft"], "--device") == "cuda:1"
    assert "--device" not in commands["gateway"] and "--dtype" not in commands["verify"]
    args = cli.build_parser().parse_args(["up", "--verify-device", "cuda:1", "--draft-device", "cpu"])
    commands = stack.service_commands("127.0.0.1", PORTS, "t", "ngram", "", 0, 3, stack.service_devices(args.verify_device, args.draft_device),
                                    dtype="float32")
    assert flag(commands["verify"], "--device") == "cuda:1" and flag(commands["draft"], "--device") == "cpu"
    assert flag(commands["verify"], "--dtype") == flag(commands["draft"], "--dtype") == "float32"
    # each command line parses as `specd serve` does, the device where the model loads
    served = cli.build_parser().parse_args(commands["verify"][commands["verify"].index("serve"):])
    assert (served.device, served.dtype) == ("cuda:1", "float32")


def test_bench_takes_the_devices_and_the_dtype():
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--dtype", "bfloat16", "--verify-device", "cuda:1"])
    assert (args.dtype, args.verify_device, args.draft_device) == ("bfloat16", "cuda:1", "auto")


def test_a_timing_waits_on_the_services_own_gpu(monkeypatch):
    from specd_engine.models import synchronize

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    synchronize(torch.device("cpu"))
    synchronize(torch.device("cuda:1"))
    assert waited == [torch.device("cuda:1")]


def test_no_code_waits_on_or_moves_to_an_unnamed_gpu():
    """A bare torch.cuda.synchronize() waits on GPU 0 for a service on cuda:1, and .cuda() moves there."""
    offenders = []
    for path in REPO.glob("*/**/*.py"):
        if ".venv" in path.parts or path.parts[len(REPO.parts)] == "tests":
            continue
        text = path.read_text()
        if re.search(r"torch\.cuda\.synchronize\(\s*\)|\.cuda\(\s*\)|mem_get_info\(\s*\)", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_the_draft_budget_reads_the_memory_of_the_drafters_device(monkeypatch):
    from draft_service import app
    from specd_engine import autotune

    asked = []
    monkeypatch.setattr(autotune, "available_memory_bytes", lambda device: asked.append(device) or 2**30)

    class OnGpu:
        device = torch.device("cuda:1")

        def bytes_per_token(self) -> int:
            return 1024

    assert app.draft_token_budget(OnGpu(), 0) == 2**30 // 2 // 1024
    assert asked == ["cuda:1"]
    assert app.draft_token_budget(OnGpu(), 7) == 7


def test_transformers_in_bench_gets_its_inputs_on_the_models_device_and_honours_dtype(tiny):
    from specd_app.bench import HFRunner

    runner = HFRunner(str(tiny.target), "", "hello", device="cpu", dtype="bfloat16")
    assert runner.loaded.model.dtype == torch.bfloat16
    assert runner.input_ids("hello world").device == runner.loaded.device
    assert runner.run({"prompt": "hello world"}, 4, None).tokens == 4


def test_the_feature_drafter_reads_only_its_targets_two_matrices(monkeypatch, tiny):
    """Same drafts as the head over the whole loaded target, without loading the target."""
    from draft_service import app
    from draft_service.feature_head import load_head
    from specd_engine import models
    from specd_engine.features import encode_features
    from specd_common.params import Warp

    full = models.load_causal_lm(str(tiny.target), device="cpu", dtype="float32")
    reference = load_head(tiny.feature_head, full.model)

    def refuse(*_, **__):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    drafter = app.load_feature_drafter(str(tiny.feature_head), str(tiny.target), dtype="float32", threads=1, device="cpu")
    assert str(drafter.device) == "cpu" and json.loads(drafter.info().runtime_config)["device"] == "cpu"
    assert torch.equal(drafter.head.embedding, reference.embedding) and torch.equal(drafter.head.head_rows, reference.head_rows)
    assert drafter.info().vocab_size == full.model.get_output_embeddings().out_features
    prompt = [5, 9, 13, 21, 34, 55]
    session = drafter.open(prompt, Warp())
    with torch.inference_mode():
        features = full.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    drafter.add_features(session, encode_features(features[:-1], 0))
    assert len(drafter.propose(session, 3, np.random.default_rng(0)).token_ids) == 3
