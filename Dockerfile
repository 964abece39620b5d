# syntax=docker/dockerfile:1
#
# The control-plane image: one image for the operator (`tensorfleet run`), the
# router the operator deploys per InferenceService (`tensorfleet router`) and
# the CPU-only engine simulator (`tensorfleet sim`), so it installs the
# `control-plane` extra: operator + router + sim + fast (uvloop). It also
# carries the engine launcher as a zipapp (contract.LAUNCHER_BUNDLE_PATH) that
# GPU engine pods' init container copies into any vLLM image; the `worker`
# extra (nvidia-ml-py) is installed so the image can bundle it.
#
# Build from the repository root:
#   docker build -t ghcr.io/tensorfleet/tensorfleet:0.1.0 .
# (the tag is contract.CONTROL_PLANE_IMAGE; the chart's image.tag defaults to it)
# Without Docker, images/build-control-plane builds the same image from Debian
# packages (mmdebstrap + umoci); images/README.md.

# Pinned Python 3.11 slim base (Debian bookworm), never `latest`.
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm

# ---- builder: builds the wheel and every dependency's wheel --------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Build tools live only in this stage (uvloop and friends ship manylinux wheels;
# the compiler is here for the platforms where they do not).
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY operator/ ./operator/
RUN python -m pip wheel --wheel-dir /wheels ".[control-plane,worker]"

# ---- final: runtime only, no compilers, no pip cache ----------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-index --find-links /wheels "tensorfleet[control-plane,worker]" \
    && python -m tensorfleet.worker.bundle /opt/tensorfleet/launcher.pyz \
    && python -m pip uninstall -y pip \
    && tensorfleet --help >/dev/null \
    && python /opt/tensorfleet/launcher.pyz --help >/dev/null

# Numeric non-root user: runAsNonRoot can verify it, and the router Deployment
# the operator renders runs as this uid with a read-only root filesystem.
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080 9090 9443
ENTRYPOINT ["tensorfleet"]
CMD ["--help"]
