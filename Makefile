# lmfs: the commands the README names. Each target sets up what it needs (a .venv with CPU torch).
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# Install torch first so the package's loose `torch>=2.4` never pulls a multi-GB CUDA build here.
TORCH_SPEC ?= torch==2.13.0
SCALE     ?= auto
DEVICE    ?= auto
ONLY      ?=
JOBS      ?= 2
TEST_SCALE ?= smoke

.PHONY: help venv lab test unit lectures clean-notebooks check-notebooks wheelhouse gpu-suite bench-tokenizer clean

help:
	@echo "make lab              JupyterLab on lectures/ (creates .venv on first use)"
	@echo "make test             unit tests + every notebook (nbval, smoke scale) + a papermill rerun"
	@echo "make lectures         run notebooks with papermill into build/ (SCALE=, DEVICE=, ONLY=)"
	@echo "make clean-notebooks  strip outputs from lectures/*.ipynb"
	@echo "make wheelhouse       download the wheels the GPU machine lacks into .wheelhouse/"
	@echo "make gpu-suite        on a GPU machine: GPU tests, notebooks at full scale, benchmarks -> \$$OUT"
	@echo "make bench-tokenizer  BPE training/encoding vs Hugging Face tokenizers and tiktoken"

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,lab]"
	touch $@

venv: $(BIN)/.installed

lab: venv
	$(BIN)/jupyter lab --allow-root --no-browser --ip=127.0.0.1 --notebook-dir=lectures

# Unit tests and notebooks together; pytest exit code 5 (nothing collected) is a failure.
# One intra-op thread per process: the xdist workers, the notebook kernels and the ranks that the
# parallel tests start share the cores; with torch's default of one thread per core each, they
# oversubscribe them (a smoke lecture took 140 s instead of 15 s next to the gloo tests).
test: venv
	@OMP_NUM_THREADS=1 LMFS_SCALE=$(TEST_SCALE) LMFS_DEVICE=$(DEVICE) $(BIN)/python -m pytest -n $(JOBS) --dist loadfile \
	  --nbval-lax --durations=15 -p no:cacheprovider tests lectures; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

unit: venv
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile -p no:cacheprovider tests

lectures: venv
	$(BIN)/python -m lmfs.lectures run --scale $(SCALE) --device $(DEVICE) --out build $(if $(ONLY),--only $(ONLY))

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

clean:
	rm -rf build .pytest_cache
