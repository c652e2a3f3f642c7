# The fedweave image: every `fedweave` command (server, client, site, certs, run, ...) and torchrun.
#
#   docker build -t fedweave:0.1.0 .                       CPU torch 2.13.0 (the default)
#   docker build -t fedweave:0.1.0-cuda \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#                                                           CUDA torch; its wheels carry the CUDA libraries
#   docker build --build-arg BASE_IMAGE=REGISTRY/cuda-python:TAG ...
#                                                           any base with python3 >= 3.10 as `python3`
#   docker build --build-arg EXTRAS=grpc,prometheus,mlflow ...
#                                                           the extras installed (default grpc)
#
# The user's own modules (a strategy, a dataset, a model a config names by import path) go into an
# image derived from this one: `fedweave deploy image --code DIR --extras LIST --out CONTEXT`.
# Two stages: the build stage installs the pinned project (pyproject.toml, the EXTRAS)
# into a virtual environment; the runtime stage copies only that environment and runs as a
# non-root user. See docs/deployment.md (Kubernetes).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=grpc
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/fedweave
COPY pyproject.toml README.md ./
COPY src ./src
# torch==2.13.0 is pinned in pyproject.toml; the torch index serves its CPU (or CUDA) build of it.
RUN /opt/fedweave/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" ".[${EXTRAS}]" \
    && /opt/fedweave/bin/fedweave --version

FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/fedweave/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --gid 10001 fedweave \
    && useradd --uid 10001 --gid fedweave --no-log-init --create-home --shell /usr/sbin/nologin fedweave \
    && mkdir -p /var/lib/fedweave \
    && chown fedweave:fedweave /var/lib/fedweave
COPY --from=build /opt/fedweave /opt/fedweave
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
WORKDIR /var/lib/fedweave
ENTRYPOINT ["fedweave"]
CMD ["--help"]
