"""The neutral conversation every dialect decodes into and every engine reads.

Items mirror the Responses item model because it is the richest of the four
dialects (Chat Completions and Anthropic Messages map onto it losslessly for
what lmspd supports). Nothing here knows about a wire format.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Union

Role = Literal["system", "developer", "user", "assistant"]


@dataclass(slots=True)
class Message:
    role: Role
    text: str
    id: str | None = None
    # OpenAI's assistant ``phase`` (commentary / final_answer), kept for replay.
    phase: str | None = None
    status: str = "completed"
    # Set on the message a ``compaction`` item expands to (``lmspd.compaction``):
    # the sealed blob the client carries; ``text`` is the summary it holds.
    # Dialects write such a message back as the compaction item, engines
    # render it as the user message it is.
    compaction: str | None = None
    # Client-declared cache breakpoints (Responses ``prompt_cache_breakpoint``
    # on a content part, Anthropic ``cache_control`` on a text block): the
    # offsets in ``text`` where such a part ends.
    breakpoints: tuple[int, ...] = ()


# A model knows no namespaces: a ``namespace`` tool's members are offered
# to it, and called by it, as ``namespace__name``.
NAMESPACE_SEPARATOR = "__"


def qualify(name: str, namespace: str | None) -> str:
    """The name a model sees for ``name`` in ``namespace``. Only a tool's
    declared name and what renders or parses the model's own text use it:
    every call item carries the plain name and the namespace apart, as the
    protocols that have namespaces write them."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


@dataclass(slots=True)
class ToolCall:
    """A call the model made (``function_call`` / ``custom_tool_call``)."""

    call_id: str
    # The tool's own name: within ``namespace`` when that is set (the model
    # wrote ``qualify(name, namespace)``).
    name: str
    # JSON arguments for functions, raw input for custom tools.
    payload: str
    kind: Literal["function", "custom"] = "function"
    namespace: str | None = None
    id: str | None = None
    status: str = "completed"


@dataclass(slots=True)
class ToolOutput:
    """The client's result for a call (``function_call_output`` / ``custom_tool_call_output``)."""

    call_id: str
    output: str
    kind: Literal["function", "custom"] = "function"
    id: str | None = None
    # Client-declared cache breakpoints (Anthropic ``cache_control`` on a
    # ``tool_result`` block or its text, Responses ``prompt_cache_breakpoint``
    # on an ``input_text`` part of the output): offsets in ``output``.
    breakpoints: tuple[int, ...] = ()


@dataclass(slots=True)
class Reasoning:
    """A reasoning item: visible summary and/or raw reasoning text, and the
    opaque blob that carries hidden reasoning across a stateless replay."""

    summary: list[str] = field(default_factory=list)
    text: str | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str = "completed"
    # The exact hidden text of the turn (from a valid encrypted_content): the
    # engine renders it so that the replayed prompt is what the model saw.
    hidden: str | None = None


Item = Union[Message, ToolCall, ToolOutput, Reasoning]


@dataclass(slots=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False
    # Set when the function came from a ``namespace`` tool; ``name`` is then
    # the name offered to the model, ``qualify(member_name(tool), namespace)``.
    namespace: str | None = None


@dataclass(slots=True)
class CustomTool:
    name: str
    description: str | None = None
    # None = free text; otherwise {"syntax": "lark"|"regex", "definition": str}.
    grammar: dict[str, str] | None = None
    # As FunctionTool's: Codex declares apply_patch inside a namespace.
    namespace: str | None = None


Tool = Union[FunctionTool, CustomTool]


def member_name(tool: Tool) -> str:
    """The name a call of ``tool`` carries: its own, without the namespace
    that the name offered to the model begins with."""
    if tool.namespace is None:
        return tool.name
    return tool.name[len(qualify("", tool.namespace)):]


@dataclass(slots=True)
class ToolChoice:
    """Normalized tool_choice: ``mode`` plus the names a call may use."""

    mode: Literal["auto", "none", "required"] = "auto"
    # None = every declared tool; otherwise the allowed subset.
    allowed: list[str] | None = None


@dataclass(slots=True)
class OutputFormat:
    """``text`` or a JSON shape the reply must satisfy."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool = False
    # Where the schema sits in the request, in the dialect's words (errors
    # name a keyword below it): the dialect that builds a schema sets it.
    param: str = "output_format.schema"


@dataclass(slots=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Anthropic's top_k, else lmspd's extension (no other protocol has a
    # field for them): 0 turns each off.
    top_k: int | None = None
    min_p: float | None = None


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A model's own sampling settings, for what a request leaves unset:
    its GGUF's ``general.sampling.*`` (llama.cpp's converters write them
    from the model's generation_config.json: Qwen3's temperature 0.6, top-k
    20, top-p 0.95), as llama.cpp's server uses them. Clients such as Codex
    send no temperature; the generic 1.0 without a top-k is not what these
    models were tuned to be sampled with. None: the generic default (1.0,
    no top-p, top-k or min-p)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def temperature_of(self, sampling: Sampling) -> float:
        if sampling.temperature is not None:
            return sampling.temperature
        return 1.0 if self.temperature is None else self.temperature

    def top_p_of(self, sampling: Sampling) -> float:
        if sampling.top_p is not None:
            return sampling.top_p
        return 1.0 if self.top_p is None else self.top_p

    def top_k_of(self, sampling: Sampling) -> int:
        """0: no top-k."""
        return sampling.top_k if sampling.top_k is not None else self.top_k or 0

    def min_p_of(self, sampling: Sampling) -> float:
        """0: no min-p."""
        return sampling.min_p if sampling.min_p is not None else self.min_p or 0.0

    def under(self, over: SamplingDefaults) -> SamplingDefaults:
        """These settings with each one ``over`` sets taken from it instead
        (the operator's flags over the model's own)."""
        overrides: dict[str, Any] = over.as_json()
        return replace(self, **overrides)

    def as_json(self) -> dict[str, float | int]:
        """The settings that are set (for the model listings)."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}

    def describe(self) -> str:
        """For the start-up log: ``temperature 0.6, top_k 20`` (or "none")."""
        return ", ".join(f"{name} {value:g}" for name, value in self.as_json().items()) or "none"


class SessionPin:
    """A client connection that is one KV session (a WebSocket on
    ``/v1/responses``). While it is open an engine keeps the connection's
    latest state where it is; once closed, that state is like any other.
    Closed from the event loop, read by an engine's thread: a single flag."""

    __slots__ = ("name", "open")

    def __init__(self, name: str) -> None:
        self.name = name
        self.open = True

    def close(self) -> None:
        self.open = False

    def __repr__(self) -> str:
        return f"SessionPin({self.name!r}, open={self.open})"


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a request asks of the model, as its dialect decoded it.

    Frozen: nothing writes to it after decoding. Who the run is for and how
    it runs (owner, client session, agent lineage, prefill only, the
    connection's pin) is a ``core.run.RunContext`` handed to the engine
    beside it; a step that needs a different conversation (compaction's
    summary request, an engine's repairs and truncation) makes a new one
    (``dataclasses.replace``)."""

    model: str
    items: list[Item]
    instructions: str | None = None
    # Offsets in ``instructions`` where a client-declared cache breakpoint
    # ends (Anthropic ``cache_control`` on a system block).
    instructions_breakpoints: tuple[int, ...] = ()
    tools: list[Tool] = field(default_factory=list)
    # A client declared a cache breakpoint on its tool list (Anthropic
    # ``cache_control`` on a tool): at the end of the rendered tool
    # definitions, wherever the template puts them.
    tools_breakpoint: bool = False
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    # None: the request did not say (parallel calls under auto, one forced call).
    parallel_tool_calls: bool | None = None
    output_format: OutputFormat = field(default_factory=OutputFormat)
    sampling: Sampling = field(default_factory=Sampling)
    max_output_tokens: int | None = None
    # ``max_output_tokens`` is a ceiling the client always sends rather than
    # a demand (Anthropic's required ``max_tokens``; Claude Code sends
    # 32000): an engine clamps it to the room the context leaves instead of
    # refusing the request.
    max_output_tokens_is_ceiling: bool = False
    # Drop the oldest items to fit the context window instead of failing.
    truncate: bool = False
    reasoning_effort: str | None = None
    include_encrypted_reasoning: bool = False
    # Routing/caching hints; engines may use them, none may require them.
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None
    # The stored conversation this turn belongs to (OpenAI ``conversation``).
    conversation_id: str | None = None
    # False: neither reuse nor remember KV state for this request.
    cache_reuse: bool = True
    # False: the engine does not speculate for this request (``lmspd.speculative``).
    speculative: bool = True
    # Responses replays of a reasoning model's tool-call turns render as the
    # model saw them only with their reasoning (items or encrypted_content):
    # a bare one continues a cached state that holds it, or renders without
    # it and is diagnosed ``reasoning_stripped`` (accepted, as OpenAI does).
    require_reasoning_state: bool = False


def orphan_tool_outputs(items: list[Item]) -> list[tuple[int, str]]:
    """``(index, call_id)`` of tool outputs with no earlier call in ``items``."""
    seen: set[str] = set()
    orphans: list[tuple[int, str]] = []
    for i, item in enumerate(items):
        if isinstance(item, ToolCall):
            seen.add(item.call_id)
        elif isinstance(item, ToolOutput) and item.call_id not in seen:
            orphans.append((i, item.call_id))
    return orphans


def drop_groups(items: list[Item], *, kept_calls: Container[str] = ()) -> list[list[int]]:
    """Indices of ``items`` that may be dropped (``truncation: auto``; a
    WebSocket connection's remembered history), as the groups that go
    together, oldest first: never a system or developer message, never the
    last item, never the call the last item answers nor one of
    ``kept_calls``; a call with every output that answers it. A kept output
    whose call is gone renders as a result of nothing, which templates and
    models misread, and as input it is refused (the client's 400)."""
    if not items:
        return []
    *older, last = items
    answered_last = last.call_id if isinstance(last, ToolOutput) else None
    answers: dict[str, list[int]] = {}
    for i, item in enumerate(older):
        if isinstance(item, ToolOutput):
            answers.setdefault(item.call_id, []).append(i)
    groups: list[list[int]] = []
    taken = [False] * len(older)
    for i, item in enumerate(older):
        if taken[i] or (isinstance(item, Message) and item.role in ("system", "developer")):
            continue
        group = [i]
        if isinstance(item, ToolCall):
            if item.call_id == answered_last or item.call_id in kept_calls:
                continue
            for j in answers.get(item.call_id, ()):
                if j > i and not taken[j]:
                    taken[j] = True
                    group.append(j)
        groups.append(group)
    return groups


def item_chars(item: Item) -> int:
    """The characters of text ``item`` carries (what its size is measured
    in: a request's expanded input, a truncation's estimate)."""
    if isinstance(item, Message):
        return len(item.text)
    if isinstance(item, ToolCall):
        return len(item.name) + len(item.namespace or "") + len(item.payload)
    if isinstance(item, ToolOutput):
        return len(item.output)
    return (sum(map(len, item.summary)) + len(item.text or "") + len(item.encrypted_content or "")
            + len(item.hidden or ""))
