"""A character-level tokenizer for the tiny random test models, which ship no tokenizer of their own."""

from __future__ import annotations


def char_tokenizer(vocab_size: int = 96):
    """A fast HF tokenizer mapping printable ASCII characters to ids 3.. (0 pad, 1 bos, 2 eos, last id unk).

    Characters beyond the vocabulary map to the unknown id; newlines map to the space's id. Used by
    tests and benchmarks with `moecompress.testing.tiny_model` (vocab 96).
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    unk = "<unk>"
    room = vocab_size - len(specials) - 1
    chars = [chr(c) for c in range(32, 127)][:room]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    vocab[unk] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), " ")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token=unk,
        model_max_length=1 << 30,
    )
    return fast
