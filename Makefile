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

.PHONY: serve test clients gpu-test gpu-bench bench-cpu fixtures clean

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

# On a machine with an NVIDIA GPU: every GPU benchmark of bench/RESULTS.md, one after
# another, output in $(BENCH_OUT) (a random Llama 3.2 1B-shaped model is written there too).
BENCH_OUT ?= bench/out
gpu-bench:
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)
	mkdir -p $(BENCH_OUT)
	$(PYTHON) -c "import pathlib; from devtools.checkpoints import LLAMA_32_1B, make_model; \
	  make_model(pathlib.Path('$(BENCH_OUT)/llama-1b-random'), LLAMA_32_1B, seed=0)"
	$(PYTHON) bench/latency.py | tee $(BENCH_OUT)/latency.txt
	$(PYTHON) bench/engine_throughput.py | tee $(BENCH_OUT)/engine_throughput.txt
	$(PYTHON) bench/engine_throughput.py --batch-invariant --no-transformers | tee $(BENCH_OUT)/engine_throughput_invariant.txt
	$(PYTHON) bench/profile_step.py | tee $(BENCH_OUT)/profile_step.txt
	$(PYTHON) bench/decode_attention.py | tee $(BENCH_OUT)/decode_attention.txt
	$(PYTHON) bench/prefill_attention.py --torch | tee $(BENCH_OUT)/prefill_attention.txt
	$(PYTHON) bench/serve.py --model $(BENCH_OUT)/llama-1b-random --device cuda --vocab 128000 --num-prompts 256 \
	  --max-concurrency 16,64,256 --server-arg=--max-num-seqs=256 --server-arg=--max-num-batched-tokens=8192 \
	  --result-json $(BENCH_OUT)/serve.json --plot $(BENCH_OUT)/serve.png | tee $(BENCH_OUT)/serve.txt
	$(PYTHON) bench/paged_vs_contiguous.py --device cuda --model $(BENCH_OUT)/llama-1b-random --kv-cache-gb 4 \
	  | tee $(BENCH_OUT)/paged_vs_contiguous.txt
	$(PYTHON) bench/profile_server.py --model $(BENCH_OUT)/llama-1b-random --device cuda --max-num-seqs 256 \
	  --max-num-batched-tokens 8192 2>/dev/null | tee $(BENCH_OUT)/profile_server.txt

# CPU decode against llama.cpp on the same GGUF files (bench/cpu_decode.py). llama.cpp comes
# from llama-cpp-python, built from source into its own .venv-bench (the server's and the
# tests' environment stay as they are) with this CPU's instruction set and OpenMP, never from pip's
# cache (which may hold another CPU's build); the build takes about 10 minutes on two cores.
# Without AMX: on the Intel Xeon machines, its AMX products die of SIGILL (tilezero in
# ggml_backend_amx_mul_mat, though AMX works there), which would leave llama.cpp without its
# other repacked weights too. BENCH_ARGS goes to the script.
BENCH_VENV := .venv-bench
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
BENCH_ARGS ?=
bench-cpu: $(VENV)/.installed $(STUBS) $(BENCH_VENV)/.installed
	$(BIN)/python bench/cpu_decode.py --llama-cpp-python $(BENCH_VENV)/bin/python $(BENCH_ARGS)

$(BENCH_VENV)/.installed: bench/requirements-llama-cpp.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
	  -c bench/requirements-llama-cpp.txt scikit-build-core pathspec packaging
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON" CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" nice $(BENCH_VENV)/bin/python -m pip install -q \
	  --disable-pip-version-check --no-deps --no-build-isolation --no-binary llama-cpp-python --no-cache-dir \
	  -r bench/requirements-llama-cpp.txt
	touch $@

# Golden fixtures from Hugging Face transformers (needs torch; run by hand, then commit).
fixtures:
	$(PYTHON) tests/golden/make_fixtures.py

clean:
	rm -rf $(VENV) $(STUBS) $(CLIENT_STUBS) llamastream/v1/generation_pb2.pyi clients/python/llamastream/v1/generation_pb2.pyi \
	  clients/node/node_modules clients/go/build
