"""``lmspd launch CLIENT``: point an agent (Codex, Claude Code, pi, opencode)
at a running lmspd and run it.

It reads what the server serves (``served.py``), builds the client's
configuration from it (``clients.py``: one pure function per client), writes
that into files lmspd owns under ``<data-dir>/launch/<client>/`` and never
into the user's own configuration (``files.py``: a file is rewritten only
when its content changed, and every change is shown), then runs the client
pointed at those files (``command.py``).
"""
