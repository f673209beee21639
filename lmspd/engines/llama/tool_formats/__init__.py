"""Tool-call syntaxes: which one a model speaks, how to render it, how to parse it.

A model learned one way to call tools; its chat template shows which.
``detect_tool_format(chat_template)`` picks a ``ToolFormat``:

``hermes``   Qwen2.5, Qwen3, Hermes 2 Pro/3 and alike::

                 <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>

             one block per call, results in ``<tool_response>`` blocks.
``llama3``   Llama 3.1+: ``{"name": "get_weather", "parameters": {...}}`` at
             the start of the reply, or anywhere after ``<|python_tag|>``.
``mistral``  ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``; the
             v11 templates (``[ARGS]``) use ``[TOOL_CALLS]name[ARGS]{...}``.
``harmony``  gpt-oss: ``<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>``,
             reasoning in the ``analysis`` channel (``harmony.py``).
``qwen3_coder`` Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>value</parameter>...``
             (``qwen3_coder.py``).
``fallback`` the template knows nothing of tools (the bundled SmolLM2):
             lmspd renders the tool list and past calls itself (``fallback.py``).

One module per syntax; ``base.py`` holds the parser core and the
``ToolFormat`` interface, ``json_scan.py`` the one incremental JSON scanner
they share. A syntax describes its markers as data (``call_parts``,
``layout``, ``triggers``, ``markers``); ``lmspd.engines.llama.grammars``
writes the grammar from them.

``native`` is true when the template itself renders ``tools``,
``tool_calls`` and role ``tool`` messages (the Hugging Face convention):
the engine then passes them to the template (``template_tools``,
``template_tool_calls``, ``template_tool_message`` give the dicts) and uses
only the parser and grammars from here. Otherwise the engine appends
``system_block(tools)`` to the system prompt, renders past calls with
``render_calls`` inside the assistant turn and results with
``render_outputs`` as a user turn.

Custom (freeform) tools under a JSON syntax are offered as a function with
one string parameter ``input`` and unwrapped back: the call's payload is the
raw string.

Parsing
-------

``ToolFormat.parser(tools, new_call_id)`` returns an incremental
``ToolCallParser``: ``feed(text)`` and ``finish()`` return engine events.
Text outside calls comes out as ``TextDelta`` at once, except a tail that
could still become the start of a call. ``ToolCallStarted`` comes as soon
as the name is complete and declared, then ``ToolCallDelta`` fragments of
the arguments JSON (functions, raw text as the model wrote it) or of the
decoded input (custom tools), then ``ToolCallDone`` with their
concatenation. Whitespace right after a call is never text. A name that is
not declared, or a call that does not parse, raises ``ToolCallError``; call
markup is never returned as text.
"""


from __future__ import annotations

import re

from .base import CallLayout, ToolCallError, ToolCallParser, ToolFormat
from .fallback import FallbackFormat
from .harmony import HarmonyFormat
from .hermes import HermesFormat
from .llama3 import Llama3Format
from .mistral import MistralFormat
from .qwen3_coder import Qwen3CoderFormat

__all__ = [
    "CallLayout",
    "ToolCallError",
    "ToolCallParser",
    "ToolFormat",
    "FallbackFormat",
    "HarmonyFormat",
    "HermesFormat",
    "Llama3Format",
    "MistralFormat",
    "Qwen3CoderFormat",
    "detect_tool_format",
]

_RENDERS_TOOLS = re.compile(r"\btools\b")


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call syntax a chat template speaks (``FallbackFormat`` if none)."""
    t = chat_template or ""
    native = bool(_RENDERS_TOOLS.search(t))
    if "<|channel|>" in t and "<|message|>" in t:
        return HarmonyFormat(native)
    if "<function=" in t and "<parameter=" in t:
        return Qwen3CoderFormat(native)
    if "<tool_call>" in t:
        return HermesFormat(native)
    if "[TOOL_CALLS]" in t:
        return MistralFormat(native, v11="[ARGS]" in t)
    if "<|start_header_id|>" in t and ("<|python_tag|>" in t or '"parameters"' in t):
        return Llama3Format(native)
    return FallbackFormat()
