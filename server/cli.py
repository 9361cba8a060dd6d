"""The `llamastream` command: `serve` and `convert-gguf`."""

from __future__ import annotations

import argparse
import logging
import re
import sys


from engine.backends import DEFAULT_TOKEN_BUDGETS, DEVICES
from engine.backends.base import CPU_ACTIVATIONS, KV_CACHE_DTYPES
from engine.scheduler import RESERVE_CLIP
from server import package_version
from server.app import MIN_MESSAGE_BYTES, ServerConfig
from server.log_format import LOG_FORMATS, configure_logging


def _number(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False, what: str = ""):
    """An argparse type: a `kind` within [low, high] ((low, high] if `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high) or value != value:  # (NaN)
            bounds = f"{'above' if low_open else 'at least'} {low:g}" if high is None else \
                f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {bounds}{what}")
        return value
    return parse


PORT = _number(int, 0, 65535, what=" (0: any free port)")
POSITIVE = _number(int, 1)


def _serve_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    p.add_argument("--port", type=PORT, default=d.port, help=f"port (default {d.port})")
    p.add_argument("--device", choices=DEVICES, default=d.device,
                   help="cuda; cpu (our compiled kernels, the weights as stored); numpy (the float32 reference); or "
                        "auto: cuda when a GPU and pycuda are present, else cpu, else (no C compiler) numpy")
    p.add_argument("--threads", type=POSITIVE,
                   help="threads a CPU backend's step runs on (default: the cores this process may use)")
    p.add_argument("--cpu-activations", choices=CPU_ACTIVATIONS, default=d.cpu_activations,
                   help="what the CPU backend's products of quantized weights quantize activations to, in blocks of "
                        "32: int16 (within ~1e-5 of float32: the numpy backend's tokens) or int8 (llama.cpp's "
                        "choice: 1.1-1.3x as fast; SmolLM2's perplexity unchanged, but near ties turn) "
                        f"(default {d.cpu_activations})")
    p.add_argument("--max-num-seqs", type=POSITIVE, default=d.max_num_seqs, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: "
                        + ", ".join(f"{n} on {backend}" for backend, n in DEFAULT_TOKEN_BUDGETS.items()) + ")")
    p.add_argument("--max-waiting", type=_number(int, 0), default=d.max_waiting,
                   help="requests queued beyond --max-num-seqs before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--block-size", type=_number(int, 1, 1024), default=d.block_size,
                   help="tokens per KV-cache block (on the GPU a power of two, at least 4)")
    p.add_argument("--num-kv-blocks", type=POSITIVE, help="KV-cache blocks (default: as many as --kv-cache-memory-gb holds)")
    p.add_argument("--kv-cache-memory-gb", type=_number(float, 0, low_open=True), default=d.kv_cache_memory_gb,
                   help="memory for the KV cache on the CPU")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="what K and V are stored in: auto (float32 on the CPU, bfloat16 on the GPU) or fp8 (e4m3, "
                        "a quarter of float32's bytes, half of bfloat16's; over the checkpoint's calibrated "
                        "k_scale/v_scale where it has them)")
    p.add_argument("--gpu-memory-utilization", type=_number(float, 0, 1, low_open=True), default=d.gpu_memory_utilization,
                   help="fraction of the GPU's memory this server may use (each its own share, where replicas "
                        "share a GPU); the KV cache takes what the weights leave")
    p.add_argument("--enforce-eager", action="store_true",
                   help="launch every kernel from Python: no CUDA graphs for decode steps")
    p.add_argument("--batch-invariant", action="store_true",
                   help="compute each token exactly as it would be alone, whatever else runs in its batch "
                        "(reproducible seeded and greedy outputs; slower GEMMs on the GPU)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full, even where a cached prefix of it is in the KV cache")
    p.add_argument("--output-reserve", type=_number(float, 0, 1), default=d.output_reserve,
                   help="admit a request only while the KV cache also holds this fraction of every running "
                        f"request's remaining max_tokens (at most {RESERVE_CLIP} each): 0 fills the cache and preempts "
                        "when outputs outgrow it; 1 never preempts requests that run to their max_tokens")
    p.add_argument("--engine-in-process", dest="engine_process", action="store_false",
                   help="step the engine on a thread of the server's process instead of a process of its own "
                        "(one Python GIL for both: slower under many streams, simpler to debug or profile)")
    p.add_argument("--max-model-len", type=POSITIVE, help="context length (default: the model's, within the KV cache)")
    p.add_argument("--quantization", choices=["fp8"],
                   help="quantize the layers' weights at load: fp8 (e4m3, a scale per output row); quantized "
                        "checkpoints (AWQ, GPTQ, FP8, compressed-tensors) load as they are without it")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization: quantize the head too (the embedding, where the head is tied to it)")
    p.add_argument("--max-grammar-bytes", type=POSITIVE, default=d.max_grammar_bytes,
                   help="the largest structured-output constraint (JSON schema, regex, grammar or choices) a request "
                        f"may send, in bytes (default {d.max_grammar_bytes}); compiling one is bounded by llguidance's "
                        "own limits")
    p.add_argument("--grace", type=_number(float, 0, 3600), default=d.grace,
                   help="seconds in-flight streams get to finish on SIGTERM")
    p.add_argument("--max-stream-backlog", type=POSITIVE, default=d.max_stream_backlog,
                   help="tokens a client may leave unread before its stream ends with RESOURCE_EXHAUSTED")
    p.add_argument("--max-message-bytes", type=_number(int, MIN_MESSAGE_BYTES, 2**31 - 1), default=d.max_message_bytes,
                   help="largest request or response message")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--auth-token-file", help="file holding a bearer token every call must carry ('authorization: Bearer <token>')")
    p.add_argument("--auth-health-and-reflection", action="store_true",
                   help="with --auth-token-file: require the token for health checks and reflection too")
    p.add_argument("--log-prompts", action="store_true", help="log each request's prompt (never logged otherwise)")
    p.add_argument("--metrics-port", type=PORT,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, and /healthz and /readyz")
    p.add_argument("--metrics-label", dest="metrics_labels", action="append", type=_label, default=[],
                   metavar="NAME=VALUE", help="a label every metric carries (repeatable): `gateway --gpus` gives each "
                                              "replica gpu=ITS_GPU")
    p.add_argument("--vllm-metric-names", action="store_true",
                   help="also give the gauges gateways read under vLLM's names (vllm:num_requests_running, "
                        "vllm:num_requests_waiting, vllm:kv_cache_usage_perc), for the Gateway API Inference Extension")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text (one line a record, control characters escaped) or json (one object a line)")


def _label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE with a Prometheus label name (letters, digits "
                                         "and _, not starting with a digit or __)")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `llamastream` (and of the deployment manifests' containers)."""
    parser = argparse.ArgumentParser(prog="llamastream", description="Streaming gRPC inference for Llama-architecture models")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub.add_parser("serve", help="serve a model over gRPC"))
    gateway = sub.add_parser("gateway", help="N replicas of `serve` and the Shepherd Model Gateway in front (OpenAI API)",
                             description="Start --replicas servers on consecutive ports from --grpc-port and the "
                                         "Shepherd Model Gateway (smg) in front of them on --port; restart a replica "
                                         "that exits. Options after -- go to every `serve`.")
    gateway.add_argument("--replicas", type=POSITIVE, help="servers to start (default 2, or one per GPU of --gpus)")
    gateway.add_argument("--gpus", help="all, or GPU indices (0,1,...): one replica per GPU, each seeing only its own "
                                        "(CUDA_VISIBLE_DEVICES) and labelling its metrics gpu=INDEX")
    gateway.add_argument("--replica-metrics-port", type=PORT,
                         help="replica i serves its Prometheus metrics on this port + i (default: none)")
    gateway.add_argument("--host", default="0.0.0.0", help="address of the OpenAI endpoint (default 0.0.0.0)")
    gateway.add_argument("--port", type=PORT, default=8000, help="port of the OpenAI endpoint (default 8000)")
    gateway.add_argument("--grpc-port", type=PORT, default=50051, help="the first replica's port (default 50051)")
    gateway.add_argument("--model", help="a Hugging Face directory or a GGUF file (default: the embedded model)")
    gateway.add_argument("--policy", default="cache_aware", help="the gateway's routing policy (default cache_aware)")
    gateway.add_argument("--gateway-metrics-port", type=PORT, default=29000,
                         help="port of the gateway's own Prometheus metrics (default 29000)")
    gateway.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then options for every `serve`")
    convert = sub.add_parser("convert-gguf", help="write a GGUF model as a Hugging Face directory")
    convert.add_argument("gguf", help="input .gguf file")
    convert.add_argument("out_dir", help="output directory")
    return parser


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The settings of a parsed `serve` command line."""
    return ServerConfig(**{k: v for k, v in vars(args).items() if k in ServerConfig.__dataclass_fields__})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))

    if args.command == "convert-gguf":
        from engine.model_loader import convert_gguf
        from server.app import LoadingProgress

        try:
            print(f"wrote {convert_gguf(args.gguf, args.out_dir, LoadingProgress('converting'))}")
        except (FileNotFoundError, ValueError, OSError) as e:
            logging.getLogger("llamastream").error("convert-gguf: %s", e)
            return 1
        return 0

    if args.command == "gateway":
        from server.gateway import ReplicaSet, model_directory, replica_gpus

        try:
            serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
            gpus = replica_gpus(args.gpus, args.replicas)
            return ReplicaSet(len(gpus) if gpus else args.replicas or 2, args.grpc_port, args.host, args.port,
                              model_directory(args.model), serve_args, args.policy, args.gateway_metrics_port, gpus,
                              args.replica_metrics_port).run()
        except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
            logging.getLogger("llamastream").error("gateway: %s", e)
            return 1

    from server.app import Server

    try:
        server = Server(serve_config(args))
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        logging.getLogger("llamastream").error("%s", e)
        return 1
    return server.run_until_signal()


if __name__ == "__main__":
    sys.exit(main())
