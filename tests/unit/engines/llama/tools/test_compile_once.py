"""A request's grammar is compiled by llguidance once: the compile that
checks it (a refusal is this request's 400) is the matcher the first
sampler gets; the piece-by-piece validation that names the tool, JSON path
or grammar line runs only for a grammar llguidance refused (grammars:
"Compiled once"). Driven through ``Preparation`` with the bundled model's
real template and vocabulary."""

from __future__ import annotations

import pytest
from test_lark_grammar import APPLY_PATCH

from lmspd.core.conversation import Conversation, CustomTool, FunctionTool, Message, OutputFormat, ToolChoice
from lmspd.core.errors import ApiError
from lmspd.engines.llama import grammars
from lmspd.engines.llama.preparation import Preparation
from lmspd.engines.llama.sampling import GrammarFirstRejection
from support.grammar_rig import vocab_only_preparation


@pytest.fixture(scope="module")
def preparation() -> Preparation:
    return vocab_only_preparation()


@pytest.fixture
def validations(monkeypatch) -> list[str]:
    """Every grammar llguidance validates (a compile of its own)."""
    seen: list[str] = []
    real = grammars.validate
    monkeypatch.setattr(grammars, "validate", lambda g: seen.append(g) or real(g))
    return seen


_salt = iter(range(1_000_000))


def patch_tool(definition: str = APPLY_PATCH) -> CustomTool:
    # A comment that differs per call: a grammar no cache has seen.
    return CustomTool("apply_patch", "Edit files", {"syntax": "lark", "definition": definition + f"\n// {next(_salt)}\n"})


def schema_50() -> dict:
    props = {f"field_{i}": ({"type": "string", "maxLength": 40} if i % 3 == 0 else
                            {"type": "integer", "minimum": 0} if i % 3 == 1 else {"enum": ["a", "b", "c"]})
             for i in range(50)}
    return {"type": "object", "description": f"run {next(_salt)}", "properties": props, "required": list(props),
            "additionalProperties": False}


def conversation(**kw) -> Conversation:
    return Conversation(model="m", items=[Message("user", "Edit the file.")], max_output_tokens=16, **kw)


def forced_patch(tool: CustomTool) -> Conversation:
    return conversation(tools=[tool], tool_choice=ToolChoice(mode="required", allowed=[tool.name]))


def json_schema(schema: dict) -> Conversation:
    return conversation(output_format=OutputFormat(type="json_schema", name="x", schema=schema, strict=True))


@pytest.mark.parametrize("make", [lambda: forced_patch(patch_tool()), lambda: json_schema(schema_50()),
                                  lambda: conversation(tools=[patch_tool()])],
                         ids=["apply_patch forced", "50-property schema", "apply_patch auto"])
def test_a_fresh_grammar_compiles_once(preparation, validations, make) -> None:
    compiler = preparation._grammars()
    before = compiler.compiles
    prepared = preparation.prepare(make())
    assert prepared.grammar is not None
    assert compiler.compiles == before + 1, "the matcher is compiled once"
    assert validations == [], "no separate validation compile on the happy path"
    # The first sampler gets the matcher of that compile; a second one a copy from the cache.
    checked = prepared.matcher
    sampler = preparation.sampler(prepared)
    assert isinstance(sampler, GrammarFirstRejection) and sampler._matcher is checked
    assert prepared.matcher is None
    again = preparation.sampler(prepared)
    assert isinstance(again, GrammarFirstRejection) and again._matcher is not checked
    assert compiler.compiles == before + 1
    sampler.close()
    again.close()


@pytest.mark.parametrize("choice", [ToolChoice(mode="required", allowed=["apply_patch"]), ToolChoice()],
                         ids=["forced", "auto"])
def test_a_refused_lark_grammar_is_a_400_naming_its_line(preparation, choice) -> None:
    conv = conversation(tools=[patch_tool('start: "x" | b\nb: /a(?=b)/')], tool_choice=choice)
    with pytest.raises(ApiError) as info:
        preparation.prepare(conv)
    err = info.value
    assert err.status == 400 and err.param == "tools.apply_patch.format.definition", err.message
    assert "line 2," in err.message and "look-around" in err.message, err.message


def test_a_refused_schema_is_a_400_naming_its_json_path(preparation) -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "a(?=b)"}}, "required": ["code"]}
    with pytest.raises(ApiError) as info:
        preparation.prepare(json_schema(schema))
    assert info.value.status == 400 and info.value.param == "output_format.schema.properties.code.pattern", \
        info.value.message


def test_a_non_strict_tool_llguidance_refuses_falls_back(preparation, validations) -> None:
    # A look-around pattern: the strict grammar is refused, the lenient one compiles.
    tool = FunctionTool("lookup", "Look up", {"type": "object", "description": f"{next(_salt)}",
                                              "properties": {"code": {"type": "string", "pattern": "a(?=b)"}}})
    compiler = preparation._grammars()
    before = compiler.compiles
    prepared = preparation.prepare(conversation(tools=[tool], tool_choice=ToolChoice(mode="required")))
    assert prepared.matcher is not None and not prepared.matcher.is_error()
    assert validations, "the refused grammar was built again, validated piece by piece"
    assert compiler.compiles == before + 1, "only the fallback grammar made a matcher"
    # The same tool next turn: the refusal, the validation and the fallback all come from caches.
    compile_ms = compiler.last_compile_ms
    compiler.last_compile_ms = -1.0
    preparation.prepare(conversation(tools=[tool], tool_choice=ToolChoice(mode="required")))
    assert compiler.last_compile_ms == -1.0 and compiler.compiles == before + 1, compile_ms
    with pytest.raises(ApiError) as info:
        strict = FunctionTool("lookup", "Look up", {**tool.parameters, "description": "strict"}, strict=True)
        preparation.prepare(conversation(tools=[strict], tool_choice=ToolChoice(mode="required")))
    assert info.value.param == "tools.lookup.parameters.properties.code.pattern", info.value.message


def test_the_grammar_vocabulary_is_built_at_start_not_by_the_first_request() -> None:
    """The compiler walks the whole vocabulary once (~5 s for Gemma 3's):
    started with the engine, the first request with a grammar (the first
    turn after a restart) finds it built or being built, never starts it."""
    import time

    fresh = vocab_only_preparation()
    assert fresh._grammar_compiler is None
    fresh.build_grammars_in_background()
    deadline = time.monotonic() + 60
    while fresh._grammar_compiler is None and time.monotonic() < deadline:
        time.sleep(0.05)
    built = fresh._grammar_compiler
    assert built is not None, "built with no request asking for it"
    assert fresh._grammars() is built


def test_building_the_grammar_vocabulary_leaves_the_warning_filters_alone(monkeypatch) -> None:
    """It runs on a background thread: ``warnings.catch_warnings`` there
    swaps process-wide filters and raced the test runner's own (a
    DeprecationWarning turned error in that thread), so the walk must not
    need it. (It must not warn either: this suite turns warnings into
    errors.)"""
    import warnings

    from lmspd.engines.llama.matchers import GrammarCompiler

    vocab = vocab_only_preparation().vocab.vocab

    def refuse(*args, **kwargs):
        raise AssertionError("catch_warnings swaps process-wide state")

    monkeypatch.setattr(warnings, "catch_warnings", refuse)
    compiler = GrammarCompiler(vocab)
    assert compiler.tokenizer.eos_tokens == compiler.eog
