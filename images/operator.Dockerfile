# Pagoda operator (kopf): reconciles InferenceServices into engine workloads, router and monitoring.
# Build from the repository root:  docker build -f images/operator.Dockerfile -t pagoda/operator:dev .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The operator imports the engine's torch-free modules (pagoda_engine.config, .capabilities,
# .kv_tiers, .serve: the flags `pagoda serve` takes, their bounds, the features it runs), so that it
# checks a spec against the engine itself rather than a copy. --no-deps: those modules need only the
# standard library (tests/operator/test_engine_contract.py keeps it so); torch and the rest of the
# engine's dependencies belong to the engine's image.
COPY engine/ /src/engine/
COPY operator/ /src/operator/
RUN pip install --no-deps /src/engine \
 && pip install /src/operator \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent pagoda
USER 10001:10001
# kopf's liveness endpoint when started with --liveness=http://0.0.0.0:8080/healthz (the chart does).
EXPOSE 8080

ENTRYPOINT ["pagoda-operator", "run", "--all-namespaces"]
