"""End to end with the bundled SmolLM2: constrained sampling yields calls
and JSON that parse and validate (a few seconds on a CPU)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lmspd.core.conversation import FunctionTool
from lmspd.core.events import ToolCallDone, ToolCallStarted
from lmspd.engines.llama.grammars import json_schema_grammar, tool_call_grammar
from lmspd.engines.llama.tool_formats import detect_tool_format
from support.grammar_rig import ModelRig

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    FunctionTool("get_weather", "Get the current weather in a city.", WEATHER, strict=True),
    FunctionTool("get_time", "Get the time in a time zone.", {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}}),
]


@pytest.fixture(scope="module")
def model() -> ModelRig:
    return ModelRig()


def chatml(system: str, user: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def generate(model: ModelRig, prompt: str, grammar: str, max_tokens: int) -> str:
    text, ended = model.generate(prompt, grammar, max_tokens)
    assert ended, text
    return text


def test_forced_call_parses_and_validates(model) -> None:
    fmt = detect_tool_format(model.llm.metadata.get("tokenizer.chat_template"))
    assert fmt.name == "fallback"
    prompt = chatml("You are a helpful assistant.\n\n" + fmt.system_block(TOOLS), "What's the weather in Paris?")
    text = generate(model, prompt, tool_call_grammar(fmt, TOOLS, allowed_names=["get_weather"]), 80)
    counter = iter(range(10))
    parser = fmt.parser(TOOLS, lambda: f"call_{next(counter)}")
    events = parser.feed(text) + parser.finish()
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    done = [e for e in events if isinstance(e, ToolCallDone)]
    assert [s.name for s in started] == ["get_weather"], text
    jsonschema.validate(json.loads(done[0].payload), WEATHER)


def test_structured_output_validates(model) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    prompt = chatml("Reply in JSON.", "Describe a person called Ada, aged 36.")
    text = generate(model, prompt, json_schema_grammar(schema), 80)
    jsonschema.validate(json.loads(text), schema)


def test_the_vocabulary_is_masked_only_on_a_rejection(model, monkeypatch) -> None:
    """Grammar-first rejection: an allowed first try costs what free
    sampling costs (llama.cpp's own sample call); the Python-side fill of
    the whole candidate array, with the grammar's mask, runs only for a
    token the grammar refused."""
    from lmspd.engines.llama.sampling import GrammarFirstRejection

    picks: list[bool] = []
    made: list[GrammarFirstRejection] = []
    pick, init = GrammarFirstRejection._pick, GrammarFirstRejection.__init__
    monkeypatch.setattr(GrammarFirstRejection, "_pick",
                        lambda self, logits, allowed=None: picks.append(allowed is not None) or pick(self, logits, allowed))
    monkeypatch.setattr(GrammarFirstRejection, "__init__",
                        lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    text = generate(model, chatml("You are a poet.", "Write a poem about the sea."), json_schema_grammar(schema), 40)
    assert json.loads(text)["city"] in ("Paris", "Rome")
    [sampler] = made
    # The model wants prose: the grammar refuses at least its first token.
    assert sampler.rejections >= 1
    assert picks == [True] * sampler.rejections
