"""Evaluation token streams: every document of a spec joined into one stream, for strided perplexity."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import MoECompressError
from .calibration import SourceInfo
from .encoding import chunks, encode_documents, source_documents
from .spec import parse_spec


@dataclass
class TokenStream:
    """All documents of a spec as one token stream (for perplexity windows with a stride)."""

    ids: torch.Tensor  # [N] int64
    spec: str
    sources: list[SourceInfo]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def windows(self, seq_len: int, stride: int | None = None) -> Iterable[tuple[int, int, int]]:
        """(begin, end, first scored position) of strided perplexity windows (HF's sliding-window recipe)."""
        stride = stride or seq_len
        prev_end = 0
        for begin in range(0, self.num_tokens, stride):
            end = min(begin + seq_len, self.num_tokens)
            yield begin, end, max(begin, prev_end)
            prev_end = end
            if end == self.num_tokens:
                break


def token_stream(
    spec: str, tokenizer, seq_len: int | None = None, seed: int = 0, chat_template: bool = False
) -> TokenStream:
    """Token stream of a spec for evaluation: hub sources default to their evaluation split
    (wikitext2 -> test, c4 -> validation, gsm8k -> test), documents in dataset order, joined with EOS.
    A term's ``:count`` keeps its first ``count * seq_len`` tokens.
    """
    terms = parse_spec(spec)
    eos = getattr(tokenizer, "eos_token_id", None)
    parts, infos = [], []
    for src in terms:
        if src.count is not None and seq_len is None:
            raise MoECompressError(
                f"'{src.term}' asks for {src.count} windows but no window length was given; pass seq_len."
            )
        limit = None if src.count is None else src.count * seq_len
        docs, origin, domain, _ = source_documents(src, seed, "eval")
        stream: list[int] = []
        for group in chunks(docs, 64):
            for ids in encode_documents(tokenizer, group, chat_template):
                stream.extend(ids)
                if eos is not None and ids and ids[-1] != eos:
                    stream.append(eos)
            if limit is not None and len(stream) >= limit:
                break
        if limit is not None:
            if len(stream) < limit:
                raise MoECompressError(
                    f"The data '{src.term}' holds {len(stream):,} tokens, fewer than the "
                    f"{limit:,} requested; pass more text or a smaller count."
                )
            stream = stream[:limit]
        if not stream:
            raise MoECompressError(f"The data '{src.term}' holds no tokens; pass a file with text.")
        parts.append(torch.tensor(stream, dtype=torch.int64))
        infos.append(SourceInfo(src.term, src.kind, origin, domain, 0, len(stream)))
    return TokenStream(torch.cat(parts), spec, infos)
