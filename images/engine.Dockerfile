# Pagoda engine for NVIDIA GPUs: `pagoda serve` / `pagoda route` with FlashInfer kernels.
# Build from the repository root:  docker build -f images/engine.Dockerfile -t pagoda/engine:dev .
#
# Versions match the GPU machines the engine's GPU tests run on (torch 2.11 + CUDA 13.0,
# flashinfer 0.6.18.post1). The base is the CUDA *devel* image on purpose: FlashInfer compiles a
# kernel variant it has no prebuilt cubin for on first use, which needs nvcc at run time.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG FLASHINFER_VERSION=0.6.18.post1

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pagoda \
    PATH=/opt/pagoda/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ninja-build ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/pagoda

# torch first and pinned (also as a constraint), so nothing later can swap in another build.
RUN echo "torch==${TORCH_VERSION}" > /opt/pagoda/constraints.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install --constraint /opt/pagoda/constraints.txt \
      "flashinfer-python==${FLASHINFER_VERSION}" "flashinfer-cubin==${FLASHINFER_VERSION}"

COPY engine/ /src/engine/
RUN pip install --constraint /opt/pagoda/constraints.txt /src/engine

# The user the operator's pods run as (runAsUser/runAsGroup 10001). The directories it writes on a
# read-only root filesystem, where the pods mount volumes (the model at /models, the caches at
# /var/cache/pagoda), are its own, so `docker run` without volumes works too. FlashInfer's JIT
# workspace defaults to /tmp (the operator's pods point it at their cache volume).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pagoda pagoda \
 && mkdir -p /models /var/cache/pagoda \
 && chown pagoda:pagoda /models /var/cache/pagoda
ENV FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer
USER 10001:10001
WORKDIR /home/pagoda
VOLUME ["/models"]
EXPOSE 8000

ENTRYPOINT ["pagoda"]
