"""``lmspd render``: the prompt lmspd would feed a model for a request body.

The body (a file, or stdin) is read and decoded as its route reads it (the
same size limit, strict JSON, the dialect's decoding and errors), then
prepared as the engine prepares it, over the GGUF's vocabulary alone
(``engines.llama.render``). The prompt goes to stdout exactly as the model
reads it (special tokens as their text), a summary to stderr; ``--json``
prints one object with both and the token ids. For a model that answers
differently here than under another server: compare the prompts (llama.cpp's
server shows its own at ``POST /apply-template``).

The model is ``--model``'s (the body's ``model`` is not looked up). What
only a running server holds is not there: stored history
(``previous_response_id``, ``conversation``: refused), the KV it would
continue, reasoning it sealed (stays sealed), and compaction (a compaction
trigger or a ``context_management`` threshold runs the model: not run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, BinaryIO

from lmspd.core.limits import DEFAULT_LIMITS

# The body's protocol: the route it would be sent to, and its decoder's
# module (imported by ``run`` alone: the other commands need none of them).
DIALECTS: dict[str, tuple[str, str]] = {
    "responses": ("POST /v1/responses", "openai_responses"),
    "lmsp": ("POST /lmsp/v1/responses", "lmsp"),
    "chat": ("POST /v1/chat/completions", "chat_completions"),
    "messages": ("POST /v1/messages", "anthropic_messages"),
}


def add_parser(sub: Any) -> None:
    from lmspd.engines.llama.fit import AUTO_MIN_WINDOW

    render = sub.add_parser("render", help="print the prompt a model would be fed for a request body "
                                           "(reads the model's vocabulary only)")
    render.add_argument("body", nargs="?", default="-", help="a file with the JSON request body (default: stdin)")
    render.add_argument("--model", default=None,
                        help="as for serve: a bundled model id, a .gguf path or a name `lmspd models` lists "
                             "(default: the bundled model)")
    render.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                        help="also look for .gguf files below DIR")
    render.add_argument("--dialect", choices=list(DIALECTS), default="responses",
                        help="the body's protocol: " + ", ".join(f"{k} ({v[0]})" for k, v in DIALECTS.items()))
    render.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the GGUF's own (as for serve)")
    render.add_argument("--ctx", default="auto", metavar="N|auto",
                        help="the context window the prompt must fit, as serve's --ctx, rounded up to a multiple "
                             "of 256 as llama.cpp pads a server's (truncation: auto cuts it to fit; default auto: "
                             f"the model's trained length, or {AUTO_MIN_WINDOW} where it was trained shorter, "
                             "without serve's fitting to memory: a server may have fitted a shorter one, "
                             "GET /v1/models says; 0 = the trained length)")
    render.add_argument("--keep-billing-header", action="store_true", help="as for serve")
    render.add_argument("--keep-tool-order", action="store_true", help="as for serve")
    render.add_argument("--json", action="store_true",
                        help="print one JSON object: the prompt's text, its token ids and the summary")


def run(args: argparse.Namespace) -> int:
    import importlib

    from lmspd.bodies import decode_body
    from lmspd.core.errors import ApiError
    from lmspd.engines.llama.discovery import Roots
    from lmspd.engines.llama.models import ModelNotFound, resolve_model
    from lmspd.engines.llama.preparation import Repairs
    from lmspd.engines.llama.render import PromptRenderer
    from lmspd.engines.llama.template import read_template_file
    from lmspd.engines.specs import parse_ctx

    limits = DEFAULT_LIMITS.request
    try:
        ctx = parse_ctx(args.ctx)
    except ValueError as exc:
        return _refuse(str(exc))
    name = "stdin" if args.body == "-" else args.body
    try:
        if args.body == "-" and sys.stdin is None:
            raise OSError(0, "closed", name)
        raw = _read(sys.stdin.buffer if args.body == "-" else None, name, limits.max_body_bytes)
        template = read_template_file(args.chat_template) if args.chat_template else None
        model_id, path = resolve_model(args.model, Roots.default(args.models_dir.expanduser()
                                                                 if args.models_dir else None))
    except OSError as exc:
        return _refuse(f"{exc.filename or name}: {exc.strerror or exc}")
    except (ValueError, ModelNotFound) as exc:  # the template file's, or the model's name
        return _refuse(str(exc))
    route, module = DIALECTS[args.dialect]
    decode = importlib.import_module(f"lmspd.dialects.{module}").decode_request
    try:
        conversation = decode(decode_body(raw, [], limits), limits).conversation
    except ApiError as exc:
        if exc.code in ("previous_response_not_found", "conversation_not_found"):
            return _refuse(f"{exc.message} Stored history lives in a running server: "
                           "render takes a body that holds the whole conversation.")
        return _refuse(f"{route} would refuse it ({exc.code}): {exc.message}")
    try:
        renderer = PromptRenderer(model_id, path, chat_template=template, n_ctx=ctx, limits=limits,
                                  repairs=Repairs(strip_billing_header=not args.keep_billing_header,
                                                  canonical_tool_order=not args.keep_tool_order))
    except (ValueError, OSError) as exc:  # a file llama.cpp cannot load, a template that does not compile
        return _refuse(f"{path}{f' with {args.chat_template}' if args.chat_template else ''}: {exc}")
    try:
        prepared = renderer.prepare(conversation)
    except ApiError as exc:
        return _refuse(f"{route} would refuse it ({exc.code}): {exc.message}")
    finally:
        renderer.close()
    text = renderer.text
    summary = {
        "model": model_id, "path": str(path), "dialect": args.dialect, "template": text.template_origin,
        "tool_format": text.tool_format.name, "reasoning": text.reasoning is not None, "window": renderer.n_ctx,
        "input_tokens": len(prepared.tokens), "max_output_tokens": prepared.max_new_tokens,
        "grammar": prepared.grammar is not None,
    }
    if args.json:
        print(json.dumps({**summary, "text": prepared.text, "tokens": prepared.tokens}, ensure_ascii=False))
        return 0
    sys.stdout.write(prepared.text)
    sys.stdout.flush()
    print(f"\n-- {model_id}: {len(prepared.tokens)} tokens of a {renderer.n_ctx}-token window; "
          f"template {text.template_origin}, tool calls as {text.tool_format.name}"
          f"{', reasoning' if text.reasoning else ''}"
          f"{', a grammar constrains the reply' if prepared.grammar else ''}", file=sys.stderr)
    return 0


def _read(stream: BinaryIO | None, name: str, limit: int) -> bytes:
    if stream is None:
        with open(name, "rb") as f:
            raw = f.read(limit + 1)
    else:
        raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise OSError(0, f"the body is over {limit} bytes, the most a route accepts", name)
    return raw


def _refuse(message: str) -> int:
    print(f"lmspd render: {message}", file=sys.stderr)
    return 2
