# dadfl: coordinator and site in one image (`dadfl server ...`, `dadfl site ...`).
#
#   docker build -t dadfl:cpu .                                   # CPU (the default)
#   docker build -t dadfl:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .   # a GPU site
#
# BASE_IMAGE: any image with Python >= 3.10 and pip (a hospital's own hardened base).
# TORCH_INDEX_URL: the PyTorch wheel index (whl/cpu, whl/cu126, ...); the CUDA wheels bring
# their CUDA runtime, so the host needs only the NVIDIA driver and container toolkit
# (`docker run --gpus all ...`, or `gpus: all` in compose). TORCH_VERSION pins the build.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from the chosen index, so the project's torch requirement is already met
# and no resolver swaps in another build (the CPU one is about 2 GB smaller than CUDA's).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

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
