"""A chat template that takes the reasoning effort (gpt-oss's writes
"Reasoning: <effort>" into its system message) is told the request's:
``reasoning.effort``, ``reasoning_effort`` and Anthropic's thinking all
reached nothing there, and gpt-oss reasoned at its template's default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.engines.llama.preparation import Preparation
from lmspd.engines.llama.template import ChatTemplate
from lmspd.engines.llama.tool_formats import FallbackFormat

# The part of gpt-oss's template that reads it.
TEMPLATE = ("Reasoning: {{ reasoning_effort | default('medium') }}\n"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")


def rendered(effort: str | None) -> str:
    unused = SimpleNamespace()
    preparation = Preparation(model_id="m", vocab=unused, template=ChatTemplate(TEMPLATE),  # type: ignore[arg-type]
                              tool_format=FallbackFormat(), reasoning=None, cache=unused,  # type: ignore[arg-type]
                              n_ctx=4096, limits=unused, sealer=None)  # type: ignore[arg-type]
    return preparation.render(Conversation(model="m", items=[Message("user", "q")], reasoning_effort=effort))


@pytest.mark.parametrize(("effort", "line"), [("high", "Reasoning: high"), ("low", "Reasoning: low"),
                                              ("minimal", "Reasoning: low"), (None, "Reasoning: medium")])
def test_the_requests_effort_reaches_a_template_that_takes_it(effort, line):
    assert rendered(effort).startswith(line + "\n")
