# lmfs: the commands the README names. Each target sets up what it needs in .venv on first use.
#
# What `make venv` (and so lab, test, lectures, book ...) installs into .venv:
#   1. torch, before the package, by scripts/install_torch.sh (read it for the whole rule):
#      with an NVIDIA GPU (nvidia-smi lists one) PyPI's torch==2.13.0, the CUDA build; on Linux
#      without one the CPU build from PyTorch's CPU index, or, where that index cannot be reached,
#      whatever pip's configured indexes offer (a local CPU wheel where pip has one in its
#      find-links, else PyPI's CUDA build); on macOS/Windows PyPI's wheel (CPU/MPS).
#      Override with TORCH_SPEC=... (what) and TORCH_INDEX=URL (where from).
#   2. the package with its `test` and `lab` extras (pyproject.toml); torch>=2.4 there is a loose
#      bound, so the torch from step 1 stays.
# `make test-browser` adds the `browser` extra (Playwright) and needs Debian's Chromium.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
SCALE     ?= auto
DEVICE    ?= auto
ONLY      ?=
JOBS      ?= 2
TEST_SCALE ?= smoke
# The executed notebooks `make book` renders (the output folder of `make lectures`, or of the GPU
# suite's lectures step: build/gpu-lectures).
BOOK_FROM ?= build
CHROMIUM  ?= /usr/bin/chromium

.PHONY: help venv lab test unit test-browser lectures book clean-notebooks check-notebooks \
        check-lectures wheelhouse gpu-suite bench-tokenizer clean

help:
	@echo "make lab              JupyterLab on lectures/ (creates .venv on first use)"
	@echo "make test             unit tests + every notebook (nbval, smoke scale) + a papermill rerun"
	@echo "make unit             unit tests only (tests/)"
	@echo "make test-browser     JupyterLab in headless Chromium: open every lecture, run lecture 01"
	@echo "                      through the UI, move a control of every explorer; screenshots in"
	@echo "                      build/browser/ (needs: apt-get install chromium)"
	@echo "make lectures         run notebooks with papermill into build/ (SCALE=, DEVICE=, ONLY=, JOBS= at a time)"
	@echo "make book             executed notebooks in BOOK_FROM (default build/) -> HTML site in build/book/"
	@echo "make check-lectures  each lecture at smoke with one fault planted in lmfs (lmfs/faults.py): it must fail (ONLY=)"
	@echo "make clean-notebooks  strip outputs from lectures/*.ipynb"
	@echo "make check-notebooks  list notebooks not stored clean (outputs, kernel, parameters cell)"
	@echo "make wheelhouse       download the wheels the GPU machine lacks into .wheelhouse/"
	@echo "make gpu-suite        on a GPU machine: GPU tests, notebooks at full scale, book, benchmarks -> \$$OUT"
	@echo "make bench-tokenizer  BPE training/encoding vs Hugging Face tokenizers and tiktoken"
	@echo "make venv             create .venv (torch build chosen as the Makefile's header says)"
	@echo "make clean            remove build outputs (build/, pytest caches)"

$(BIN)/.installed: pyproject.toml scripts/install_torch.sh
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX="$(TORCH_INDEX)" bash scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test,lab]"
	touch $@

venv: $(BIN)/.installed

$(BIN)/.installed-browser: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[browser]"
	touch $@

lab: venv
	$(BIN)/jupyter lab --allow-root --no-browser --ip=127.0.0.1 --notebook-dir=lectures

# Unit tests and notebooks together; pytest exit code 5 (nothing collected) is a failure.
# One intra-op thread per process: the xdist workers, the notebook kernels and the ranks that the
# parallel tests start share the cores; with torch's default of one thread per core each, they
# oversubscribe them (a smoke lecture took 140 s instead of 15 s next to the gloo tests).
# The browser test has its own target (it runs a lecture in a browser, alone).
# The run gets a private, empty TMPDIR, and fails if anything is left in it afterwards besides the
# caches of pytest (pytest-of-USER, its tmp_path folders) and of torch.compile (torchinductor_USER):
# every test and every lecture removes the temporary folders it makes. The folder itself goes.
test: venv
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/lmfs-make-test-XXXXXX") || exit 1; \
	TMPDIR=$$tmp OMP_NUM_THREADS=1 LMFS_SCALE=$(TEST_SCALE) LMFS_DEVICE=$(DEVICE) $(BIN)/python -m pytest -n $(JOBS) --dist loadfile \
	  --nbval-lax --durations=15 -p no:cacheprovider -m "not browser" tests lectures; \
	rc=$$?; \
	left=$$(cd "$$tmp" && for f in * .[!.]*; do [ -e "$$f" ] || continue; \
	  case "$$f" in pytest-of-*|torchinductor_*) ;; *) echo "$$f";; esac; done); \
	rm -rf "$$tmp"; \
	if [ -n "$$left" ]; then echo "make test left these in its private TMPDIR (each test and lecture must remove its temporary files):"; \
	  echo "$$left" | sed 's/^/  /'; [ $$rc -eq 0 ] && rc=1; fi; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

unit: venv
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile -p no:cacheprovider -m "not browser" tests

# Fails (instead of skipping) when Chromium is missing: this target exists to run the test.
test-browser: $(BIN)/.installed-browser
	@test -x $(CHROMIUM) || { echo "make test-browser needs Debian's Chromium at $(CHROMIUM):"; \
	  echo "  sudo apt-get update && sudo apt-get install -y chromium"; \
	  echo "(or CHROMIUM=/path/to/chromium; Playwright's own browser download is not used)"; exit 1; }
	@LMFS_CHROMIUM=$(CHROMIUM) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider -m browser -rs \
	  tests/test_browser.py; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no browser test: failing"; exit 1; fi; exit $$rc

# A mistyped SCALE stops make at once with one line, before .venv is set up or a kernel starts.
ifneq ($(filter lectures,$(MAKECMDGOALS)),)
ifeq ($(filter $(SCALE),smoke full auto),)
$(error SCALE=$(SCALE) is not a scale: use SCALE=smoke (minutes on a CPU), SCALE=full (a GPU) or SCALE=auto)
endif
endif

lectures: venv
	$(BIN)/python -m lmfs.lectures run --scale $(SCALE) --device $(DEVICE) --out build $(if $(ONLY),--only $(ONLY)) $(if $(JOBS),--jobs $(JOBS))

book: venv
	$(BIN)/python -m lmfs.lectures book --from $(BOOK_FROM) --out build/book

# Proves the lectures' checks bite: each runs at smoke scale against a copy of lmfs with one planted
# fault (the list is lmfs/faults.py) and must fail; prints lecture | fault | caught | seconds.
check-lectures: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m lmfs.faults $(if $(ONLY),--only $(ONLY))

clean-notebooks: venv
	$(BIN)/python -m lmfs.lectures clean

check-notebooks: venv
	$(BIN)/python -m lmfs.lectures check

wheelhouse:
	$(PY) scripts/wheelhouse.py .wheelhouse

gpu-suite:
	bash scripts/gpu_suite.sh

bench-tokenizer: venv
	$(BIN)/python -m lmfs.benchmarks bpe

# Build outputs only: .venv and .wheelhouse/ stay (remove them by hand to rebuild from scratch).
clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
