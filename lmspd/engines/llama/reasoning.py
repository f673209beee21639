"""``<think>``-style reasoning: where it is in a template, and splitting it
out of the sampled text.

The hidden part of a turn is everything the model produced before its
visible answer — the block's markers and the whitespace after it included —
so that ``hidden + answer`` is, byte for byte, what the KV holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .template import ChatTemplate

# Reasoning tokens allowed before lmspd closes the block itself, by
# ``reasoning.effort`` (None: the default).
BUDGETS = {"none": 0, "minimal": 16, "low": 64, "medium": 256, "high": 1024, "xhigh": 4096, None: 256}


@dataclass(frozen=True)
class ReasoningSyntax:
    open: str
    close: str
    # What the generation prompt writes after the assistant header when it
    # opens the block itself (e.g. "<think>\n"); "" when the model opens it.
    prompt_tail: str

    @classmethod
    def detect(cls, template: ChatTemplate) -> "ReasoningSyntax | None":
        if "<think>" not in template.source:
            return None
        marker = "\x00lmspd\x00"
        try:
            gen = template.render([{"role": "user", "content": "u"}], add_generation_prompt=True)
            msg = template.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                                  add_generation_prompt=False)
        except Exception:
            return cls("<think>", "</think>", "")
        at = msg.find(marker)
        tail = ""
        if at >= 0 and gen.startswith(msg[:at]):
            tail = gen[at:]
        return cls("<think>", "</think>", tail if "<think>" in tail else "")

    @property
    def forced_close(self) -> str:
        return "\n" + self.close + "\n\n"


class ReasoningSplitter:
    """Feeds sampled text; returns ``(reasoning, visible)`` pieces in order.

    ``call_markers``: the texts that start a tool call (the tool format's
    triggers, when the request declares tools it may call). Qwen3, gpt-oss
    and DeepSeek models sometimes open a call inside the block, never
    closing it: such a marker ends the reasoning there, and the call is
    visible output for the tool-call parser (the lazy call grammar wakes on
    the same marker wherever it appears), not reasoning text lost with it.
    The hidden text then ends with the reasoning, no close marker: it is
    still, with the answer, what the KV holds."""

    def __init__(self, syntax: ReasoningSyntax, call_markers: tuple[str, ...] = ()) -> None:
        self.syntax = syntax
        self.call_markers = tuple(m for m in call_markers if m)
        self.in_reasoning = bool(syntax.prompt_tail)
        # The turn's hidden raw text so far, and its reasoning text: pieces
        # (read once a turn; ``str +=`` would copy all of it every token).
        self._hidden = [syntax.prompt_tail]
        self._reasoning: list[str] = []
        self._at_start = not self.in_reasoning
        self._after_close = False
        self._held = ""

    @property
    def hidden(self) -> str:
        return "".join(self._hidden)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._at_start:
                opener = self.syntax.open
                stripped = buf.lstrip()
                if stripped.startswith(opener):
                    lead = len(buf) - len(stripped)
                    self._hidden.append(buf[: lead + len(opener)])
                    buf = buf[lead + len(opener):]
                    self.in_reasoning, self._at_start = True, False
                    continue
                if opener.startswith(stripped) and not final:
                    self._held = buf
                    return out
                self._at_start = False
                continue
            if self.in_reasoning:
                close = self.syntax.close
                at = buf.find(close)
                call = _first(buf, self.call_markers)
                if call >= 0 and (at < 0 or call < at):
                    # A call opened inside the block: the block ends here.
                    self._reason(out, buf[:call])
                    buf = buf[call:]
                    self.in_reasoning = False
                    continue
                if at >= 0:
                    self._reason(out, buf[:at])
                    self._hidden.append(close)
                    buf = buf[at + len(close):]
                    self.in_reasoning, self._after_close = False, True
                    continue
                keep = max(_partial_suffix(buf, m) for m in (close, *self.call_markers)) if not final else 0
                self._reason(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                return out
            if self._after_close:
                stripped = buf.lstrip()
                self._hidden.append(buf[: len(buf) - len(stripped)])
                buf = stripped
                if not buf:
                    return out
                self._after_close = False
            out.append(("text", buf))
            buf = ""
        return out

    def _reason(self, out: list[tuple[str, str]], text: str) -> None:
        if text:
            self._hidden.append(text)
            self._reasoning.append(text)
            out.append(("reasoning", text))


def _first(text: str, markers: tuple[str, ...]) -> int:
    """Where the first of ``markers`` starts in ``text``, or -1."""
    found = [at for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else -1


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
