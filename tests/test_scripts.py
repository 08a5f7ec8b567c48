"""Every script under scripts/ runs through its `make` target, here in a cheap smoke mode.

The GPU training recipe (`make train-heads-gpu`) runs whole with the tiny recipes on a tiny random
target, on the CPU; the two head evaluations (`make eval-feature-heads`, `make eval-medusa-heads`)
then read the work dirs and heads it made; `make tracing-overhead` runs its three stacks for one
request each. A script that no target runs has no place in scripts/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_train_feature_head import write_prompt_files
from tests.tiny_models import build_model, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
MAKE_TARGETS = {"train-heads-gpu": "gpu_train_heads.sh", "eval-feature-heads": "head_agreement.py",
                "eval-medusa-heads": "medusa_compare.py", "tracing-overhead": "tracing_overhead.py", "gpu-check": "gpu_check.sh",
                "train-eagle3-gpu": "gpu_train_eagle3.sh", "wire-bytes": "wire_bytes.py", "ab-gateways": "ab_gateways.py",
                "pass-anatomy": "pass_anatomy.py", "graphed-pass": "graphed_pass.py", "flat-fold-widths": "flat_fold_widths.py",
                "int4-kernels": "int4_kernels.py", "int4-inputs": "int4_inputs.py", "heads-precision": "heads_precision.py",
                "sampled-coupling": "sampled_coupling.py", "setup-llama-cpp": "setup_llama_cpp.sh"}


def make(target: str, env: dict | None = None, **variables: str) -> str:
    """`make TARGET VAR=value ...` with this interpreter, the venv taken as set up; its output."""
    argv = ["make", "--no-print-directory", "-o", ".venv/.installed", target, f"PY={sys.executable}",
            *(f"{name}={value}" for name, value in variables.items())]
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def gpu_recipe_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`make train-heads-gpu` with the tiny recipes on a tiny random target, from no saved heads."""
    root = tmp_path_factory.mktemp("gpu_recipe")
    target = build_model(root / "target", seed=0, tokenizer=build_tokenizer(), head_scale=10.0)
    write_prompt_files(root / "data")
    env = {"SPECD_DATA_DIR": str(root / "data"), "MEDUSA_RECIPE": "medusa-tiny", "FEATURE_RECIPE": "feature-tiny",
           "MEDUSA_INIT": "", "FEATURE_INIT": "", "MEDUSA_MINUTES": "0.2", "FEATURE_MINUTES": "0.2"}
    make("train-heads-gpu", env, WORK=str(root / "work"), TRAIN_ARGS=f"--target {target} --device cpu --threads 1")
    return {"work": root / "work", "target": target}


def test_every_script_is_run_by_a_make_target_that_a_test_runs():
    makefile = (REPO / "Makefile").read_text()
    assert sorted(path.name for path in (REPO / "scripts").iterdir() if path.is_file()) == sorted(MAKE_TARGETS.values())
    for target, script in MAKE_TARGETS.items():
        recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        assert f"scripts/{script}" in recipe, (target, script)


def test_setup_llama_cpp_rebuilds_without_amx_when_the_native_build_fails_its_smoke_test(tmp_path):
    """scripts/setup_llama_cpp.sh with a pip that records its calls and a python whose first smoke test
    dies (as llama.cpp's AMX build did on a VM that lists AMX): it installs once natively, then again
    with GGML_NATIVE off, AMX never named, and smoke-tests that build; a passing smoke test stops it."""
    log, tries = tmp_path / "pip.log", tmp_path / "tries"
    pip, python = tmp_path / "pip", tmp_path / "python"
    pip.write_text(f'#!/bin/sh\necho "CMAKE_ARGS=$CMAKE_ARGS $*" >> {log}\n')
    python.write_text(f'#!/bin/sh\ncat > /dev/null\necho x >> {tries}\n[ "$(wc -l < {tries})" -gt 1 ]\n')
    pip.chmod(0o755), python.chmod(0o755)
    done = subprocess.run(["sh", str(REPO / "scripts" / "setup_llama_cpp.sh"), str(pip), str(python)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    native, rebuilt = log.read_text().splitlines()
    assert "NATIVE" not in native and "-DGGML_NATIVE=OFF" in rebuilt and "AMX" not in rebuilt
    assert "--force-reinstall" in rebuilt and "without AMX" in done.stderr and tries.read_text().count("x") == 2
    log.unlink(), tries.write_text("x\n")  # the smoke test now passes at once: one install
    subprocess.run(["sh", str(REPO / "scripts" / "setup_llama_cpp.sh"), str(pip), str(python)], check=True, timeout=60)
    assert len(log.read_text().splitlines()) == 1


def test_the_gpu_recipe_trains_both_drafts_and_resumes(gpu_recipe_run):
    work = gpu_recipe_run["work"]
    assert (work / "status").read_text().split() == ["medusa", "feature", "ALL_DONE"]
    assert (work / "medusa-run" / "medusa" / "medusa_heads.safetensors").exists()
    assert (work / "feature-run" / "draft" / "feature_head.safetensors").exists()


def test_eval_feature_heads_reports_agreement_and_simulated_speculation(gpu_recipe_run, tmp_path):
    run, output = gpu_recipe_run, tmp_path / "agreement.json"
    make("eval-feature-heads", WORK=str(run["work"] / "feature-run"), HEADS=f"tiny={run['work'] / 'feature-run' / 'draft'}",
         EVAL_ARGS=f"--target {run['target']} --speculate 2 --output {output}")
    report = json.loads(output.read_text())["heads"]["tiny"]["all"]
    assert report["held_out_answers"] > 0 and 0 <= report["top1"] <= report["top3"] <= 1
    assert report["speculation"]["head_only"]["all"]["tokens_per_pass"] >= 1


def test_eval_medusa_heads_reports_each_heads_chains(gpu_recipe_run, tmp_path):
    run, output = gpu_recipe_run, tmp_path / "compare.json"
    make("eval-medusa-heads", WORK=str(run["work"] / "medusa-run"), HEADS=f"tiny={run['work'] / 'medusa-run' / 'medusa'}",
         EVAL_ARGS=f"--target {run['target']} --threads 1 --output {output}")
    report = json.loads(output.read_text())
    assert report["command"] and report["machine"]
    assert len(report["heads"]["tiny"]["top1_by_head"]) >= 1


def test_wire_bytes_reports_what_a_round_sends_below_the_dense_rows():
    """The default target and the shipped feature head, one prompt, a few tokens: every temperature's row
    and q are sent in fewer bytes than the dense float16 row and float32 ids."""
    import re

    lines = [line for line in make("wire-bytes", WIRE_ARGS="--limit 1 --tokens 4").splitlines() if line.startswith("T = ")]
    assert len(lines) == 3
    for line in lines:
        dense, sent, q_ids, q_sent = (float(x) for x in re.findall(r"([0-9.]+) KB", line))
        assert 0 < sent < dense and 0 < q_sent < q_ids, line


@pytest.mark.parametrize("old_target_only", [False, True])
def test_ab_gateways_compares_two_gateways_with_target_only(cluster, tmp_path, old_target_only):
    """Smoke mode: the same tiny gateway as both sides, one prompt, a few tokens; the report holds
    every mode's records and a ratio over target-only per mode, per kind and per repeat (with
    --old-target-only: over each side's own target-only, and the two target-only runs compared)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "category": "chat", "prompt": "hello world"}) + "\n")
    out = tmp_path / "ab.json"
    flag = " --old-target-only" if old_target_only else ""
    make("ab-gateways", AB_ARGS=f"--new {cluster.address} --old {cluster.address} --prompts {prompts} --limit 1 "
                                f"--repeats 1 --max-new-tokens 4 --output {out}{flag}")
    report = json.loads(out.read_text())
    assert report["command"].startswith("python scripts/ab_gateways.py") and report["machine"]["date"]
    modes = ["new", "old", "target_only"] + (["old_target_only"] if old_target_only else [])
    assert sorted(record["mode"] for record in report["records"]) == sorted(modes)
    assert all(record["tokens"] == 4 for record in report["records"])
    for mode in ("new", "old"):
        assert set(report["summary"][mode]["speedup"]) == {"all", "kind:chat", "repeat:0"}
        assert report["summary"][mode]["speedup"]["all"] > 0
    assert ("target_only_vs_old" in report["summary"]) == old_target_only


def test_sampled_coupling_reports_each_rule_s_kept_share(tmp_path):
    """`make sampled-coupling` on one prompt, a few tokens, the real default target and heads: every
    rule's kept share is a probability. On a known case: a race over one candidate keeps what the
    one-hot rule keeps (the same draft) within the noise of the races, a draft drawn from two
    candidates keeps Σ min(p, q), and a race over two keeps more than over one."""
    from scripts.sampled_coupling import kept_by_rules

    out = tmp_path / "coupling.json"
    make("sampled-coupling", COUPLING_ARGS=f"--limit 1 --tokens 6 --draws 8 --output {out}")
    report = json.loads(out.read_text())
    assert report["positions"] > 0 and report["command"].startswith("python scripts/sampled_coupling.py")
    assert all(0.0 <= value <= 1.0 for value in report["kept_at_position_1"].values())
    p = np.array([0.5, 0.3, 0.2])
    kept = kept_by_rules(p, np.array([1, 0]), np.array([0.6, 0.4]), 1.0, np.random.default_rng(0).exponential(size=(4000, 3)))
    assert kept["one_hot"] == 0.3 and abs(kept["race_top1"] - 0.3) < 0.03
    assert kept["drawn_top2"] == pytest.approx(0.3 + 0.4) and kept["race_top2"] > kept["race_top1"]


def test_pass_anatomy_times_kernels_and_sessions_on_a_tiny_model(tmp_path):
    """`make pass-anatomy` on a tiny model: attention's batch invariance reported, every kernel timed at each row count with its batch invariance,
    and each pass (sessions × positions) whole, without SDPA and without attention."""
    target = build_model(tmp_path / "target", seed=1)
    printed = make("pass-anatomy", ANATOMY_ARGS=f"--target {target} --rows 1 2 --sessions 1 2 --positions 3 --prompt 8 --repeats 1")
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    attention, products, sessions = lines[0]["attention"], lines[1]["products"], lines[2]["sessions"]
    assert set(attention) == {"own_length", "padded_to_key_blocks", "chain_rows_in_one_call", "one_row_over_200_keys_us"}
    assert set(products["ms"]) >= {"int4", "float32_rows", "int8"}
    assert all(set(by_rows) == {"1", "2"} and min(by_rows.values()) > 0 for by_rows in products["ms"].values())
    assert products["row_alone_equals_row_among_8"]["int4"] in (True, False)
    assert set(sessions["ms"]) == {"1x1", "2x1", "1x3"}
    assert all(set(parts) == {"whole", "no_sdpa", "no_attention"} for parts in sessions["ms"].values())


def test_graphed_pass_agrees_with_transformers_and_times_each_shape(tmp_path):
    """`make graphed-pass` eagerly on a tiny model: the flat engine's next tokens equal transformers',
    and every shape has its ragged and flat timings (the CUDA graph columns need a GPU: gpu-check)."""
    target = build_model(tmp_path / "target", seed=1)
    printed = make("graphed-pass", GRAPHED_ARGS=f"--device cpu --target {target} --context 32 --repeats 1")
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    assert result["agrees_with_transformers"] is True and "error" not in result, result
    assert set(result["shapes"]) == {"1x1", "1x4", "8x1", "8x4", "32x1", "prefill"}
    assert all(entry["flat_ms"] > 0 and entry["ragged_ms"] > 0 and "graphed_ms" not in entry for entry in result["shapes"].values())


def test_flat_fold_widths_times_the_ragged_pass_and_each_width(tmp_path):
    """`make flat-fold-widths` on a tiny model: every shape has the ragged pass's time, the flat pass's at
    each folded key width and, where specd's attention kernel runs, the flat pass's with it over its
    default store and over a float32 one."""
    from specd_engine import native as native_kernels, store_attention

    target = build_model(tmp_path / "target", seed=1)
    printed = make("flat-fold-widths", FOLD_ARGS=f"--target {target} --scale 0.25 --repeats 1")
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    assert len(result["ms"]) == 8 and result["machine"]["date"]
    native = set() if native_kernels.missing_cpu_flags(store_attention.CPU_FLAGS) or native_kernels.load()[0] is None else \
        {"flat_native", "flat_native_f32"}
    assert result["flat_native_store"] == ("bfloat16" if native else "")
    assert all(set(entry) == {"ragged", "flat_fold64", "flat_fold128", "flat_fold256"} | native and min(entry.values()) > 0
               for entry in result["ms"].values())


def test_int4_kernels_times_each_kernel_and_checks_a_row_alone_and_beside_others(tmp_path):
    """`make int4-kernels` on a tiny model: every shape timed with PyTorch's kernel and, where this machine
    runs them, specd's tiles on each instruction set; a row's logits the same alone and beside other sessions with each."""
    from specd_engine import int4_tiles

    target = build_model(tmp_path / "target", seed=1)
    printed = make("int4-kernels", INT4_ARGS=f"--target {target} --scale 0.1 --repeats 1")
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    kernels = {"torch"} | {f"tiles {isa}" for isa in int4_tiles.runnable_instruction_sets()}  # the tiles on each instruction set here
    assert result["tiles_unavailable"] == int4_tiles.unavailable() and result["same_alone_and_beside"] == dict.fromkeys(kernels, True)
    assert len(result["ms"]) == 8 and all(set(entry) == kernels and min(entry.values()) > 0 for entry in result["ms"].values())
    assert len(result["products_ms"]) == 5 and all(set(entry) == kernels for entry in result["products_ms"].values())
    assert result["tiles_instruction_set"] == int4_tiles.instruction_set()


def test_int4_inputs_compares_each_instruction_set_with_float32(tmp_path):
    """`make int4-inputs` on a tiny model: every instruction set the tiles run on here scored against the
    float32 model on the same tokens, agreement and KL in range; with --flat --prompt-attention, through flat
    passes, each instruction set once a prompt attention kernel where prompt rows take dot products here."""
    from specd_engine import int4_tiles, store_attention

    target = build_model(tmp_path / "target", seed=1)
    isas = int4_tiles.runnable_instruction_sets()
    for extra, variants in (("", isas), ("--flat --prompt-attention", [f"{isa}, prompt {kernel}" for isa in isas for kernel in store_attention.PROMPT_KERNELS]
                                         if store_attention.prompt_dots() else isas)):
        printed = make("int4-inputs", INPUTS_ARGS=f"--target {target} --prompt-ids 8 --limit 2 --tokens 4 {extra}")
        result = json.loads(printed[printed.index("{"):])
        assert result["positions"] == 8 and result["variants"] == variants and result["flat"] == bool(extra)
        assert set(result["vs_float32"]) == set(variants)
        assert all(0 <= entry["argmax_agreement"] <= 1 and entry["mean_kl"] >= 0 for entry in result["vs_float32"].values())


def test_heads_precision_times_and_compares_float32_and_int8_heads(tiny, tmp_path):
    """`make heads-precision` on the tiny target and random chained heads: a proposal timed after a pass in
    each precision for one row and four, and the two precisions' proposals compared on a greedy answer."""
    from tests.test_medusa import random_token_heads
    from verify_service.medusa import save_heads

    heads, _ = random_token_heads(tiny, chained=True)
    save_heads(heads, tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "category": "chat", "prompt": "hello world"}) + "\n")
    printed = make("heads-precision", HEADS_ARGS=f"--target {tiny.target} --heads {tmp_path / 'heads'} --prompts {prompts} "
                                                 f"--limit 1 --tokens 8 --repeats 1")
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    assert result["command"].startswith("python scripts/heads_precision.py") and result["machine"]["date"]
    from verify_service import native_heads

    compared = ("float32", "int8") + (() if native_heads.unavailable(heads) else ("native",))
    assert set(result["proposal_ms_after_a_pass"]) == {f"{rows} row(s), {way}" for rows in (1, 4) for way in compared}
    assert min(result["proposal_ms_after_a_pass"].values()) > 0
    agreement = result["agreement"]
    assert agreement["rows"] > 0 and len(agreement["int8_equals_float32_by_head"]) == len(heads.heads)
    assert all(0 <= share <= 1 for shares in agreement["top1_by_head"].values() for share in shares)
    assert set(agreement["chain_by_depth"]) == set(compared)  # a chain up to depth k never hits more often than head k alone
    assert all(chain <= top1 for way in compared for chain, top1 in zip(agreement["chain_by_depth"][way], agreement["top1_by_head"][way]))


def test_tracing_overhead_times_the_three_stacks():
    printed = make("tracing-overhead", TRACING_ARGS="--requests 1 --tokens 4")
    for mode in ("uninstrumented", "tracing off", "tracing on"):
        assert mode in printed, printed


def test_the_gpu_check_runs_its_tests_and_bench_on_the_cpu(tmp_path):
    """`make gpu-check` on the CPU: the gpu-marked tests on tiny models, then bench, one result file."""
    make("gpu-check", GPU_CHECK_ARGS=f"--device cpu --out {tmp_path}")
    [path] = tmp_path.glob("gpu_check-cpu-*.json")
    result = json.loads(path.read_text())
    assert result["tests"]["exit_code"] == 0 and " passed" in result["tests"]["summary"]
    assert 0 <= result["tests"]["measured"]["tiny_bfloat16_agreement"]["rate"] <= 1
    graphed = result["graphed_pass"]  # scripts/graphed_pass.py, eager on the CPU (its own test says what it holds)
    assert "error" not in graphed and "1x4" in graphed["shapes"], graphed
    assert result["bench"]["exit_code"] == 0 and result["bench_forward"] == "flat", result["bench"]["log_tail"]
    modes = result["bench"]["report"]["modes"]
    assert {"hf_target", "target_only"} <= set(modes), sorted(modes)
    assert result["machine"]["torch"] and result["machine"]["transformers"]
    assert any("aten::" in table for table in result["profiles"].values()), sorted(result["profiles"])


def test_the_eagle3_gpu_command_grows_the_corpus_trains_and_writes_three_files(tmp_path):
    """`make train-eagle3-gpu` on the CPU (tiny target): new corpus shards, a trained EAGLE-3 checkpoint that
    loads, and a summary with the rates a GPU run reports."""
    import tarfile

    from draft_service.eagle3_head import is_eagle3_checkpoint

    make("train-eagle3-gpu", OUT=str(tmp_path / "out"), EAGLE3_ARGS="--device cpu")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["corpus-new.tar", "eagle3-head.tar", "summary.json"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["corpus"]["answer_tokens_added"] > 0 and any(n.startswith("answers-") for n in summary["corpus"]["new_shards"])
    assert summary["train"]["steps"] > 0 and summary["train"]["answer_positions_per_s"] > 0
    assert len(summary["held_out_agreement_per_step"]["overall"]) == summary["train"]["ttt_passes"]
    with tarfile.open(tmp_path / "out" / "eagle3-head.tar") as archive:
        archive.extractall(tmp_path / "head", filter="data")
    assert is_eagle3_checkpoint(tmp_path / "head" / "eagle3-head")
