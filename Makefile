# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install with the pinned constraints file.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.attnkit-installed
PIP     := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test fuzz bench benchmarks-md venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[model,viz,test]'
	touch $(STAMP)

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

clean:
	rm -rf $(VENV) attnkit-out
