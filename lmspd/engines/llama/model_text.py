"""How one model's text is written: its vocabulary, chat template, tool-call
syntax and reasoning markers. Read from the GGUF (the vocabulary alone is
enough), the same for the engine that serves the model and for
``lmspd render``, which shows the prompt the engine would feed it."""

from __future__ import annotations

from dataclasses import dataclass

from llama_cpp import _internals as internals

from .client_text import ClientText
from .models import fallback_template
from .reasoning import ReasoningSyntax
from .template import ChatTemplate
from .tool_formats import ToolFormat, detect_tool_format
from .vocab import Vocabulary


@dataclass(frozen=True)
class ModelText:
    vocab: Vocabulary
    template: ChatTemplate
    tool_format: ToolFormat
    reasoning: ReasoningSyntax | None
    # The tool-call parser reads every output, even where no tools were
    # offered: the model writes its call markup as special tokens.
    parse_always: bool
    # Where the template came from: "gguf", "--chat-template", "fallback"
    # (lmspd's for the GGUF's architecture) or "none" (ChatML, ChatTemplate's default).
    template_origin: str

    @classmethod
    def of(cls, model: internals.LlamaModel, chat_template: str | None = None) -> "ModelText":
        """``chat_template``: a template's source that overrides the GGUF's
        own (``--chat-template``; e.g. a thinking-style one)."""
        vocab = Vocabulary(model)
        meta = model.metadata()
        source: str | None
        if chat_template:
            source, origin = chat_template, "--chat-template"
        elif meta.get("tokenizer.chat_template"):
            source, origin = meta["tokenizer.chat_template"], "gguf"
        else:
            source = fallback_template(meta.get("general.architecture"))
            origin = "fallback" if source is not None else "none"
        template = ChatTemplate(source, bos_token=vocab.token_text(model.token_bos()),
                                eos_token=vocab.token_text(model.token_eos()))
        template.client_text = ClientText(vocab.control_texts)
        tool_format = detect_tool_format(source)
        reasoning = ReasoningSyntax.detect(template)
        # The markers the parsers read must reach them even where the model
        # writes them as one special token (vocab.py); a model that does
        # always gets the parser, so that its markup never becomes text.
        parse_always = bool(vocab.show_markers(tool_format.markers))
        vocab.show_markers((reasoning.open, reasoning.close) if reasoning else ())
        return cls(vocab, template, tool_format, reasoning, parse_always, origin)
