# syntax=docker/dockerfile:1
# specd verify: the target model (VerifyService), on one NVIDIA GPU.
# Build from the repository root:
#   docker build -f deploy/docker/verify.Dockerfile -t specd-verify:dev .
# Run (the model is a Hugging Face hub id, a folder or a GGUF file, from SPECD_MODEL):
#   docker run --gpus 1 -p 50053:50053 -e SPECD_MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct \
#     -v specd-models:/models specd-verify:dev
# CUDA_IMAGE and TORCH_VERSION go together: the torch wheel from PyPI carries its CUDA libraries,
# the base image gives the CUDA user-space and the driver-compatibility check (NVIDIA_REQUIRE_CUDA).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first (the CUDA build, pinned), then the rest: nothing later can swap torch.
RUN pip install "torch==${TORCH_VERSION}"
COPY deploy/docker/requirements-model.txt /tmp/requirements-model.txt
RUN pip install -r /tmp/requirements-model.txt
WORKDIR /src
COPY pyproject.toml README.m[d] ./
COPY protos ./protos
COPY specd_common ./specd_common
COPY gateway ./gateway
COPY draft_service ./draft_service
COPY verify_service ./verify_service
COPY specd_app ./specd_app
RUN pip install --no-deps .

FROM ${CUDA_IMAGE}
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
    SPECD_DEVICE=cuda \
    SPECD_MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/specd/healthcheck.py
VOLUME ["/models"]
USER 10001:10001
EXPOSE 50053 9464
# Loading a model takes minutes: the health check only counts after start-period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["python", "/opt/specd/healthcheck.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["specd", "serve", "verify"]
