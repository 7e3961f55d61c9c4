# Every install step lives here: a fresh machine needs only `make example` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OPS := $(VENV)/.deepspeed-cpu-ops
# DeepSpeed's CPU ops, compiled into its package at install (DS_BUILD_*: see the $(OPS) rule)
CPU_OPS := cpu_adam deepspeed_shm_comm fused_adam
# The environment's own tools first (its `ninja` builds DeepSpeed's ops: see syncpoint.workers.training.device.use_environment_ninja).
export PATH := $(abspath $(BIN)):$(PATH)
# DeepSpeed's JIT-built CPU ops, per environment: torch keys its build by the compile command, which
# names this venv's paths, so two checkouts sharing ~/.cache/torch_extensions (a CI clone beside a
# working tree) rebuild each other's ops, minutes each, on every switch.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
# mypy's incremental cache beside the environment it checks against, not in the checkout: a fresh clone
# with .venv in place (CI's) checks only what changed, seconds instead of the 45 s of a cold `make lint`.
export MYPY_CACHE_DIR ?= $(abspath $(VENV))/mypy_cache
# Bytecode is written (beside the sources, ignored by git) whatever the shell says: with
# PYTHONDONTWRITEBYTECODE set, every pytest process rewrote and compiled every test module again
# (4.5 s of each collection's 14 s) and every process a test starts compiled syncpoint's modules.
unexport PYTHONDONTWRITEBYTECODE
# How many of the slowest tests each half lists (`make test DURATIONS=0`: all of them).
DURATIONS ?= 5
# pytest-xdist workers for the half without Ray: its tests mostly wait (for spawned ranks, a lease, a
# subprocess's line), so three fill two cores (docs/testing.md has the times).
JOBS ?= 3
# The Ray clusters the tests start run their workers at the tests' own priority (see two_halves).
test test-all test-storm test-fast test-slow coverage: export RAY_worker_niceness = 0

.PHONY: venv example lint test test-all test-storm test-fast test-slow test-gpu coverage bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	# the bench extra's peers: P14's DLRover without pynvml, the deprecated shim it depends on, whose
	# presence makes every `import torch` warn (torch.cuda imports it; DLRover's flash checkpoint needs
	# none of it on CPU), and P15's TorchFT, whose dependencies (torch, OpenTelemetry) are here already
	$(BIN)/python -m pip install -q --no-deps "dlrover==0.6.*" "Deprecated>=1.2" "torchft==0.2.*"
	# bench P11's peer (and its test): MosaicML Streaming without its own conflicting pins (pyproject.toml)
	$(BIN)/python -m pip install -q --no-deps "mosaicml-streaming==0.13.*" "brotli>=1.1" "python-snappy>=0.7" "cramjam>=2.8" \
		"zstd>=1.5" "catalogue>=2.0"
	touch $(STAMP)

# DeepSpeed's CPU ops compiled into its package (its DS_BUILD_* install), not JIT-built by the first
# run: a JIT build is keyed by its compile command, which names the venv's absolute paths, so every
# copy of .venv at another path (CI's clone) rebuilt them during the tests (cpu_adam alone made one
# offload test take 125 s there, 7 s here). A compiled op is imported from site-packages wherever the
# venv lives. DeepSpeed loads it only for the accelerator it was built for: on a GPU, ops JIT-build
# as before. Reinstalled with the ops whenever a reinstall left DeepSpeed without them.
$(OPS): $(STAMP)
	$(BIN)/python -c "import sys; from deepspeed.git_version_info import installed_ops as o, accelerator_name as a; \
		sys.exit(a != 'cpu' or not all(o.get(n) for n in '$(CPU_OPS)'.split()))" >/dev/null 2>&1 || \
	DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 DS_BUILD_FUSED_ADAM=1 \
		$(BIN)/python -m pip install -q --no-deps --force-reinstall --no-build-isolation --no-cache-dir \
		"deepspeed==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
	touch $(OPS)

venv: $(OPS)

example: $(OPS)
	$(BIN)/syncpoint run examples/tiny_lm.yaml

# Lint, types and the docs first (seconds with a warm cache): the layer contract is a test, style and
# types are these, and the site builds with no broken link, anchor or API reference (into site/, ignored).
lint: $(OPS)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/codespell
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# Two pytest runs side by side: the tests that start a Ray cluster, one after another (two
# clusters at once on a 2-core machine starve each other's workers into meaningless timeouts), and
# everything else on JOBS xdist workers, filling the Ray tests' waits. Every process at the same
# priority, Ray's workers included (Ray starts them at nice 15 unless RAY_worker_niceness says
# otherwise): with the other half at nice 19 to spare Ray's workers, the whole suite yielded to any
# other busy process and took twice as long on a loaded machine. The Ray half's output follows the
# other's; either failing fails the target. The Ray half collects only $(2): make test's Ray tests
# all live in tests/ray/ (tests/conftest.py refuses one elsewhere); the other half collects $(3), not
# the directories none of whose tests it would run (every test in tests/ray/ is `ray`, every one in
# tests/drills/ `long`: their modules import Ray Train and more in each of its processes).
define two_halves
	@log=$$(mktemp); $(BIN)/python -m pytest -q --durations=$(DURATIONS) -m "ray $(1)" $(2) > $$log 2>&1 & ray=$$!; \
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=$(DURATIONS) -m "not ray $(1)" $(3); rest=$$?; \
	wait $$ray; ray_rc=$$?; echo "--- the tests that start Ray (-m ray):"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$ray_rc -eq 0
endef

# The README's test command: every test except those marked `long` (whole-job drills, the storm, the
# 200/150-example property runs: each re-walks, at a larger size, a path a shorter test here covers).
test: lint
	$(call two_halves,and not long,tests/ray,tests --ignore=tests/ray --ignore=tests/drills)

# The whole suite, `long` and the storm drill included: the run before resolving an issue that
# touches a `long` path. (CI's .ci/run calls `make test`, the README's command.) Two streams side by
# side: the Ray tests outside tests/ray/ (the drills, the storms, the benches' quick runs on Ray), one
# after another; and everything without Ray on JOBS xdist workers, then tests/ray/ one after another
# (its clusters would otherwise wait for the drills' to end). Every Ray test is in exactly one of them.
test-all: lint
	@log=$$(mktemp); $(BIN)/python -m pytest -q --durations=$(DURATIONS) -m ray --ignore=tests/ray tests > $$log 2>&1 & drills=$$!; \
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=$(DURATIONS) -m "not ray" tests; rest=$$?; \
	echo "--- the tests that start Ray in tests/ray/:"; $(BIN)/python -m pytest -q --durations=$(DURATIONS) -m ray tests/ray; ray=$$?; \
	wait $$drills; drills_rc=$$?; echo "--- the other tests that start Ray (the drills, the storms, the benches on Ray):"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$ray -eq 0 && test $$drills_rc -eq 0

# Line and branch coverage of the production code (coverage.py, pyproject's [tool.coverage]) over both
# halves of `make test`, every process a test starts included; the figure is docs/testing.md's, and it
# fails below pyproject's fail_under.
coverage: $(OPS)
	rm -rf .coverage-data && mkdir -p .coverage-data
	@log=$$(mktemp); $(BIN)/coverage run -m pytest -q -p no:cacheprovider -m "ray and not long" tests/ray > $$log 2>&1 & ray=$$!; \
	$(BIN)/coverage run -m pytest -q -n $(JOBS) --dist worksteal -m "not ray and not long" tests --ignore=tests/ray --ignore=tests/drills; rest=$$?; \
	wait $$ray; ray_rc=$$?; echo "--- the tests that start Ray (-m ray):"; grep -E "^(FAILED|ERROR) " $$log; tail -n 5 $$log; rm -f $$log; \
	$(BIN)/coverage combine -q; $(BIN)/coverage report --sort=cover > $$log; cover=$$?; tail -n 25 $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$ray_rc -eq 0 && test $$cover -eq 0

# The storm tests alone (also part of test-all).
test-storm: $(OPS)
	$(BIN)/python -m pytest -q -m storm tests

# The fast tests start no Ray cluster, so two xdist workers split them freely.
test-fast: $(OPS)
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests

test-slow: $(OPS)
	$(BIN)/python -m pytest -q -m slow tests

# On a GPU machine: exact resume on CUDA (bf16, ZeRO-2, NCCL). DeepSpeed picks its accelerator at import.
test-gpu: $(OPS)
	DS_ACCELERATOR=cuda $(BIN)/python -m pytest -q -m gpu tests/integration/workers/training/test_device_gpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache site .coverage-data
