"""Every bound lmspd enforces, in one place.

Each limit has a clear error where it is enforced; the numbers live here so
that a deployment can see (and a test can shrink) all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bounds the protocols themselves fix (not tunable per deployment).
# OpenAI's bound on items added to a conversation in one call.
MAX_CONVERSATION_ITEMS_PER_CALL = 20
# Idempotency-Key header length.
MAX_IDEMPOTENCY_KEY_CHARS = 255
# A client's session header (Claude Code, Codex, opencode...): a longer one is
# ignored rather than refused (lmspd.dialects.session).
MAX_SESSION_KEY_CHARS = 256
# A response id a request names (``previous_response_id``,
# ``prompt_cache_options.comparison_response_id``): lmspd's own are 37
# characters. A WebSocket connection remembers the ids whose continuation
# failed, so a longer one would be the client's bytes held.
MAX_RESPONSE_ID_CHARS = 256
# A WebSocket response.create's ``stream_id`` (its lane): echoed on every
# event of the turn, so a long one would be copied into each.
MAX_STREAM_ID_CHARS = 256
# Threads that decode large request bodies and WebSocket messages
# (decompression, JSON): a pool of their own (lmspd.bodies), so that slow
# bodies queue behind each other, not in front of other off-loop work.
BODY_DECODE_WORKERS = 2
# Threads that encode JSON replies whose size follows stored or generated
# data (lmspd.http.json_reply_off_loop): not the body pool, where they would
# wait behind 8 MiB body decodes.
REPLY_ENCODE_WORKERS = 2


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    # gzip members / zstd frames in one compressed body (or WebSocket
    # message): a sender needs one; each costs a decoder of its own.
    max_body_members: int = 64
    # Content codings stacked on one body (``gzip, zstd``): a sender needs
    # one, HTTP allows a list. Each layer may inflate to max_body_bytes, so
    # the list is what bounds a body's decompression work.
    max_body_codings: int = 2
    max_json_depth: int = 64
    # Values in one JSON body or WebSocket message (each object, array,
    # string, number, true, false, null), counted before parsing. The JSON
    # parser holds the interpreter lock for the whole document, stalling
    # every stream whatever thread runs it, at up to ~0.5 µs a value
    # (arrays, with the garbage collector's share): 2.8M empty arrays in
    # 8 MiB stalled the server for a second. 128Ki values is some 60 ms at
    # worst on a busy two-core machine, and about four times what a body of
    # max_input_items items (some eight values each) and its tools hold.
    max_json_values: int = 128 * 1024
    max_input_items: int = 4096
    max_content_parts: int = 256
    # Client-declared cache breakpoints in one message or system prompt (as
    # Anthropic's and OpenAI's own limit: four).
    max_cache_breakpoints: int = 4
    max_text_chars: int = 4 * 1024 * 1024
    # A Responses request's input once the stored history it names is
    # expanded (previous_response_id's chain, a conversation's items,
    # item_reference and compaction items, plus the input itself), in
    # characters: ~4M tokens, far past any context window, while a handful
    # of references to one large stored item cannot build gigabytes.
    max_expanded_chars: int = 16 * 1024 * 1024
    # The same expansion in items. Not max_input_items, which bounds what
    # one request sends: a long agent session continued by
    # previous_response_id or a conversation rightly holds more than one
    # request may send. Items without text (an empty message, a call with
    # no arguments) cost nothing against max_expanded_chars, yet each is an
    # object here and a few tokens of chat-template markup in the engine:
    # 64Ki items are past any context window in markup alone, while thirty
    # turns of 4096 empty messages cannot hand the engine 120k items.
    max_expanded_items: int = 65536
    max_tools: int = 512
    max_tool_schema_bytes: int = 256 * 1024
    # A custom tool's Lark or regex grammar (Codex's apply_patch is ~1 KB);
    # rules are counted because a long chain of them is what makes a
    # grammar compiler recurse deeply.
    max_grammar_bytes: int = 64 * 1024
    max_grammar_rules: int = 1000
    max_grammar_depth: int = 64
    # Grammars compiled per engine, kept by content for the next request.
    grammar_cache_entries: int = 64
    max_metadata_pairs: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_stop_sequences: int = 4
    max_header_bytes: int = 64 * 1024
    # A request head must be complete this long after its first byte
    # (lmspd.http11), or it is answered 408 and the connection closed: a
    # head sent a byte at a time would hold its connection forever. (A
    # connection that sends nothing is closed after uvicorn's keep-alive
    # timeout, 5 s.) Never while a response is being sent: a stream runs
    # as long as it runs.
    head_timeout_s: float = 30.0
    # A request body may pause this long between two pieces (lmspd.bodies),
    # then it is a 408: a slow link delivers a piece every few hundred ms,
    # while a body held one byte short of its Content-Length would hold
    # its connection and its bytes forever.
    body_timeout_s: float = 60.0
    # A connection whose client reads nothing of a response for this long
    # (its socket's buffers full, the response's writes waiting) is
    # dropped (lmspd.http11): such a client, pipelining requests it never
    # reads the answers to, held its connection for good, no key needed,
    # and enough of them refused everyone else for the connection cap. A
    # stream that only sends keep-alives still has them read.
    write_stall_s: float = 120.0
    # Open connections, HTTP and WebSocket (lmspd.http11). One past it is
    # answered 503 as soon as its request line is read, and closed. At
    # most half the process's file descriptors (RLIMIT_NOFILE): the store,
    # the models and the connections being refused need theirs.
    max_connections: int = 1024
    # Bytes of request bodies received and not yet decoded, all connections
    # together (lmspd.bodies): past it a body is a 503 with Retry-After and
    # its connection closed. Without it, bodies trickling in on every
    # allowed connection held max_connections x max_body_bytes (8 GiB);
    # 256 MiB is 32 bodies of the largest size arriving at once.
    max_bodies_in_flight_bytes: int = 256 * 1024 * 1024
    # Calls one turn may make when parallel_tool_calls allows several (small
    # models otherwise repeat a forced call until max_output_tokens).
    max_parallel_tool_calls: int = 4
    # A local generation without max_output_tokens may run up to the
    # context (the protocols' meaning), but no further than this many tokens
    # (--max-output-tokens-default; 0 = the context is the only bound).
    max_output_tokens_default: int = 8192
    # The repetition guard (lmspd/engines/llama/repetition.py) ends a local
    # generation whose last repetition_window tokens repeat a cycle of at
    # most repetition_max_period tokens, as incomplete (reason
    # "repetition"). 128 x 32: at least four rounds of a 32-token cycle, or
    # 128 times one token -- far more than code or prose repeats verbatim.
    # Either 0 turns the guard off.
    repetition_window: int = 128
    repetition_max_period: int = 32


@dataclass(frozen=True)
class QueueLimits:
    # Requests waiting for the model once all its sequences (--parallel) are busy.
    max_pending: int = 32
    retry_after_s: int = 2


@dataclass(frozen=True)
class UpstreamStreamLimits:
    """Bounds on what a Chat Completions provider can make us hold."""

    max_line_bytes: int = 1024 * 1024
    max_event_bytes: int = 4 * 1024 * 1024
    # JSON values in one event (each object, array, string, number, true,
    # false, null), counted before it is parsed on the event loop: a chunk
    # holds tens (a hundred or two with logprobs), and 4 MiB of small
    # integers took 0.7 s of the loop to parse, every other stream waiting.
    max_event_values: int = 10_000
    max_buffered_bytes: int = 4 * 1024 * 1024
    max_aggregate_bytes: int = 64 * 1024 * 1024
    max_choices: int = 1
    max_tool_calls: int = 128
    max_tool_name_chars: int = 256
    max_tool_call_id_chars: int = 256
    max_tool_argument_bytes: int = 4 * 1024 * 1024
    # A stream that sends nothing for this long fails (upstream_timeout).
    idle_timeout_s: float = 120.0
    # A stream that sends no output for this long fails (upstream_timeout)
    # however many bytes it sends: keep-alive comments (": still
    # prefilling") and empty deltas keep the idle timer above alive but say
    # nothing, and without this bound such a stream holds its concurrency
    # slot and connection forever while its client hears heartbeats. Output
    # is text, reasoning, a tool call's bytes, usage or a finish
    # (upstream/bridge.py's ``progress``). Ten minutes: the wait it bounds
    # is at worst a prefill (before the first output) or a queue at the
    # provider, and a long prompt on a big model behind a busy server
    # takes minutes, not tens of them (a provider silent meanwhile meets
    # the idle timeout long before).
    progress_timeout_s: float = 600.0


@dataclass(frozen=True)
class Limits:
    request: RequestLimits = RequestLimits()
    queue: QueueLimits = QueueLimits()
    upstream: UpstreamStreamLimits = UpstreamStreamLimits()
    # Seconds to let in-flight streams end with a terminal event on shutdown.
    shutdown_grace_s: float = 10.0
    # A Responses WebSocket connection lives at most this long (OpenAI: 60 min).
    websocket_max_age_s: float = 3600.0
    # Open Responses WebSocket connections, in all and per credential
    # (owner): one more is refused at the upgrade with a 429.
    websocket_max_connections: int = 64
    websocket_max_connections_per_owner: int = 16
    # Characters of history (input and output items) a connection remembers
    # for previous_response_id. Beyond it, under truncation: "auto" the
    # oldest items are forgotten (as truncation would drop them); otherwise
    # the response is not remembered, and continuing it needs the store or
    # the full context.
    websocket_max_history_chars: int = 16 * 1024 * 1024
    # Preparing a request (render, tokenize, schemas, grammars) runs in this
    # many worker threads, each bounded to this long (lmspd.service).
    prepare_workers: int = 2
    prepare_timeout_s: float = 30.0
    # An SSE stream silent this long gets a comment line (lmspd.http.SseResponse):
    # a long prefill or a wait in the queue sends nothing between
    # response.created and the first delta, and proxies give up on an idle
    # stream (often after 60 s). Codex times out on silence between events
    # (its stream_idle_timeout, 300 s), comments and pings or not: until the
    # first event the Responses and Messages dialects also repeat an event
    # this often (lmspd.service.Run._quiet, steps.Heartbeat), over SSE and
    # WebSocket. 0 sends neither. WebSocket pings: uvicorn's, every 20 s.
    sse_keepalive_s: float = 15.0


DEFAULT_LIMITS = Limits()

# --- what the store keeps ---------------------------------------------------

_DAY = 24 * 3600.0
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Retention:
    """How long, and how much, the store keeps. Ages are seconds.

    Events of a finished task expire before the task itself, so a client that
    resumes too late gets 410 ``event_history_expired`` and can still read the
    final result with ``GET /tasks/{id}``.

    Each ``max_*_bytes`` is one budget for all owners together, shared
    fairly (``lmspd.core.fairness.fair_share``): an owner within an equal
    split of it never loses a record to another owner's writes.
    """

    response_ttl_s: float = 30 * _DAY  # from created_at
    conversation_ttl_s: float = 30 * _DAY  # from the last change
    task_ttl_s: float = 7 * _DAY  # from finished_at
    event_ttl_s: float = 1 * _DAY  # from the task's finished_at
    idempotency_ttl_s: float = 1 * _DAY  # from idempotency_begin
    max_response_bytes: int = 512 * _MIB
    max_conversation_bytes: int = 512 * _MIB
    max_task_bytes: int = 256 * _MIB  # requests, results and errors of tasks
    max_event_bytes: int = 256 * _MIB  # all task event logs together
    max_idempotency_bytes: int = 256 * _MIB  # replies kept for Idempotency-Key retries


# Store calls a request makes run on their own threads (lmspd.store.calls);
# beyond this many waiting for one, a request gets 503 server_overloaded.
STORE_CALL_THREADS = 4
STORE_CALLS_WAITING = 512

# How long an instance's rows count as alive without a heartbeat (seconds).
# A shared store fails the running tasks of an instance whose lease ran out.
DEFAULT_LEASE_S = 15.0

