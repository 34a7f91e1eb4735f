# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install with the pinned constraints file.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.attnkit-installed
PIP     := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test fuzz bench venv clean

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

bench: $(STAMP)
	$(BIN)/attnkit bench

clean:
	rm -rf $(VENV) attnkit-out
