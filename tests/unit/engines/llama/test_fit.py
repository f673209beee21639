"""``--ctx auto`` on the shapes people run: GGUF headers of Llama-3.1-8B,
Qwen3-30B-A3B, gpt-oss-20b and Gemma 3 27B (layers, KV heads, head size,
sliding-window layers, trained length, as their GGUFs state them) against
8, 24 and 80 GiB usable. Every expected value is worked out by hand in the
table's comments, not by the code under test.

Common to all rows: flash attention on (a GPU), so the compute buffers are
64 MiB + 512 x 4 B x 8 x heads x head size (no vocabulary in these headers),
which is 128 MiB for every model here (heads x head size = 4096).
"""

from __future__ import annotations

import io

import pytest

from lmspd.engines.llama.fit import GIB, MIB, FitError, Memory, ModelShape, Request, fit
from lmspd.engines.llama.gguf import parse
from support.gguf_writer import gguf_bytes


def header(arch: str, *, layers: int, heads: int, kv_heads: int, head: int, trained: int, embd: int,
           n_swa: int = 0) -> ModelShape:
    meta = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": embd,
            f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
            f"{arch}.attention.key_length": head, f"{arch}.attention.value_length": head,
            f"{arch}.context_length": trained}
    if n_swa:
        meta[f"{arch}.attention.sliding_window"] = n_swa
    shape = ModelShape.from_metadata(parse(io.BytesIO(gguf_bytes(meta))).metadata)
    assert shape is not None
    return shape


LLAMA_8B = header("llama", layers=32, heads=32, kv_heads=8, head=128, trained=131072, embd=4096)
QWEN3_30B_A3B = header("qwen3moe", layers=48, heads=32, kv_heads=4, head=128, trained=40960, embd=2048)
# Sliding window 128 on every other layer (llama.cpp's pattern 2 for gpt-oss: layers 0, 2, ... slide).
GPT_OSS_20B = header("gpt-oss", layers=24, heads=64, kv_heads=8, head=64, trained=131072, embd=2880, n_swa=128)
# Sliding window 1024 on five layers of six (pattern 6: layers 5, 11, ..., 59 are global).
GEMMA3_27B = header("gemma3", layers=62, heads=32, kv_heads=16, head=128, trained=131072, embd=5376, n_swa=1024)

# Weights (Q4_K_M files; MXFP4 for gpt-oss), in MiB.
WEIGHTS = {"llama": 4692, "qwen3moe": 17700, "gpt-oss": 11600, "gemma3": 15900}


def test_the_shapes_per_token() -> None:
    # K + V, f16, per token of one sequence: layers x 2 x KV heads x head size x 2 B.
    assert LLAMA_8B.kv_bytes(256) == 256 * 32 * 2 * 8 * 128 * 2  # 128 KiB a token
    assert QWEN3_30B_A3B.kv_bytes(256) == 256 * 48 * 2 * 4 * 128 * 2  # 96 KiB a token
    # gpt-oss: 12 global layers of 24 KiB a token; 12 sliding ones hold pad(128 + 512) = 768 cells whatever the window.
    assert GPT_OSS_20B.swa == tuple(i % 2 == 0 for i in range(24))
    assert GPT_OSS_20B.kv_bytes(65536) == 65536 * 12 * 2 * 8 * 64 * 2 + 768 * 12 * 2 * 8 * 64 * 2
    # --swa-full: every layer keeps the whole window.
    assert GPT_OSS_20B.kv_bytes(65536, swa_full=True) == 65536 * 24 * 2 * 8 * 64 * 2
    # Gemma 3 27B: 10 global layers (5, 11, ..., 59), 52 sliding ones of pad(1024 + 512) = 1536 cells.
    assert sum(not s for s in GEMMA3_27B.swa) == 10 and not GEMMA3_27B.swa[5] and GEMMA3_27B.swa[6]
    assert GEMMA3_27B.kv_bytes(32768) == 32768 * 10 * 2 * 16 * 128 * 2 + 1536 * 52 * 2 * 16 * 128 * 2
    # q8_0: 34 B per 32 values; q4_0: 18 B. A Llama-3.1-8B row of 8 x 128 = 1024 values is 1088 B / 576 B.
    assert LLAMA_8B.kv_bytes(256, kv_type="q8_0") == 256 * 32 * 2 * 1088
    assert LLAMA_8B.kv_bytes(256, kv_type="q4_0") == 256 * 32 * 2 * 576
    # The window is padded to 256 cells, as llama.cpp pads it.
    assert LLAMA_8B.kv_bytes(1000) == LLAMA_8B.kv_bytes(1024)


# (shape, usable GiB, KV type, --swa-full, expected (window, parallel), or None: refused)
CASES = [
    # Llama-3.1-8B: fixed 4692 + 128 = 4820 MiB; KV 128 KiB a token and sequence.
    # 8 GiB: 3372 MiB for KV. 4 x 32768 x 128 KiB = 16 GiB no; --parallel down: 2 x 32768 = 8 GiB no,
    #   1 x 32768 = 4 GiB no: the window comes down for one sequence: 3372 MiB / 128 KiB = 26976 -> 26880 (x256).
    ("llama-8gb", LLAMA_8B, 8, "f16", False, (26880, 1)),
    # 24 GiB: 19756 MiB for KV; 4 sequences: 19756 / 0.5 MiB = 39512 tokens -> 39424 (>= 32768: kept, 4 sequences).
    ("llama-24gb", LLAMA_8B, 24, "f16", False, (39424, 4)),
    # 80 GiB: 77100 MiB; the trained 131072 x 4 x 128 KiB = 64 GiB fits.
    ("llama-80gb", LLAMA_8B, 80, "f16", False, (131072, 4)),
    # q8_0 KV: 68 KiB a token. 8 GiB: 2 x 32768 x 68 KiB = 4352 MiB > 3372; 1 x 32768 = 2176 fits, so one
    #   sequence with the largest window: 3372 x 1024 / 68 = 50778 -> 50688.
    ("llama-8gb-q8", LLAMA_8B, 8, "q8_0", False, (50688, 1)),
    # Qwen3-30B-A3B: fixed 17700 + 128 = 17828 MiB, more than 8 GiB: refused.
    ("qwen-8gb", QWEN3_30B_A3B, 8, "f16", False, None),
    # 24 GiB: 6748 MiB for KV at 96 KiB a token. 4 x 32768 = 12 GiB no; 3 x 32768 = 9 GiB no; 2 x 32768 = 6144 MiB
    #   fits: 2 sequences, window up to the trained 40960: 6748 x 1024 / 192 = 35989 -> 35840.
    ("qwen-24gb", QWEN3_30B_A3B, 24, "f16", False, (35840, 2)),
    # 80 GiB: 40960 x 4 x 96 KiB = 15 GiB fits.
    ("qwen-80gb", QWEN3_30B_A3B, 80, "f16", False, (40960, 4)),
    # gpt-oss-20b: fixed 11600 + 128 = 11728 MiB > 8 GiB: refused.
    ("gpt-oss-8gb", GPT_OSS_20B, 8, "f16", False, None),
    # 24 GiB: 12848 MiB for KV. 131072 x 4 x 24 KiB = 12288 MiB + sliding 4 x 768 x 12 x 2 KiB = 72 MiB = 12360: fits.
    ("gpt-oss-24gb", GPT_OSS_20B, 24, "f16", False, (131072, 4)),
    # --swa-full: 48 KiB a token; 4 sequences: 12848 x 1024 / 192 = 68522 -> 68352 (>= 32768).
    ("gpt-oss-24gb-swa-full", GPT_OSS_20B, 24, "f16", True, (68352, 4)),
    ("gpt-oss-80gb", GPT_OSS_20B, 80, "f16", False, (131072, 4)),
    # Gemma 3 27B: fixed 15900 + 128 = 16028 MiB > 8 GiB: refused.
    ("gemma-8gb", GEMMA3_27B, 8, "f16", False, None),
    # 24 GiB: 8548 MiB for KV; global layers 80 KiB a token, sliding ones 624 MiB a sequence.
    #   4 x 32768: 10240 + 2496 no; 3: 7680 + 1872 = 9552 no; 2: 5120 + 1248 = 6368 fits ->
    #   2 sequences, window (8548 - 1248) x 1024 / 160 = 46720 -> 46592.
    ("gemma-24gb", GEMMA3_27B, 24, "f16", False, (46592, 2)),
    # 80 GiB: 65892 MiB; 131072 x 4 x 80 KiB = 40960 + 2496 = 43456 fits.
    ("gemma-80gb", GEMMA3_27B, 80, "f16", False, (131072, 4)),
]


@pytest.mark.parametrize("shape,gib,kv_type,swa_full,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_auto_window_and_parallel(shape: ModelShape, gib: int, kv_type: str, swa_full: bool,
                                  expected: tuple[int, int] | None) -> None:
    arch = next(a for a, s in (("llama", LLAMA_8B), ("qwen3moe", QWEN3_30B_A3B), ("gpt-oss", GPT_OSS_20B),
                               ("gemma3", GEMMA3_27B)) if s is shape)
    memory = Memory("test", usable=gib * GIB, free=gib * GIB, headroom=0)
    ask = Request(kv_type=kv_type, swa_full=swa_full, flash_attn=True)
    if expected is None:
        with pytest.raises(FitError, match=r"weights need 1\d,\d{3} MiB, more than the 8,192 MiB usable"):
            fit(shape, WEIGHTS[arch] * MIB, memory, ask)
        return
    chosen = fit(shape, WEIGHTS[arch] * MIB, memory, ask)
    assert (chosen.window, chosen.parallel) == expected
    assert chosen.total <= memory.usable
    if chosen.parallel < 4:
        assert "--parallel lowered from 4" in chosen.reason


def test_a_given_parallel_is_kept_and_the_window_comes_down_to_the_floor() -> None:
    # Llama-3.1-8B, 24 GiB, --parallel 16: 19756 MiB / (16 x 128 KiB) = 9878 tokens < 16384: refused
    # with the numbers (16 x 16384 x 128 KiB = 32768 MiB + 4820).
    memory = Memory("CUDA0", usable=24 * GIB, free=25 * GIB, headroom=GIB)
    with pytest.raises(FitError) as refused:
        fit(LLAMA_8B, WEIGHTS["llama"] * MIB, memory, Request(parallel=16, flash_attn=True))
    assert "--parallel 16" in str(refused.value) and "needs 37,588 MiB" in str(refused.value)
    assert "24,576 MiB usable in CUDA0" in str(refused.value)
    # --parallel 8: 19756 / 1 MiB = 19756 -> 19712 (>= 16384): kept, window lowered.
    chosen = fit(LLAMA_8B, WEIGHTS["llama"] * MIB, memory, Request(parallel=8, flash_attn=True))
    assert (chosen.window, chosen.parallel) == (19712, 8)
    assert "window lowered to 19712" in chosen.reason


def test_a_given_ctx_lowers_only_a_default_parallel() -> None:
    memory = Memory("RAM", usable=24 * GIB, free=26 * GIB, headroom=2 * GIB)
    # --ctx 65536: 4 x 65536 x 128 KiB = 32 GiB no; 2 x = 16 GiB + 4820 MiB fits.
    chosen = fit(LLAMA_8B, WEIGHTS["llama"] * MIB, memory, Request(ctx=65536, flash_attn=True))
    assert (chosen.window, chosen.parallel) == (65536, 2)
    # Both given: refused, never changed (4 x 8 GiB + 4820 MiB = 37588 MiB).
    with pytest.raises(FitError, match="--ctx 65536 with --parallel 4 needs 37,588 MiB"):
        fit(LLAMA_8B, WEIGHTS["llama"] * MIB, memory, Request(ctx=65536, parallel=4, flash_attn=True))


def test_without_flash_attention_the_scores_count() -> None:
    # The CPU: f32 scores of a 512-token micro-batch against the window, per head:
    # 512 x 32768 x 32 x 4 B = 2 GiB more than with flash attention.
    on = LLAMA_8B.compute_bytes(32768, 4, flash_attn=True)
    assert LLAMA_8B.compute_bytes(32768, 4, flash_attn=False) - on == 2 * GIB


def refusal(memory: Memory, ask: Request, weights_mib: int = 4820) -> str:
    with pytest.raises(FitError) as refused:
        fit(LLAMA_8B, weights_mib * MIB, memory, ask)
    return str(refused.value)


def test_a_refusal_advises_only_what_the_flags_left_to_change() -> None:
    """The advice follows where the model runs and what was given: no lower
    --parallel where one sequence was tried, no fewer --gpu-layers in RAM."""
    ram = Memory("RAM", usable=24 * GIB, free=26 * GIB, headroom=2 * GIB)
    # --ctx 10000000 without --parallel: one sequence was tried (not "--parallel 1", which nobody gave).
    alone = refusal(ram, Request(ctx=10_000_000, flash_attn=True))
    assert "--ctx 10000000, even as one sequence, needs" in alone
    assert alone.endswith("; try a smaller --ctx (or --ctx auto), or --kv-type q8_0 (with flash attention)"), alone
    # Given, more than one: lowering it is a way out.
    given = refusal(ram, Request(ctx=10_000_000, parallel=2, flash_attn=True))
    assert "--ctx 10000000 with --parallel 2 needs" in given
    assert given.endswith("; try a smaller --ctx (or --ctx auto), a lower --parallel, or --kv-type q8_0 "
                          "(with flash attention)"), given
    # Already q4_0: no smaller KV type to suggest.
    assert refusal(ram, Request(ctx=10_000_000, kv_type="q4_0", flash_attn=True)).endswith(
        "; try a smaller --ctx (or --ctx auto)")
    # The automatic window's floor without --parallel: one sequence, no lower --parallel.
    small = Memory("RAM", usable=6 * GIB, free=8 * GIB, headroom=2 * GIB)
    floor = refusal(small, Request(flash_attn=True))
    assert floor.startswith("one sequence of the smallest automatic window (16384 tokens) needs"), floor
    assert "--parallel" not in floor


def test_weights_that_do_not_fit_name_the_flag_that_made_the_room() -> None:
    """RAM under --models-max-mem: a larger budget, not "fewer --gpu-layers"
    (the model is on the CPU); a GPU given every layer: fewer of them."""
    capped = Memory("RAM (--models-max-mem)", usable=50 * MIB, free=26 * GIB, headroom=2 * GIB, capped=True)
    message = refusal(capped, Request(flash_attn=False))
    assert message.endswith("; use a larger --models-max-mem, or a smaller quantization of the model"), message
    assert "--gpu-layers" not in message
    ram = Memory("RAM", usable=4 * GIB, free=6 * GIB, headroom=2 * GIB)
    assert refusal(ram, Request(flash_attn=False)).endswith("; use a smaller quantization of the model")
    gpu = Memory("CUDA0", usable=4 * GIB, free=5 * GIB, headroom=GIB, gpu=True)
    assert refusal(gpu, Request(flash_attn=True)).endswith(
        "; use fewer --gpu-layers (the rest stays in RAM), or a smaller quantization of the model")
    # The window on a capped GPU: both ways out, after the window's own.
    gpu_capped = Memory("CUDA0 (--models-max-mem)", usable=6 * GIB, free=25 * GIB, headroom=GIB, gpu=True,
                        capped=True)
    assert refusal(gpu_capped, Request(ctx=131072, flash_attn=True)).endswith(
        "; try a smaller --ctx (or --ctx auto), --kv-type q8_0 (with flash attention), a larger --models-max-mem, "
        "or fewer --gpu-layers (the rest stays in RAM)")
