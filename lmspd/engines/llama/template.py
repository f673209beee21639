"""Chat templates from GGUF metadata, rendered by lmspd with jinja2.

lmspd renders the prompt itself (not through llama-cpp-python's chat
wrappers) because the continuation cache needs the exact rendered text and
tokens of every turn. The environment mirrors Hugging Face's
``apply_chat_template`` so that templates written for it behave the same.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmspd.core.errors import ApiError

from .client_text import ClientText

# Used when a GGUF carries no template at all.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# A chat template file named on the command line (``--chat-template``): the
# largest real ones are tens of KiB.
MAX_TEMPLATE_FILE_BYTES = 1 << 20


def read_template_file(path: str | Path) -> str:
    """The template's source; a ``ValueError`` naming the file where it
    cannot be read, is over ``MAX_TEMPLATE_FILE_BYTES`` or is not UTF-8."""
    try:
        with Path(path).expanduser().open("rb") as f:
            raw = f.read(MAX_TEMPLATE_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read chat template {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TEMPLATE_FILE_BYTES:
        raise ValueError(f"chat template {path} is over {MAX_TEMPLATE_FILE_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template {path} is not UTF-8 text (byte {exc.start})") from None


class TemplateError(Exception):
    """The chat template itself refused the conversation (``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's tojson keeps non-ASCII text as is; templates rely on it.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Set by the engine from its vocabulary: how client strings are kept
        # from spelling control tokens (lmspd.engines.llama.client_text).
        self.client_text: ClientText | None = None

    @property
    def renders_tools(self) -> bool:
        """Whether the template knows about tools (HF ``tools`` convention)."""
        return "tools" in self.source and "tool_calls" in self.source

    @property
    def supports_system_role(self) -> bool:
        return "system" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError as exc:
            raise ApiError(
                "invalid_request", f"The model's chat template rejected the conversation: {exc}"
            ) from exc
        except jinja2.TemplateError as exc:
            raise ApiError(
                "invalid_request", f"The model's chat template failed on this conversation: {exc}"
            ) from exc
