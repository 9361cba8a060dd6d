# llamastream on an NVIDIA GPU: `docker build -t llamastream:0.1.0 .`
# The CUDA devel image, not the runtime one: PyCUDA (built from source here) compiles
# cuda_src/ with nvcc when the server starts, and caches the result.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 llamastream

WORKDIR /opt/llamastream
COPY requirements.lock pyproject.toml README.md ./
# Everything pinned: the server's lock, then PyCUDA with what it needs and the gateway
# (the gateway Deployment runs `smg launch` from this image too).
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps -r requirements.lock \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps pycuda==2026.1 pytools==2026.1.1 platformdirs==4.14.8 \
      mako==1.4.3 siphash24==1.9 smg==1.13.0 setproctitle==1.3.8
COPY protos protos
COPY engine engine
COPY server server
COPY llamastream llamastream
COPY cuda_src cuda_src
COPY cpu_src cpu_src
RUN /opt/venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
      protos/llamastream/v1/generation.proto \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation -e .

USER llamastream
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 50051 9090
ENTRYPOINT ["llamastream"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090"]
