"""llama.cpp's log lines reach Python logging at their level, never raw stderr."""

from __future__ import annotations

import gc
import logging
import threading

import llama_cpp
from llama_cpp import _internals as internals

from lmspd.engines.llama import native_log
from support.grammar_rig import model_path

# ggml_log_level, as ggml.h of this build numbers them
DEBUG, INFO, WARN, ERROR, CONT = 1, 2, 3, 4, 5


def routed(caplog) -> list[tuple[int, str]]:
    """What the route logged. caplog holds every logger's records: a garbage
    collection inside a test can add asyncio's report of an object an earlier
    test left unclosed."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == native_log.log.name]


def test_lines_written_in_pieces_are_logged_whole_at_their_level(caplog):
    # A llama.cpp object an earlier test left to the garbage collector logs
    # its teardown when collected: not in the middle of this test.
    gc.collect()
    gc.disable()
    try:
        caplog.set_level(logging.DEBUG, logger="lmspd.llama_cpp")
        native_log.route(WARN, b"model has no chat ")
        native_log.route(CONT, b"template\nsecond ")
        native_log.route(CONT, b"line\n")
        native_log.route(INFO, b"update: copying KV buffer: stream 0 to stream 1\n")
        native_log.route(ERROR, b"decode: failed\n")
        native_log.route(WARN, b"a line that never ends")
        native_log.route(DEBUG, b"graph_reserve: reserving a graph\n\n")
    finally:
        gc.enable()
    assert routed(caplog) == [
        (logging.WARNING, "model has no chat template"),
        (logging.WARNING, "second line"),
        (logging.DEBUG, "update: copying KV buffer: stream 0 to stream 1"),
        (logging.ERROR, "decode: failed"),
        (logging.WARNING, "a line that never ends"),
        (logging.DEBUG, "graph_reserve: reserving a graph"),
    ]


def test_a_model_load_logs_through_python_logging_not_stderr(caplog, capfd):
    """llama-cpp-python's own callback printed these to stderr (its logger
    level unset below ``Llama``): a server's log filled with them."""
    native_log.install()
    caplog.set_level(logging.DEBUG, logger="lmspd.llama_cpp")
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = internals.LlamaModel(path_model=model_path(), params=params, verbose=True)
    model.close()
    loader = [r for r in caplog.records if r.name == "lmspd.llama_cpp" and "llama_model_loader" in r.getMessage()]
    assert loader and all(r.levelno == logging.DEBUG for r in loader)
    assert "llama_model_loader" not in capfd.readouterr().err


def test_pieces_of_one_line_at_one_level_stay_one_line(caplog):
    """ggml writes some debug lines as several calls at the same level."""
    caplog.set_level(logging.DEBUG, logger="lmspd.llama_cpp")
    for piece in (b"## SPLIT #0: CPU", b" # 3 inputs", b"\n"):
        native_log.route(DEBUG, piece)
    assert routed(caplog) == [(logging.DEBUG, "## SPLIT #0: CPU # 3 inputs")]


def test_a_line_logged_from_inside_the_logging_of_another_is_logged_once(caplog):
    """Emitting a record may run the garbage collector, whose freeing of a
    llama.cpp object logs through the callback again, on the same thread."""
    caplog.set_level(logging.DEBUG, logger="lmspd.llama_cpp")
    reentered: list[bool] = []

    class Reenter(logging.Handler):
        def emit(self, record):
            if not reentered:
                reentered.append(True)
                native_log.route(INFO, b"~llama_context: freed\n")

    handler = Reenter()
    native_log.log.addHandler(handler)
    try:
        native_log.route(WARN, b"an unfinished warning")
        native_log.route(ERROR, b"decode: failed\n")
    finally:
        native_log.log.removeHandler(handler)
    # The inner line reaches pytest's handler (on the root logger) first.
    assert routed(caplog) == [
        (logging.DEBUG, "~llama_context: freed"),
        (logging.WARNING, "an unfinished warning"),
        (logging.ERROR, "decode: failed"),
    ]


def test_error_lines_are_kept_per_thread_and_only_inside_the_block():
    other: list[list[str]] = []

    def elsewhere() -> None:
        with native_log.errors() as kept:
            native_log.route(ERROR, b"another thread's failure\n")
        other.append(list(kept))

    native_log.route(ERROR, b"before the block\n")
    with native_log.errors() as kept:
        native_log.route(WARN, b"only a warning\n")
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        for i in range(native_log.ERRORS_KEPT + 2):
            native_log.route(ERROR, b"failure %d\n" % i)
    native_log.route(ERROR, b"after the block\n")
    assert list(kept) == [f"failure {i}" for i in range(2, native_log.ERRORS_KEPT + 2)]
    assert other == [["another thread's failure"]]


def test_warnings_lmspd_has_answered_are_debug_lines(caplog):
    """A window past the trained length is lmspd's choice (with YaRN): every
    default load of the bundled model warned of it at --log-level info."""
    caplog.set_level(logging.DEBUG, logger="lmspd.llama_cpp")
    native_log.route(WARN, b"llama_context: n_ctx_seq (32768) > n_ctx_train (8192) -- possible training "
                           b"context overflow\n")
    native_log.route(WARN, b"some other warning\n")
    logged = dict((text, level) for level, text in routed(caplog))
    assert logged["llama_context: n_ctx_seq (32768) > n_ctx_train (8192) -- possible training context "
                  "overflow"] == logging.DEBUG
    assert logged["some other warning"] == logging.WARNING
