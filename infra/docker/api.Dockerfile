# syntax=docker/dockerfile:1
# The API server image: Flask on gunicorn, the shared contract, and no torch.
# Build from the repository root: docker build -f infra/docker/api.Dockerfile .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install --no-compile -r /tmp/requirements.txt

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PORT=8080
RUN groupadd --system --gid 10001 maas \
    && useradd --system --uid 10001 --gid maas --no-create-home --shell /usr/sbin/nologin maas
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY contract/ contract/
COPY api_server/ api_server/
USER 10001:10001
EXPOSE 8080
# Cloud Run ignores HEALTHCHECK and probes /healthz itself; this serves `docker run` and compose.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PORT', '8080') + '/healthz', timeout=3)"
# Exec form: gunicorn is PID 1 and receives SIGTERM directly.
CMD ["gunicorn", "--config", "api_server/process/gunicorn_conf.py", "api_server.process.asgi:app"]
