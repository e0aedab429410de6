# Every target sets itself up on a fresh machine (Python 3.11, no GPU, no conda).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

# pip installs without compiling (--no-compile): byte-compiling every file of torch, triton,
# plotly and jupyter took as long as the rest of the install, and a run imports a fraction of
# them. Python writes the bytecode of what it imports instead, unless PYTHONDONTWRITEBYTECODE
# is set, so it is kept from the commands here.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: test reproduce lab

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch, pinned: a bare torch requirement would pull a multi-GB CUDA build.
	# One resolve with the package; the pip that venv brings is recent enough for both.
	$(VENV)/bin/python -m pip install -q --no-compile torch==2.13.0 -e '.[test]'
	touch $(STAMP)

# In parallel (pytest-xdist, one worker per core); tests/conftest.py groups the tests that share
# a fixture wider than one test onto one worker.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n auto --dist loadgroup

reproduce: $(STAMP)
	$(VENV)/bin/python -m xstage_lab reproduce --backend auto --out out

# The workbench: JupyterLab on the notebooks (run them top to bottom; `backend` picks live or replay).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/
