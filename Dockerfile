# dadfl: coordinator and site in one image (`dadfl server ...`, `dadfl site ...`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The CPU build of torch first, so the project's torch requirement does not pull a CUDA
# build (about 2 GB smaller). For GPU sites, build FROM an image with CUDA torch instead.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.14"

COPY pyproject.toml README.md ./
COPY dadfl dadfl
COPY strategies strategies
COPY workloads workloads
COPY protos protos
COPY server server
COPY client client
RUN pip install . && useradd --create-home --uid 1000 dadfl && mkdir -p /app/state && chown dadfl /app/state

USER dadfl
ENTRYPOINT []
CMD ["dadfl", "--help"]
