# `make serve` and `make test` set up everything they need on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PORT   ?= 50051
MODEL  ?=
PROTO  := protos/llamastream/v1/generation.proto
STUBS  := llamastream/v1/generation_pb2.py llamastream/v1/generation_pb2_grpc.py
CLIENT_STUBS := $(addprefix clients/python/,$(STUBS))
# Debian's packages for the Go client, built offline (clients/go/build.sh)
GO_DEBS := golang-go protobuf-compiler golang-google-grpc-dev protoc-gen-go-grpc golang-google-protobuf-dev \
           golang-github-golang-protobuf-1-5-dev

.PHONY: serve test clients gpu-test bench-cpu fixtures clean

serve: $(VENV)/.installed $(STUBS)
	$(BIN)/llamastream serve --port $(PORT) $(if $(MODEL),--model $(MODEL))

test: $(VENV)/.installed $(STUBS) $(CLIENT_STUBS) clients
	$(BIN)/python -m pytest -q -ra tests

# The Node.js and Go clients, for their tests. Without a reachable package manager the
# build says so and goes on; the tests then skip with the reason (and fail under CI).
clients: clients/node/node_modules/.installed clients/go/build/llamastream-chat

clients/node/node_modules/.installed: clients/node/package.json clients/node/package-lock.json
	(cd clients/node && npm ci --no-audit --no-fund --silent && touch node_modules/.installed) > clients/node/npm.log 2>&1 \
	  || echo "npm could not install the Node.js client's packages: see clients/node/npm.log"

clients/go/build/llamastream-chat: clients/go/main.go clients/go/build.sh $(PROTO)
	@dpkg -s $(GO_DEBS) > /dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq $(GO_DEBS)) > clients/go/apt.log 2>&1 || echo "apt-get could not install $(GO_DEBS): see clients/go/apt.log"
	clients/go/build.sh > clients/go/build.log 2>&1 || echo "the Go client did not build: see clients/go/build.log"

# Pinned, with --no-deps: the locks list every package, transitive ones included.
$(VENV)/.installed: requirements.lock requirements-test.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock -r requirements-test.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . -e clients/python
	touch $@

# Python stubs come from the .proto; they are never edited or committed.
$(STUBS) &: $(PROTO) $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)

$(CLIENT_STUBS) &: $(PROTO) $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=clients/python --pyi_out=clients/python \
	  --grpc_python_out=clients/python $(PROTO)

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
	rm -rf $(VENV) $(STUBS) $(CLIENT_STUBS) llamastream/v1/generation_pb2.pyi clients/python/llamastream/v1/generation_pb2.pyi \
	  clients/node/node_modules clients/go/build
