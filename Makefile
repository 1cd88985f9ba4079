# bitps — every target creates .venv first if it is missing.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
DEMO_ARGS ?= --shards 2 --workers 2 --mode async --expect-loss-drop 0.3 -- --steps 300

.PHONY: venv demo test bench proto lint clean

venv: $(VENV)/.installed

# torch goes in first, pinned, so that no loose requirement pulls a multi-GB CUDA build;
# a torch that already imports (a GPU box) is kept.
$(VENV)/.installed: setup.cfg pyproject.toml
	@test -x $(VPY) || if $(PY) -c "import torch" 2>/dev/null; \
		then $(PY) -m venv --system-site-packages $(VENV); else $(PY) -m venv $(VENV); fi
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev]"
	@touch $@

demo: venv
	$(VENV)/bin/bitps-launch $(DEMO_ARGS)

test: venv
	$(VPY) -m pytest -q tests

bench: venv  # every scenario, results in bench/results (convergence takes about 5 minutes)
	$(VENV)/bin/bitps-bench pushpull; \
	$(VENV)/bin/bitps-bench volume; \
	$(VENV)/bin/bitps-bench codec; \
	$(VENV)/bin/bitps-bench overlap; \
	$(VENV)/bin/bitps-bench memory; \
	$(VENV)/bin/bitps-bench convergence

proto: venv
	$(VPY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/bitps.proto

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
