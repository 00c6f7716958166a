# swarmloco image: the `swarmloco` console script (peer, coordinator, swarm, status). CPU by default.
#
#   docker build -t swarmloco:cpu .
#   docker compose up --build --scale peer=4          (see docker-compose.yml and docs/docker.md)
#
# GPU variant (same file, different torch wheel). PyTorch's CUDA wheels bundle the CUDA runtime and cuDNN as pip
# packages, so the base image can stay python:3.11-slim: the host only needs the NVIDIA driver and the NVIDIA
# Container Toolkit, and the container must be given a GPU (`docker run --gpus all ...`, or the `peer-gpu` service
# in docker-compose.yml, which reserves one with deploy.resources.reservations.devices).
#
#   docker build -t swarmloco:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Pick the cuXXX index that matches your driver and that has a torch 2.13.0 wheel (https://download.pytorch.org/whl/torch/).
# If you would rather start from an NVIDIA CUDA base image (e.g. to add packages that link against a system CUDA),
# it has no Python 3.11, so install it first, e.g.:
#   FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
#   RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
#       && python3.11 -m venv /opt/venv && rm -rf /var/lib/apt/lists/*
#   ENV PATH=/opt/venv/bin:$PATH
# and keep the rest of this file unchanged.
#
# hivemind 1.1.12 ships its p2pd daemon only in an x86_64 (manylinux) wheel: on arm64 hosts (Apple Silicon, Graviton)
# build and run with `--platform linux/amd64` (emulated, slow).

FROM python:3.11-slim

# CPU wheel by default; override for a CUDA build (see above).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the PyTorch index: a plain `pip install .` would pull the multi-GB CUDA build from PyPI.
# 2.13.0+cpu (or +cuXXX) satisfies the project's `torch==2.13.0` pin, so the next step keeps it.
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/swarmloco
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY peer ./peer
COPY coordinator ./coordinator
COPY swarmloco ./swarmloco
RUN pip install . \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__" \
    && swarmloco --help > /dev/null

# Unprivileged user. Named volumes mounted on /data (coordinator database + DHT identity) and /bootstrap (the
# coordinator's ready file, read by peers) start out with this ownership.
RUN useradd --create-home --uid 1000 swarm \
    && mkdir -p /data /bootstrap /work \
    && chown swarm:swarm /data /bootstrap /work
USER swarm
WORKDIR /work

# 8000: coordinator HTTP API and dashboard; 31337: libp2p/DHT (coordinator bootstrap node and peers).
EXPOSE 8000 31337

CMD ["swarmloco", "--help"]
