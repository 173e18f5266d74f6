# syntax=docker/dockerfile:1
# The model worker image: CUDA runtime, PyTorch and diffusers, the shared contract and the worker.
# Build from the repository root: docker build -f infra/docker/worker.Dockerfile .

ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# Both stages use the same base so the venv's interpreter path (/usr/bin/python3.11) exists at run time.
FROM ${CUDA_IMAGE} AS builder
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu 22.04 ships Python 3.11 in universe; no third-party apt repository is needed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
# requirements-worker.txt includes requirements.txt.
COPY requirements.txt requirements-worker.txt /tmp/
RUN /opt/venv/bin/pip install --no-compile -r /tmp/requirements-worker.txt

FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/var/cache/maas/huggingface \
    XDG_CACHE_HOME=/var/cache/maas/xdg \
    MAAS_WEIGHTS_CACHE_DIR=/var/cache/maas/weights \
    MAAS_WORKER_HEALTH_PORT=8081
RUN groupadd --system --gid 10001 maas \
    && useradd --system --uid 10001 --gid maas --no-create-home --shell /usr/sbin/nologin maas \
    && mkdir -p /var/cache/maas \
    && chown maas:maas /var/cache/maas
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY contract/ contract/
COPY model_worker/ model_worker/
USER 10001:10001
EXPOSE 8081
# Liveness only: /startupz can take minutes (weight download) and /readyz is 503 while draining.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MAAS_WORKER_HEALTH_PORT', '8081') + '/livez', timeout=3)"
# Exec form: the worker is PID 1, receives SIGTERM directly and drains for its models' longest drain_seconds.
CMD ["python", "-m", "model_worker"]
