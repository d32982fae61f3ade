# kiln — the two commands a newcomer runs are `make demo` and `make test`.
# Both create .venv and install into it; nothing but Python 3.11 is assumed.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
PYTEST_ARGS ?=
# The slowest tests of each run are listed at its end, so a run's time can be read, not guessed.
DURATIONS ?= --durations=20
# make test's worker processes (pytest-xdist): each test file runs whole in one worker; 1 runs in this process.
TEST_WORKERS ?= 2

.PHONY: install test test-slow lint crds demo bench gpu-check gpu-wheels clean cluster cluster-down cluster-bins

# -I / -P: never put the repo root on sys.path, where operator/ would shadow the
# standard library's `operator` module (docs/architecture.md: why the folder keeps that name).
$(BIN)/python:
	$(PY) -I -m venv $(VENV)
	$(BIN)/python -P -m pip install -q --upgrade pip

# torch goes in first and alone, pinned: the package only asks for torch>=2.4, which it satisfies, so nothing
# upgrades it. Where the index has a CPU build of 2.13.0 that is what comes; PyPI's is the CUDA build, which
# runs on the CPU but does not import without its CUDA libraries, so pip brings them (.venv ~6 GB).
$(STAMP): pyproject.toml bench/pyproject.toml cluster/pyproject.toml | $(BIN)/python
	$(BIN)/python -P -m pip install -q torch==2.13.0
	$(BIN)/python -P -m pip install -q -e ".[all,test]" -e ./bench -e ./cluster
	$(BIN)/python -P -m pip check
	touch $@

install: $(STAMP)

# import-linter walks one package folder, but kiln's components live in their own
# folders (docs/architecture.md), so the contracts run over a copy laid out as installed.
LINT_TREE := .kiln-work/lint
lint: install
	$(BIN)/ruff check .
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)
	cp -r kiln $(LINT_TREE)/kiln
	cp -r operator $(LINT_TREE)/kiln/operator
	cp -r engine $(LINT_TREE)/kiln/engine
	cp -r builder_job $(LINT_TREE)/kiln/builder
	cp -r serving_image $(LINT_TREE)/kiln/serving
	cp -r bench $(LINT_TREE)/kiln_bench
	cd $(LINT_TREE) && PYTHONPATH=. $(CURDIR)/$(BIN)/lint-imports --config $(CURDIR)/.importlinter

# The suite and, beside it, the real-cluster suite (tests/cluster: one control plane for the session, kiln
# installed with helm; it mostly waits on builds and pods, so it fills the main suite's idle time). Its pytest
# runs at nice 10; its daemons and pods, each in a session of its own, share the CPU with the main suite
# about equally where Linux groups sessions (docs/local-cluster.md, "In make test"). Its output follows the
# main suite's. The control plane's first build overlaps the Python install
# (-j2): on a new machine that is the cold run's longest step (docs/local-cluster.md); later runs find both
# cached.
CLUSTER_LOG := .kiln-work/cluster-suite.log
test:
	$(MAKE) --no-print-directory -j2 install cluster-bins
	$(MAKE) --no-print-directory lint
	@mkdir -p .kiln-work; nice -n 10 $(BIN)/python -P -m pytest -q $(PYTEST_ARGS) tests/cluster > $(CLUSTER_LOG) 2>&1 & \
	cluster=$$!; \
	$(BIN)/python -P -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(DURATIONS) $(PYTEST_ARGS) tests --ignore=tests/cluster; \
	main=$$?; wait $$cluster; real=$$?; \
	echo "--- the real-cluster suite (tests/cluster, log $(CLUSTER_LOG)) ---"; cat $(CLUSTER_LOG); \
	test $$main -eq 0 -a $$real -eq 0

test-slow: install
	$(BIN)/python -P -m pytest -q -m slow $(PYTEST_ARGS) tests

crds: install
	$(BIN)/kiln crd --out crds/llmengines.serving.kiln.dev.yaml
	$(BIN)/kiln crd --kind LLMEnginePool --out crds/llmenginepools.serving.kiln.dev.yaml
	cp crds/llmengines.serving.kiln.dev.yaml crds/llmenginepools.serving.kiln.dev.yaml helm/kiln/crds/

demo: install
	$(BIN)/python examples/demo.py

# The quoted figures use one torch thread for every system: on a shared 2-core
# machine a second OpenMP thread mostly measures the neighbours (docs/performance.md).
BENCH_ARGS ?= --repeats 3 --threads 1
bench: install
	$(BIN)/kiln bench $(BENCH_ARGS)

# The GPU checks (docs/gpu.md): on a machine with a CUDA device they install kiln over that machine's own
# torch and triton, run the GPU tests, the kernels' compile check and the GPU bench, and write one report;
# on any other host they print a "no CUDA device" line and exit 0. GPU_PY: the Python that has the CUDA torch.
GPU_PY ?= $(shell command -v python3 || echo $(PY))
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# The wheels gpu-check installs from where the GPU machine has no network (carry .kiln-work/gpu-wheels with
# the checkout): kiln's pure-Python needs for each Python in GPU_PYTHONS, less torch, triton and numpy,
# which the machine's CUDA torch brings (about 50 MB).
GPU_PYTHONS ?= 3.11 3.12 3.13
GPU_WHEELS := .kiln-work/gpu-wheels
gpu-wheels: install
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python -P bench/gpu_check.py --requirements > $(GPU_WHEELS)/requirements.txt
	for v in $(GPU_PYTHONS); do $(BIN)/python -P -m pip download -q -d $(GPU_WHEELS) --only-binary=:all: \
		--python-version $$v --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -r $(GPU_WHEELS)/requirements.txt || exit 1; done
	rm -f $(GPU_WHEELS)/numpy-*.whl
	du -sh $(GPU_WHEELS)

# The local Kubernetes control plane (docs/local-cluster.md): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, helm and LeaderWorkerSet's controller built from their Go modules (pinned in
# cluster/versions.env, cached under ~/.cache/kiln/cluster: the first build took 33 minutes on 2 busy cores),
# then started on this machine with a node agent that runs pods as local processes, and moto's S3.
CLUSTER_DIR := .kiln-work/cluster
# Go's usual home is added to PATH: a non-interactive shell (CI) may not have it.
GO_PATH_ENV := PATH="$$PATH:/usr/local/go/bin"
cluster-bins:
	$(GO_PATH_ENV) bash cluster/build.sh $(CLUSTER_DIR)/bin

cluster: install cluster-bins
	$(BIN)/python -P -m kiln_cluster up --dir $(CLUSTER_DIR)

cluster-down:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -P -m kiln_cluster down --dir $(CLUSTER_DIR); fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
