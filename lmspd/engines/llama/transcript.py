"""The visible transcript of a turn: the text a client's replay of it
renders to, which the cache matches the next request's prompt against.

It rests on the template's turn closer (what the template writes after an
assistant message's content), found once per model by rendering a marker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from lmspd.core.conversation import Conversation, Item, Message, ToolCall
from lmspd.core.errors import ApiError

from .template import ChatTemplate


@dataclass(frozen=True, slots=True)
class Transcript:
    # None: the template's closer is unknown (it failed to render, or wrote
    # no marker back), and no turn has a transcript.
    closer: str | None
    # The prompt renderer (``Preparation.render``): a replay must render
    # exactly as the next request's prompt will, repairs included.
    render: Callable[..., str]

    @classmethod
    def of(cls, template: ChatTemplate, render: Callable[..., str]) -> Transcript:
        return cls(turn_closer(template), render)

    def turn_ends_with(self, eog_text: str) -> bool:
        """Whether the template's turn closer starts with this end token, so
        a replay renders it where the model sampled it (a template whose
        closer is unknown keeps every end token: it has no transcript)."""
        return self.closer is None or self.closer.startswith(eog_text)

    def visible(self, conversation: Conversation, outputs: list[Item], eog_text: str | None) -> str | None:
        """The text a client's replay of this turn renders to, as far as the
        KV covers it (up to the end-of-turn token when one was sampled)."""
        closer = self.closer
        # Only a turn that renders (text or calls) has a transcript to extend.
        if closer is None or not any(isinstance(o, (Message, ToolCall)) for o in outputs):
            return None
        after = dataclasses.replace(conversation, items=list(conversation.items) + outputs)
        try:
            text = self.render(after, add_generation_prompt=False)
        except ApiError:
            return None
        if not text.endswith(closer):
            return None
        body = text[: len(text) - len(closer)]
        if eog_text is not None:
            if not closer.startswith(eog_text):
                return None
            body += eog_text
        return body


def turn_closer(template: ChatTemplate) -> str | None:
    """What the template writes after an assistant message's content."""
    marker = "\x00lmspd\x00"
    try:
        text = template.render(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
            add_generation_prompt=False,
        )
    except ApiError:
        return None
    at = text.rfind(marker)
    return text[at + len(marker):] if at >= 0 else None
