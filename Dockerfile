# One Batchfit replica. The bundled model (all-MiniLM-L6-v2) is baked in as a Python package;
# other models are mounted (e.g. -v ./models:/models:ro -e BATCHFIT_MODEL=/models/my-model).
# Settings come from the environment (BATCHFIT_*, see `batchfit serve --help`).
# GPU image: the default torch wheel from PyPI (CUDA). CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --user-group batchfit
WORKDIR /app

# torch first and on its own layer: it is by far the largest and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md constraints.txt ./
# Every package pyproject.toml installs: the `batchfit` command imports them all.
COPY batchfit ./batchfit
COPY server ./server
COPY batching ./batching
COPY models ./models
COPY generation ./generation
COPY bulk ./bulk
COPY bench ./bench
RUN pip install --constraint constraints.txt . && python -c "from models.loading import BUNDLED_MODEL, resolve_model_path; resolve_model_path(BUNDLED_MODEL)"

USER batchfit
ENV BATCHFIT_HOST=0.0.0.0 \
    BATCHFIT_PORT=8000
EXPOSE 8000 8001

# Ready means loaded and warmed up (503 before); the start period covers both.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('BATCHFIT_PORT', '8000'), timeout=2)"]

ENTRYPOINT ["batchfit", "serve"]
