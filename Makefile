# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install with the pinned constraints file.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.attnkit-installed
PIP     := $(BIN)/pip install --disable-pip-version-check --progress-bar on -c constraints.txt

# Where torch comes from (tools/install-torch.sh; a torch already in the venv is always kept):
#   TORCH=auto (default)  a wheel in WHEEL_DIR; else the CPU-only index when no NVIDIA GPU is found
#                         (never the CUDA stack on a CPU-only machine); else PyPI's CUDA build
#   TORCH=cpu | cuda | local | installed   force one source (installed: only check)
#   e.g.  make test TORCH=cuda      make demo TORCH_INDEX=https://download.pytorch.org/whl/cu126
TORCH         ?= auto
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
WHEEL_DIR     ?= /opt/wheels
export TORCH TORCH_VERSION TORCH_INDEX WHEEL_DIR

.PHONY: demo test docs fuzz bench benchmarks-md venv clean

$(STAMP): pyproject.toml constraints.txt tools/install-torch.sh
	@echo "==> [1/3] virtualenv $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "==> [2/3] torch $(TORCH_VERSION) (TORCH=$(TORCH))"
	CONSTRAINTS=constraints.txt bash tools/install-torch.sh $(BIN)/python
	@echo "==> [3/3] attnkit and its extras: model, viz, test"
	$(PIP) -e '.[model,viz,test]'
	touch $(STAMP)
	@echo "==> ready: $(VENV)"

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The differential fuzz test with 10x the examples (the default profile runs in `make test`).
fuzz: $(STAMP)
	ATTNKIT_FUZZ=long $(BIN)/python -m pytest -q tests/test_fuzz.py

# The small default set (about a minute on 2 cores); prints a table, writes nothing.
bench: $(STAMP)
	$(BIN)/attnkit bench

# The full suite (tens of minutes), then rewrite ONLY the generated section of BENCHMARKS.md
# (between the attnkit-bench markers); hand-written sections are kept byte for byte.
# Re-render from saved results without measuring: $(BIN)/python benchmarks/update_md.py benchmarks/results.json
benchmarks-md: $(STAMP)
	$(BIN)/attnkit bench --full --json benchmarks/results.json
	$(BIN)/python benchmarks/update_md.py benchmarks/results.json BENCHMARKS.md

# The documentation site (MkDocs, strict: a warning is an error) into site/; `make test` builds it too.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) attnkit-out site
