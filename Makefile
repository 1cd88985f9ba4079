# bitps — every target creates .venv first if it is missing.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
DEMO_ARGS ?= --shards 2 --workers 2 --mode async --expect-loss-drop 0.3 -- --steps 300

.PHONY: venv demo test bench bench-quick proto lint clean

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

bench: venv  # every scenario, then bench/results/REPORT.md (the e2e runs take hours on 2 cores)
	$(VENV)/bin/bitps-bench all

bench-quick: venv  # every scenario at smoke-test size, under bench/results/quick (minutes)
	$(VENV)/bin/bitps-bench all --quick

# The stubs must import as bitps.proto.*: compile from a staging tree laid out as installed.
# onebit.proto is 1-bit Adam's own section of the wire (messages only, no service).
proto: venv
	rm -rf build/proto && mkdir -p build/proto/bitps/proto && cp proto/bitps.proto proto/onebit.proto build/proto/bitps/proto/
	$(VPY) -m grpc_tools.protoc -Ibuild/proto --python_out=build/proto --pyi_out=build/proto \
		--grpc_python_out=build/proto bitps/proto/bitps.proto
	$(VPY) -m grpc_tools.protoc -Ibuild/proto --python_out=build/proto --pyi_out=build/proto \
		bitps/proto/onebit.proto
	cp build/proto/bitps/proto/bitps_pb2.py build/proto/bitps/proto/bitps_pb2.pyi \
		build/proto/bitps/proto/bitps_pb2_grpc.py build/proto/bitps/proto/onebit_pb2.py \
		build/proto/bitps/proto/onebit_pb2.pyi proto/

.PHONY: docs
docs: venv  # docs/configuration.md from the settings tables and parsers of every program
	$(VPY) docs/gen_configuration.py

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
