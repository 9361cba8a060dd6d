# `make serve` and `make test` set up everything they need on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PORT   ?= 50051
MODEL  ?=
PROTO  := protos/llamastream/v1/generation.proto
STUBS  := llamastream/v1/generation_pb2.py llamastream/v1/generation_pb2_grpc.py

.PHONY: serve test gpu-test bench-cpu fixtures clean

serve: $(VENV)/.installed $(STUBS)
	$(BIN)/llamastream serve --port $(PORT) $(if $(MODEL),--model $(MODEL))

test: $(VENV)/.installed $(STUBS)
	$(BIN)/python -m pytest -q -ra tests

# Pinned, with --no-deps: the locks list every package, transitive ones included.
$(VENV)/.installed: requirements.lock requirements-test.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock -r requirements-test.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# Python stubs come from the .proto; they are never edited or committed.
$(STUBS) &: $(PROTO) $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)

# On a machine with an NVIDIA GPU and pycuda (see README): the CUDA backend's tests.
gpu-test:
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	$(PYTHON) -m pytest -q -ra -s tests/gpu

bench-cpu: $(VENV)/.installed $(STUBS)
	$(BIN)/python bench/cpu_decode.py

# Golden fixtures from Hugging Face transformers (needs torch; run by hand, then commit).
fixtures:
	$(PYTHON) tests/golden/make_fixtures.py

clean:
	rm -rf $(VENV) $(STUBS) llamastream/v1/generation_pb2.pyi
