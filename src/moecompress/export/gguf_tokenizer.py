"""The tokenizer in a GGUF: llama.cpp's byte-level BPE (``gpt2``: tokens, token types, merges, special ids), with
the pre-tokenizer named after the tokenizer's own splitting rule (`export.gguf`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MoECompressError

# Hugging Face's Split regex of the Qwen2/Qwen3 tokenizers: llama.cpp's "qwen2" pre-tokenizer
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def pre_tokenizer(tok: dict) -> str | None:
    """llama.cpp's name for the tokenizer's splitting rule, or None when it is not one this writer knows.

    A byte-level BPE splitting with GPT-2's regex (ByteLevel, use_regex, no prefix space) is llama.cpp's ``gpt-2``
    (the same regex as its ``olmo``); the Qwen2/Qwen3 Split regex is ``qwen2``."""
    pre = tok.get("pre_tokenizer") or {}
    if (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and tok.get("normalizer") is None
    ):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (
        len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[0].get("pattern", {}).get("Regex") == _QWEN2_SPLIT
        and parts[1].get("type") == "ByteLevel"
        and not parts[1].get("use_regex", True)
    ):
        return "qwen2"
    return None


def add_tokenizer(w, directory: Path | None, vocab_size: int) -> None:
    """Vocabulary (one entry per embedding row), token types, merges and special ids, as llama.cpp's ``gpt2``."""
    import gguf

    path = directory / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file():
        raise MoECompressError(
            "A GGUF export needs the model's tokenizer.json; export from the checkpoint "
            "directory that holds it."
        )
    tok = json.loads(path.read_text())
    model, pre = tok.get("model", {}), pre_tokenizer(tok)
    if model.get("type") != "BPE" or pre is None:
        raise MoECompressError(
            f"{path} is not a byte-level BPE tokenizer with a pre-tokenizer this GGUF writer can "
            "name for llama.cpp; export with format='hf' and convert with llama.cpp's "
            "convert_hf_to_gguf.py."
        )
    names = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        elif i in names:
            tokens.append(names[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(w, quiet=True)
    if not special.add_special_token:  # the tokenizer adds no special tokens itself: neither does llama.cpp
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
