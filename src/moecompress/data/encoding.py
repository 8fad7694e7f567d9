"""Documents to tokens: reading a spec term's documents, encoding them (optionally through the chat template)
and cutting them into packed or padded windows of ``seq_len``."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import MoECompressError
from .sources import (
    FIXTURE_DOMAINS,
    FIXTURES,
    HUB_DATASETS,
    Document,
    file_documents,
    fixture_documents,
    fixture_domain,
    fixture_path,
    hub_documents,
)
from .spec import SourceSpec


def _render(doc: Document) -> str:
    return doc if isinstance(doc, str) else f"{doc[0]}\n{doc[1]}"


def encode_documents(tokenizer, docs: list[Document], chat_template: bool = False) -> list[list[int]]:
    """Token ids of each document (the tokenizer's special tokens included, as in its own use)."""
    if not docs:
        return []
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise MoECompressError(
                "The tokenizer has no chat template; drop --chat-template for a base model or "
                "pass the instruct model's tokenizer."
            )
        texts = []
        for d in docs:
            msgs = (
                [{"role": "user", "content": d}]
                if isinstance(d, str)
                else [{"role": "user", "content": d[0]}, {"role": "assistant", "content": d[1]}]
            )
            texts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False))
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return tokenizer([_render(d) for d in docs], add_special_tokens=True, verbose=False)["input_ids"]


def pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


class Windows:
    """Accumulates documents' tokens into packed or padded windows of seq_len."""

    def __init__(self, seq_len: int, padded: bool, eos: int | None, pad: int):
        self.seq_len, self.padded, self.eos, self.pad = seq_len, padded, eos, pad
        self.stream: list[int] = []
        self.rows: list[list[int]] = []

    def add(self, ids: list[int]) -> None:
        if not ids:
            return
        if self.padded:
            for s in range(0, len(ids), self.seq_len):
                self.rows.append(ids[s : s + self.seq_len])
        else:
            self.stream.extend(ids)
            if self.eos is not None and ids[-1] != self.eos:
                self.stream.append(self.eos)

    def __len__(self) -> int:
        return len(self.rows) if self.padded else len(self.stream) // self.seq_len

    @property
    def tokens(self) -> int:
        return sum(map(len, self.rows)) if self.padded else len(self.stream)

    def tensors(self, pick: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(pick), self.seq_len), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(pick), self.seq_len), dtype=torch.int64)
        for r, w in enumerate(pick):
            row = self.rows[w] if self.padded else self.stream[w * self.seq_len : (w + 1) * self.seq_len]
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
            mask[r, : len(row)] = 1
        return ids, mask


def source_documents(src: SourceSpec, seed: int, purpose: str) -> tuple[Iterator[Document], str, str, bool]:
    """(documents, origin, domain, streamed) of one spec term; streamed sources are read lazily."""
    if src.kind == "task":
        raise MoECompressError(
            f"'{src.term}' is a calibration term (task prompts, unlabeled); to score a model on "
            f"the task, pass it to --tasks ({src.name}) instead of a text spec."
        )
    if src.kind == "hub":
        info = HUB_DATASETS[src.name]
        split = src.split or (info.calib_split if purpose == "calib" else info.eval_split)
        origin = f"{info.dataset_id}" + (f" ({info.config})" if info.config else "") + f" split {split}"
        lazy = not info.whole_split
        return hub_documents(src.name, split, seed, shuffle=purpose == "calib"), origin, info.domain, lazy
    if src.split:
        raise MoECompressError(f"'@{src.split}' only applies to hub datasets, not to {src.name}; drop it.")
    if src.kind == "fixture":
        path = fixture_path(src.name)
        if not path.is_file():
            raise MoECompressError(
                f"The fixture text {path} is missing; reinstall moecompress from a full clone."
            )
        dom = fixture_domain(src.name)
        domain = FIXTURES[src.name][1] if dom is None else FIXTURE_DOMAINS[dom[0]][dom[1]][2]
        return iter(fixture_documents(src.name)), f"{src.name} ({path.name})", domain, False
    return iter(file_documents(src.name, src.field)), src.name, f"local file {src.name}", False


def chunks(it: Iterator[Document], n: int) -> Iterator[list[Document]]:
    buf: list[Document] = []
    for d in it:
        buf.append(d)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf
