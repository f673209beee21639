"""``lmspd serve`` and ``lmspd models``."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from lmspd import __version__
from lmspd.config import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmspd", description="A local model service (LMSP 1.0 and OpenAI Responses).")
    parser.add_argument("--version", action="version", version=f"lmspd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    serve.add_argument("--model", default=None, help="a served model id or a path to a .gguf file")
    serve.add_argument("--ctx", type=int, default=8192, help="context window in tokens (0 = the model's own)")
    serve.add_argument("--threads", type=int, default=None)
    serve.add_argument("--data-dir", type=Path, default=None)
    serve.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help="accept this bearer token (repeatable); required when not bound to loopback")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--max-queue", type=int, default=None,
                       help="requests that may wait for a busy model before 503 (default 32)")

    sub.add_parser("models", help="list the models lmspd can serve")

    args = parser.parse_args(argv)
    if args.command == "models":
        return _models()
    settings = Settings(
        host=args.host, port=args.port, model=args.model, ctx=args.ctx, threads=args.threads,
        api_keys=args.api_keys, log_level=args.log_level,
    )
    if args.data_dir is not None:
        settings.data_dir = args.data_dir.expanduser()
    if args.max_queue is not None:
        if args.max_queue < 0:
            parser.error("--max-queue must be >= 0")
        settings.limits = replace(settings.limits, queue=replace(settings.limits.queue, max_pending=args.max_queue))
    from lmspd.server import serve as run_server

    return run_server(settings)


def _models() -> int:
    from lmspd.engines.llama.models import BUNDLED, ModelNotFound, resolve_model

    for model_id in sorted(BUNDLED):
        try:
            _, path = resolve_model(model_id)
            print(f"{model_id}\t{path}")
        except ModelNotFound as exc:
            print(f"{model_id}\tnot installed ({exc})")
    print("Any other GGUF file can be served with: lmspd serve --model /path/to/model.gguf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
