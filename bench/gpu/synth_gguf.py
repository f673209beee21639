"""A synthetic GGUF of a real model's shape, for measuring speed where no real
weights can be fetched (a GPU machine with no network).

    python synth_gguf.py extract-tokenizer --src GGUF_PY_DIR --out tokenizer.json.gz
    python synth_gguf.py write --src GGUF_PY_DIR --tokenizer tokenizer.json.gz --shape llama3.1-8b --out m.gguf

``extract-tokenizer`` keeps the bundled SmolLM2's tokenizer and chat template
(JSON, ~1 MB gzipped): the synthetic model then renders and tokenizes exactly
as the bundled one, so lmspd's templates, tool formats and stop tokens apply
unchanged. ``write`` lays out a llama-architecture model of the named shape
with random Q4_0 weights (norms f32 ones). Random weights produce random text:
useful for throughput and latency, never for quality. Each weight block gets a
small finite scale, so activations stay finite through every layer, and the
same random bytes are reused for every layer's tensor of one shape (the
kernels do not care; writing 4 GB of fresh randomness would take longer than
the benchmark). ``GGUF_PY_DIR`` is llama.cpp's ``gguf-py`` (vendored in
llama-cpp-python's source), so nothing beyond numpy needs installing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np


@dataclass(frozen=True)
class Shape:
    layers: int
    embd: int
    ff: int
    heads: int
    kv_heads: int
    trained_ctx: int
    rope_theta: float


SHAPES = {
    # Llama-3.1-8B's config (its vocabulary replaced by the bundled tokenizer's).
    "llama3.1-8b": Shape(layers=32, embd=4096, ff=14336, heads=32, kv_heads=8, trained_ctx=131072,
                         rope_theta=500000.0),
    # A few MB: to check the whole pipeline on a CPU in seconds.
    "tiny": Shape(layers=2, embd=256, ff=512, heads=4, kv_heads=2, trained_ctx=8192, rope_theta=10000.0),
}

TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)


def _gguf(src: Path) -> ModuleType:
    sys.path.insert(0, str(src))
    import gguf

    return gguf


def extract_tokenizer(args: argparse.Namespace) -> int:
    gguf = _gguf(args.src)
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from _common import bundled_model_path

        args.model = bundled_model_path()
    reader = gguf.GGUFReader(str(args.model))
    out: dict[str, object] = {}
    for key in TOKENIZER_KEYS:
        field = reader.get_field(key)
        if field is not None:
            out[key] = {"type": int(field.types[0]), "sub": int(field.types[-1]) if len(field.types) > 1 else None,
                        "value": field.contents()}
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        json.dump(out, f)
    print(f"tokenizer: {len(out['tokenizer.ggml.tokens']['value'])} tokens -> {args.out}")  # type: ignore[index]
    return 0


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 data for a rows x cols matrix: per 32 weights an f16 scale
    and 16 bytes of nibbles. Scales ~ N(0, 1/sqrt(cols)) / 8 keep each dot
    product near unit size."""
    blocks = rows * cols // 32
    raw = rng.integers(0, 256, size=(blocks, 18), dtype=np.uint8)
    scale = (np.abs(rng.standard_normal(blocks)) * 0.5 + 0.5) / (8.0 * np.sqrt(cols))
    raw[:, 0:2] = scale.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, cols // 32 * 18)


def write(args: argparse.Namespace) -> int:
    gguf = _gguf(args.src)
    shape = SHAPES[args.shape]
    with gzip.open(args.tokenizer, "rt", encoding="utf-8") as f:
        tok = json.load(f)
    vocab = len(tok["tokenizer.ggml.tokens"]["value"])
    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_name(f"synthetic-{args.shape}")
    w.add_context_length(shape.trained_ctx)
    w.add_embedding_length(shape.embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.embd // shape.heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    for key, entry in tok.items():
        vtype = gguf.GGUFValueType(entry["type"])
        value = entry["value"]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType(entry["sub"]))
        else:
            w.add_key_value(key, value, vtype)

    rng = np.random.default_rng(args.seed)
    q4 = gguf.GGMLQuantizationType.Q4_0
    head = shape.embd // shape.heads
    kv = shape.kv_heads * head
    ones = np.ones(shape.embd, dtype=np.float32)
    # One random matrix per distinct shape, shared by every layer.
    cache: dict[tuple[int, int], np.ndarray] = {}

    def matrix(rows: int, cols: int) -> np.ndarray:
        if (rows, cols) not in cache:
            cache[(rows, cols)] = q4_0_blocks(rng, rows, cols)
        return cache[(rows, cols)]

    w.add_tensor("token_embd.weight", matrix(vocab, shape.embd), raw_dtype=q4)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", q4_0_blocks(rng, vocab, shape.embd), raw_dtype=q4)
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", matrix(shape.embd, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "attn_k.weight", matrix(kv, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "attn_v.weight", matrix(kv, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "attn_output.weight", matrix(shape.embd, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", matrix(shape.ff, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "ffn_up.weight", matrix(shape.ff, shape.embd), raw_dtype=q4)
        w.add_tensor(p + "ffn_down.weight", matrix(shape.embd, shape.ff), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {args.shape}, {shape.layers} layers, vocab {vocab}, {size / 2**30:.2f} GiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract-tokenizer")
    e.add_argument("--src", type=Path, required=True, help="llama.cpp's gguf-py folder")
    e.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    e.add_argument("--out", type=Path, required=True)
    wr = sub.add_parser("write")
    wr.add_argument("--src", type=Path, required=True, help="llama.cpp's gguf-py folder")
    wr.add_argument("--tokenizer", type=Path, required=True)
    wr.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    wr.add_argument("--seed", type=int, default=0)
    wr.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    return extract_tokenizer(args) if args.cmd == "extract-tokenizer" else write(args)


if __name__ == "__main__":
    raise SystemExit(main())
