"""Who a run is for and how it runs: what a request's body does not say.

A dialect decodes a body into a ``Conversation`` (``core.conversation``):
what the model is asked. Everything else an engine needs to know about a
run (the credential it runs for, the client session and agent that sent it,
whether it only prefills, the connection it came on) comes from the route
and the service, once, as one frozen ``RunContext`` handed to the engine
beside the conversation (``Engine.prepare(conversation, run)``). Nothing
writes to either after that.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmspd.core.conversation import SessionPin


@dataclass(frozen=True, slots=True)
class RunContext:
    # The credential's owner: remembered KV state is reused only for the
    # owner whose request left it (cached-token counts, a continuation's
    # reply and tool-output-only requests would otherwise reveal another
    # key's conversation); sealed reasoning opens only for it.
    owner: str = "local"
    # A client's session id from its headers (lmspd/dialects/session.py):
    # turns of one agent session share it, whatever the dialect.
    session_key: str | None = None
    # The agent of that session that sent it and the agent that spawned it
    # (a subagent: lmspd/dialects/session.py ``agent_lineage``).
    agent_id: str | None = None
    parent_agent_id: str | None = None
    # Evaluate the prompt into the KV and keep it, generate nothing (a
    # WebSocket ``generate: false`` warm-up, the window a compaction leaves).
    # An engine that cannot do this answers with an empty completed turn.
    prefill_only: bool = False
    # The connection this request came on (a WebSocket): an engine keeps its
    # session resident in preference to others while it is open, and
    # continues the connection's latest response in place
    # (``cache_source=connection``).
    pin: SessionPin | None = None


# A run with nothing to say about itself: the local owner, no session.
LOCAL = RunContext()
