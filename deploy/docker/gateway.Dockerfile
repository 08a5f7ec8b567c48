# syntax=docker/dockerfile:1
# specd gateway: the public GenerateService (gRPC) and the OpenAI-compatible HTTP API. CPU only: no torch, no transformers, no CUDA.
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t specd-gateway:dev .
# Run (model services elsewhere):
#   docker run -p 50051:50051 -e SPECD_VERIFY_ADDRESS=verify:50053 -e SPECD_DRAFT_ADDRESS=draft:50052 specd-gateway:dev
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first (cached layer): only what the gateway imports.
# Build extras, if any (the glob matches nothing in a plain build; pip-env.sh says what they are).
COPY deploy/docker/pip-env.sh .image-buil[d] /tmp/extra/
COPY deploy/docker/requirements-gateway.txt /tmp/requirements-gateway.txt
RUN . /tmp/extra/pip-env.sh && pip install -r /tmp/requirements-gateway.txt
# specd itself without its dependency resolution, so nothing (torch) sneaks in.
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
    && cd / && python -c "import gateway.app, sys; assert 'torch' not in sys.modules, 'gateway imports torch'" \
    && ! pip show torch >/dev/null 2>&1

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECD_HOST=0.0.0.0 \
    SPECD_PORT=50051 \
    SPECD_HTTP_PORT=8000 \
    SPECD_METRICS_PORT=9464
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin specd
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/specd/healthcheck.py
USER 10001:10001
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 CMD ["python", "/opt/specd/healthcheck.py"]
STOPSIGNAL SIGTERM
# Exec form: specd is PID 1 and gets SIGTERM itself (NOT_SERVING, then drain for SPECD_GRACE seconds).
ENTRYPOINT ["specd", "serve", "gateway"]
