"""`llamastream-client chat | generate | tokenize | info`: stream to the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from llamastream_client.client import Client, Completion, TextDelta


def _read(path: str | None) -> bytes | None:
    return open(path, "rb").read() if path else None


def _client(args: argparse.Namespace) -> Client:
    token = args.token or os.environ.get("LLAMASTREAM_TOKEN")
    if args.token_file:
        token = open(args.token_file).read().strip()
    return Client(args.target, token=token, tls=args.tls, root_certificates=_read(args.cacert),
                  client_cert=_read(args.cert), client_key=_read(args.key), timeout=args.timeout)


def _stream(client: Client, args: argparse.Namespace, **input_) -> int:
    fields = {k: v for k, v in dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                     seed=args.seed).items() if v is not None}
    for event in client.generate(stop=args.stop, **input_, **fields):
        if isinstance(event, TextDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Completion):
            sys.stdout.write("\n")
            u = event.usage
            print(f"[{event.finish_reason}] {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, "
                  f"first token {u.time_to_first_token_ms:.0f} ms, total {u.total_ms:.0f} ms", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llamastream-client", description="Talk to a llamastream server")
    p.add_argument("--target", default=os.environ.get("LLAMASTREAM_TARGET", "localhost:50051"), help="host:port")
    p.add_argument("--token", help="bearer token (or LLAMASTREAM_TOKEN)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--cacert", help="PEM roots to trust (implies TLS)")
    p.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key", help="PEM client key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each call, seconds")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("chat", "one user message, with the model's chat template"), ("generate", "raw text, no template")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("text")
        if name == "chat":
            c.add_argument("--system", help="a system message first")
        c.add_argument("--max-tokens", type=int)
        c.add_argument("--temperature", type=float)
        c.add_argument("--top-p", type=float)
        c.add_argument("--seed", type=int)
        c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    t = sub.add_parser("tokenize", help="token ids of a text")
    t.add_argument("text")
    sub.add_parser("info", help="the served model")
    args = p.parse_args(argv)
    try:
        with _client(args) as client:
            if args.command == "chat":
                messages = ([("system", args.system)] if args.system else []) + [("user", args.text)]
                return _stream(client, args, chat=messages)
            if args.command == "generate":
                return _stream(client, args, prompt=args.text)
            if args.command == "tokenize":
                print(json.dumps(client.tokenize(args.text)))
            else:
                print(json.dumps(MessageToDict(client.info()), indent=2))
            return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
