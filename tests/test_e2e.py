"""Multi-process end to end with the real default target: `specd up`, then `specd generate --json`.

Greedy output through the services must equal target-only decoding through the same services and
plain transformers `generate`, token for token, on prompts from ../shared/data.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.v1 import common_pb2, verify_pb2_grpc
from tests.specd_stack import free_ports

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MAX_NEW_TOKENS = 40


def shared_prompts(per_file: int = 2) -> list[str]:
    """The first rows of each public prompt set (math, code, chat)."""
    prompts = []
    for name in ("gsm8k_train.jsonl", "humaneval.jsonl", "seed_tasks.jsonl"):
        with open(DATA / name) as rows:
            prompts += [json.loads(next(rows))["prompt"] for _ in range(per_file)]
    return prompts


@pytest.fixture(scope="module")
def up_ports() -> dict:
    return dict(zip(("gateway", "draft", "verify", "http"), free_ports(4)))


@pytest.fixture(scope="module")
def specd_up(up_ports):
    """`specd up` on free ports with the embedded default; stopped with SIGTERM at the end."""
    ports = up_ports
    command = [
        sys.executable, "-m", "specd_app.cli", "up",
        "--gateway-port", str(ports["gateway"]), "--draft-port", str(ports["draft"]), "--verify-port", str(ports["verify"]),
        "--http-port", str(ports["http"]),
    ]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "SPECD_LOG_LEVEL": "WARNING"})
    address = f"127.0.0.1:{ports['gateway']}"
    try:
        wait_serving(address, process, timeout_s=600)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=60) == 0, "specd up did not stop cleanly on SIGTERM"
        finally:
            if process.poll() is None:
                process.kill()


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, "specd up exited during start-up"
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"gateway {address} not serving after {timeout_s} s")


def specd_generate(address: str, prompt: str, *flags: str) -> dict:
    command = [sys.executable, "-m", "specd_app.cli", "generate", "--gateway", address, "--prompt", prompt,
               "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", *flags]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout)


def test_greedy_through_services_equals_target_only(specd_up, up_ports):
    """`specd up`'s defaults: on a CPU the verify serves the 4-bit GGUF with int4 products (--weights
    auto), and speculation keeps its own greedy output token for token. (Against transformers' float32:
    the float verify of test_the_default_drafter_fits_the_machine_...)"""
    with grpc.insecure_channel(f"127.0.0.1:{up_ports['verify']}") as channel:
        info = verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
    assert '"weights":"int4"' in info.runtime_config, info.runtime_config
    prompts = shared_prompts()
    assert len(prompts) == 6
    accepted = 0
    for prompt in prompts:
        speculative = specd_generate(specd_up, prompt)
        target_only = specd_generate(specd_up, prompt, "--no-speculation")
        assert speculative["token_ids"] == target_only["token_ids"], prompt[:60]
        assert speculative["stats"]["target_passes"] <= target_only["stats"]["target_passes"]
        accepted += speculative["stats"]["accepted_tokens"]
    assert accepted > 0, "the default drafter never had a draft accepted"


def test_prompt_goes_through_the_chat_template(specd_up, default_target):
    reply = specd_generate(specd_up, "What is 2 + 3?")
    expected = default_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert reply["prompt_token_ids"] == list(expected)
    assert set(reply) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert set(reply["stats"]) >= {"target_passes", "draft_tokens", "accepted_tokens"}
    assert "5" in reply["text"]


def test_sampling_with_a_seed_is_reproducible(specd_up):
    flags = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "7")
    assert specd_generate(specd_up, "Write a haiku about rain.", *flags)["token_ids"] == specd_generate(
        specd_up, "Write a haiku about rain.", *flags
    )["token_ids"]


def readme_http_examples() -> tuple[list[str], str]:
    """The curl commands (continuation lines joined) and the Python snippet of docs/http-api.md, the
    HTTP API's page (the README links it and shows one of its commands)."""
    section = (REPO / "docs" / "http-api.md").read_text()
    shell = section.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in shell.splitlines() if line.strip().startswith("curl ")], python


def test_readme_http_examples_work_as_written(specd_up, up_ports):
    """Every curl line and the Python snippet of docs/http-api.md, against the real
    default model; the only change is the port (the stack here runs on free ports, not 8000)."""
    commands, python = readme_http_examples()
    assert len(commands) == 6 and "127.0.0.1:8000" in python
    here = f"127.0.0.1:{up_ports['http']}"
    outputs = {}
    for command in commands:
        result = subprocess.run(["bash", "-c", command.replace("127.0.0.1:8000", here)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (command, result.stderr)
        outputs[command] = result.stdout
    answers = [json.loads(out) for command, out in outputs.items() if '"stream": true' not in command]
    models, chat, completion, health, structured = answers
    assert [m["id"] for m in models["data"]] == ["embedded:smollm2-135m-instruct"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"].strip()
    assert chat["usage"]["completion_tokens"] == 32 or chat["choices"][0]["finish_reason"] == "stop"
    assert completion["choices"][0]["text"].strip() and "Paris" in completion["choices"][0]["text"]
    assert health == {"status": "ok"}
    cat = json.loads(structured["choices"][0]["message"]["content"])  # response_format's JSON schema
    assert set(cat) == {"name", "age"} and isinstance(cat["age"], int) and structured["choices"][0]["finish_reason"] == "stop"
    (stream,) = [out for command, out in outputs.items() if '"stream": true' in command]
    events = [line.removeprefix("data: ") for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]).strip()
    result = subprocess.run([sys.executable, "-c", python.replace("127.0.0.1:8000", here)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "acceptance_rate" in result.stdout


def test_the_default_drafter_fits_the_machine_and_the_shipped_feature_head_gets_drafts_accepted(specd_up, up_ports, default_target):
    """`specd up`'s drafter: the verify serves its Medusa heads, and the draft service runs the shipped
    feature head exactly when the split stack measured faster than heads-only in every pass at the first
    start (the cached choice, with both stacks' measured tokens per second, pass by pass). Then, with prompt lookup switched
    off (so every draft is the head's own), the feature head's greedy drafts are accepted and the answer
    is the target's."""
    from draft_service.app import load_feature_drafter, start_draft_server
    from gateway.app import start_gateway_server
    from specd_app import stack_choice
    from specd_app.cli import build_parser
    from specd_app.stack import service_devices
    from specd_app.stack_choice import up_choice_key
    from gateway.options import GatewayOptions
    from specd.v1 import common_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, verify_pb2_grpc
    from specd_common.config import DEFAULT_FEATURE_HEAD, ServerConfig
    from tests.specd_stack import serving
    from verify_service.app import start_verify_server

    with grpc.insecure_channel(f"127.0.0.1:{up_ports['verify']}") as channel:
        verify_info = verify_pb2_grpc.VerifyServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
    assert verify_info.medusa_heads == 3  # the shipped heads, loaded whatever the drafter
    args = build_parser().parse_args(["up"])
    record = stack_choice.cached_choice(up_choice_key(args, service_devices(args.verify_device, args.draft_device)))
    assert record is not None and sorted(record["tokens_per_s"]) == ["heads", "split"]
    assert all(rate > 0 for rate in record["tokens_per_s"].values())
    assert record["choice"] == stack_choice.choose(record["tokens_per_s_by_pass"])
    if record["choice"] == stack_choice.HEADS:
        assert not serving(f"127.0.0.1:{up_ports['draft']}"), "the draft service runs though heads-only measured faster"
    else:
        with grpc.insecure_channel(f"127.0.0.1:{up_ports['draft']}") as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
        assert info.drafter == "feature" and info.model_name == f"feature-head:{DEFAULT_FEATURE_HEAD.name}"

    config = ServerConfig(port=0)
    verify = start_verify_server(default_target, config, threads=1, prepack="off")
    draft = start_draft_server(load_feature_drafter(str(DEFAULT_FEATURE_HEAD), dtype="float32", threads=1), config)
    gateway = start_gateway_server(f"127.0.0.1:{verify.port}", f"127.0.0.1:{draft.port}", config,
                                   GatewayOptions(connect_timeout_s=60, lookup_tokens=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            prompt = shared_prompts(1)[2]
            request = dict(text=prompt, max_new_tokens=MAX_NEW_TOKENS, draft_length_policy=generate_pb2.DRAFT_LENGTH_POLICY_FIXED)
            head = stub.Generate(generate_pb2.GenerateRequest(**request), timeout=300)
            alone = stub.Generate(generate_pb2.GenerateRequest(**request, disable_speculation=True), timeout=300)
    finally:
        for server in (gateway, draft, verify):
            server.stop(0)
    assert list(head.token_ids) == list(alone.token_ids)
    assert head.stats.draft_tokens > 0 and head.stats.accepted_tokens > 0
    with torch.inference_mode():  # a float verify: transformers' float32 answer, token for token
        out = default_target.model.generate(torch.tensor([list(head.prompt_token_ids)]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert list(head.token_ids) == out[0, len(head.prompt_token_ids) :].tolist()


def test_json_schema_answers_of_the_default_model_validate_and_speculation_changes_nothing(specd_up, up_ports):
    """Structured output with the real default model through `specd up`, the official openai client and
    20 prompts the drafts never saw (docs/benchmarks/json_prompts.jsonl): every greedy answer is valid under
    its JSON Schema (nested object, array, enum; jsonschema checks it) and equals `speculation: false`'s;
    sampled answers that end validate too (19 of 20 ended on the Xeon with AMX, 2026-12-02; one ran a
    string to max_tokens); json_object answers that end parse as JSON objects (2 of 20 ended within
    120 tokens on 2026-11-27: the others repeat list items until the limit)."""
    import jsonschema
    import openai

    schema = json.loads((REPO / "docs" / "benchmarks" / "json_schema_profile.json").read_text())
    prompts = [json.loads(line)["prompt"] for line in (REPO / "docs" / "benchmarks" / "json_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 20
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up_ports['http']}/v1", api_key="unused", max_retries=0, timeout=300)
    model = "embedded:smollm2-135m-instruct"
    response_format = {"type": "json_schema", "json_schema": {"name": "profile", "schema": schema, "strict": True}}
    forced = sampled_ended = 0
    for index, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        ask = functools.partial(client.chat.completions.create, model=model, messages=messages, max_tokens=200)
        greedy = ask(temperature=0, response_format=response_format)
        jsonschema.validate(json.loads(greedy.choices[0].message.content), schema)
        target_only = ask(temperature=0, response_format=response_format, extra_body={"speculation": False})
        assert greedy.choices[0].message.content == target_only.choices[0].message.content, prompt
        forced += greedy.model_extra["specd"]["forced_rounds"]
        sampled = ask(temperature=0.8, seed=index, response_format=response_format)
        if sampled.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(sampled.choices[0].message.content), schema)
            sampled_ended += 1
        else:  # a sampled string may run on (on the Xeon with AMX, seed 0 wrote 200 tokens of katakana): cut, not wrong
            assert sampled.choices[0].finish_reason == "length" and sampled.usage.completion_tokens == 200
            assert sampled.choices[0].message.content.startswith('{"name": "')
        if index < 5:  # json_object: unbounded strings, where this 135M model mostly repeats itself to the limit
            anything = ask(temperature=0, max_tokens=80, response_format={"type": "json_object"})
            assert anything.choices[0].message.content.startswith("{")
            if anything.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(anything.choices[0].message.content), dict)
    assert forced >= 20
    print(f"sampled answers that ended: {sampled_ended} of {len(prompts)}")
    assert sampled_ended >= 15  # the rest were cut at max_tokens, each checked above
