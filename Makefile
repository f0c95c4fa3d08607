# Two entry points for a new user: `make demo` and `make test` (`make lint`: ruff, as CI runs it).
# Both create .venv when missing. torch is pinned to the CPU build for this kind of machine;
# GPU users install gradsync with `pip install -e .` over their own torch (pyproject says torch>=2.4).
PY      := python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsync demo --out bench-out

# The ranks the tests start import gradsync anew, each process: compiled once here, not in every one
# of them (PYTHONDONTWRITEBYTECODE, where set, keeps each from writing what it compiled).
# TEST_WORKERS pytest processes share the machine (pytest-xdist): most tests wait on their ranks'
# timeouts and sockets as much as they compute; a test marked `alone` (it asserts a time) runs by
# itself (tests/conftest.py). A module's tests stay on one worker (--dist loadscope), so that its
# module-scoped fixtures (a bench run shared by its tests) run once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m compileall -q gradsync tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) bench-out
