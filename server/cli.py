"""The `llamastream` command: `serve` and `convert-gguf`."""

from __future__ import annotations

import argparse
import logging
import sys

from server.app import ServerConfig
from server.log_format import LOG_FORMATS, configure_logging


def _serve_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="cuda, cpu (the numpy backend), or auto: cuda when a GPU and pycuda are present")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="requests queued beyond --max-num-seqs before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (default: as many as --kv-cache-memory-gb holds)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb, help="memory for the KV cache on the CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of the GPU's memory the server may use; the KV cache takes what the weights leave")
    p.add_argument("--enforce-eager", action="store_true",
                   help="launch every kernel from Python: no CUDA graphs for decode steps")
    p.add_argument("--batch-invariant", action="store_true",
                   help="compute each token exactly as it would be alone, whatever else runs in its batch "
                        "(reproducible seeded and greedy outputs; slower GEMMs on the GPU)")
    p.add_argument("--engine-in-process", dest="engine_process", action="store_false",
                   help="step the engine on a thread of the server's process instead of a process of its own "
                        "(one Python GIL for both: slower under many streams, simpler to debug or profile)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's, within the KV cache)")
    p.add_argument("--grace", type=float, default=d.grace, help="seconds in-flight streams get to finish on SIGTERM")
    p.add_argument("--max-stream-backlog", type=int, default=d.max_stream_backlog,
                   help="tokens a client may leave unread before its stream ends with RESOURCE_EXHAUSTED")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="largest request or response message")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--auth-token-file", help="file holding a bearer token every call must carry ('authorization: Bearer <token>')")
    p.add_argument("--auth-health-and-reflection", action="store_true",
                   help="with --auth-token-file: require the token for health checks and reflection too")
    p.add_argument("--log-prompts", action="store_true", help="log each request's prompt (never logged otherwise)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text (one line a record, control characters escaped) or json (one object a line)")


def _check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("port", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_model_len",
                 "max_stream_backlog", "max_message_bytes"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamastream", description="Streaming gRPC inference for Llama-architecture models")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub.add_parser("serve", help="serve a model over gRPC"))
    convert = sub.add_parser("convert-gguf", help="write a GGUF model as a Hugging Face directory")
    convert.add_argument("gguf", help="input .gguf file")
    convert.add_argument("out_dir", help="output directory")
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))

    if args.command == "convert-gguf":
        from engine.model_loader import convert_gguf
        from server.app import LoadingProgress

        print(f"wrote {convert_gguf(args.gguf, args.out_dir, LoadingProgress('converting'))}")
        return 0

    _check_positive(parser, args)
    from server.app import Server

    cfg = ServerConfig(**{k: v for k, v in vars(args).items() if k in ServerConfig.__dataclass_fields__})
    try:
        server = Server(cfg)
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        logging.getLogger("llamastream").error("%s", e)
        return 1
    return server.run_until_signal()


if __name__ == "__main__":
    sys.exit(main())
