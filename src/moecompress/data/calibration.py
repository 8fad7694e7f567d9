"""Calibration sequences (packed or padded) and evaluation token streams from a data spec.

Packed (default): each source's documents are tokenized, joined with EOS into one stream and cut
into full ``seq_len`` windows; a trailing remainder shorter than ``seq_len`` is dropped, so there
is no padding at all. Padded: every document is cut into windows of at most ``seq_len`` tokens and
short windows are right-padded with an attention mask of 0; padding never counts in any statistic.

Selection: a file/fixture source (or WikiText's single running text) yields every window its text
fills and ``count`` of them are drawn without replacement with ``seed`` (kept in text order); a
streamed hub source is read in seeded shuffled order until ``count`` windows are filled. A
``task:NAME:count`` term draws ``count`` of the task's documents with ``seed`` and gives one
right-padded sequence per rendered prompt (a prompt longer than ``seq_len`` continues in the next
row), whatever the packing mode: task prompts are short, separate questions, as the task asks them.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch

from ..errors import MoECompressError
from .encoding import Windows, chunks, encode_documents, pad_id, source_documents
from .spec import SourceSpec, parse_spec
from .tasks import task_prompts

DEFAULT_HUB_COUNT = 128
DEFAULT_TASK_DOCS = 128  # ConMoE calibrates on 128 documents of each task


@dataclass
class SourceInfo:
    """What one term of the spec contributed (for reports: domain and exact token count)."""

    term: str
    kind: str
    origin: str  # dataset id/config/split or file path
    domain: str
    sequences: int
    tokens: int
    documents: int | None = None  # task terms: documents drawn (the checklist's calibration size)
    split: str | None = None  # task terms: which split they came from

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class CalibrationData:
    """Token sequences for calibration: ``input_ids`` and ``attention_mask`` are [n, seq_len] int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    spec: str
    seq_len: int
    seed: int = 0
    padded: bool = False
    chat_template: bool = False
    sources: list[SourceInfo] = field(default_factory=list)

    def __post_init__(self):
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError("input_ids and attention_mask must both be [sequences, seq_len]")
        if self.num_tokens == 0:
            raise MoECompressError(
                f"The calibration data '{self.spec}' holds no tokens; pass text to calibrate on."
            )

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Exact count of real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    def fingerprint(self) -> str:
        """sha256 of the token ids and mask: the identity a stats store is tied to."""
        h = hashlib.sha256()
        h.update(self.input_ids.to(torch.int64).contiguous().numpy().tobytes())
        h.update(self.attention_mask.to(torch.int8).contiguous().numpy().tobytes())
        return h.hexdigest()

    def batches(self, batch_size: int, rank: int = 0, world: int = 1) -> list[tuple[int, slice]]:
        """(batch index, row slice) of the batches this rank handles (round-robin over ranks)."""
        n = self.num_sequences
        all_batches = [(b, slice(s, min(s + batch_size, n))) for b, s in enumerate(range(0, n, batch_size))]
        return all_batches[rank::world]

    def describe(self) -> str:
        parts = [f"{s.term} [{s.domain}]" for s in self.sources] or [self.spec]
        mode = "padded" if self.padded else "packed"
        return (
            f"{' + '.join(parts)}: {self.num_sequences} x {self.seq_len} {mode}, {self.num_tokens:,} tokens, "
            f"seed {self.seed}"
        )

    def to_dict(self) -> dict:
        return {
            "spec": self.spec,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "padded": self.padded,
            "chat_template": self.chat_template,
            "sequences": self.num_sequences,
            "tokens": self.num_tokens,
            "fingerprint": self.fingerprint(),
            "sources": [s.to_dict() for s in self.sources],
        }

    @classmethod
    def from_tokens(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        spec: str | None = None,
        seed: int = 0,
    ) -> CalibrationData:
        """Wrap ready-made token ids (no tokenizer needed); spec defaults to a content hash."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        mask = (
            torch.ones_like(ids)
            if attention_mask is None
            else torch.as_tensor(attention_mask, dtype=torch.int64)
        )
        data = cls(ids, mask, spec or "tokens", int(ids.shape[1]), seed, bool((mask == 0).any()))
        if spec is None:
            data.spec = f"tokens:{data.fingerprint()[:16]}"
        data.sources = [
            SourceInfo(
                data.spec, "tokens", "in-memory token ids", "unspecified", data.num_sequences, data.num_tokens
            )
        ]
        return data


def load_calibration(
    spec: str,
    tokenizer,
    seq_len: int = 2048,
    seed: int = 0,
    padding: bool = False,
    chat_template: bool = False,
    seq_len_from: str = "--seq-len",
) -> CalibrationData:
    """Tokenize, pack (or pad) and select the sequences a data spec asks for.

    Raises one sentence for a spec that names nothing, an empty file, a hub name offline, or data
    too short for the sequences requested. `seq_len_from`: what set `seq_len`, named in that sentence (a
    statistics store's recorded seq_len is not the user's --seq-len).
    """
    if seq_len < 1:
        raise MoECompressError(f"--seq-len must be a positive number of tokens, not {seq_len}.")
    terms = parse_spec(spec)
    eos = getattr(tokenizer, "eos_token_id", None)
    all_ids, all_mask, infos = [], [], []
    for k, src in enumerate(terms):
        if src.kind == "task":
            ids, mask, info = _task_rows(src, tokenizer, seq_len, seed, chat_template)
            all_ids.append(ids)
            all_mask.append(mask)
            infos.append(info)
            continue
        docs, origin, domain, lazy = source_documents(src, seed, "calib")
        want = src.count if src.count is not None else (DEFAULT_HUB_COUNT if src.kind == "hub" else None)
        win = Windows(seq_len, padding, eos, pad_id(tokenizer))
        for group in chunks(docs, 64):
            for ids in encode_documents(tokenizer, group, chat_template):
                win.add(list(ids))
            if lazy and want is not None and len(win) >= want:
                break
        have = len(win)
        if have == 0 or (want is not None and have < want):
            what = f"{want} sequences" if want is not None else "one sequence"
            raise MoECompressError(
                f"The data '{src.term}' holds {win.tokens:,} tokens, {have} full sequence(s) of {seq_len}, fewer than "
                f"the {what} requested; pass more text, a smaller count or a smaller {seq_len_from}."
            )
        if want is None or lazy:
            pick = list(range(want if want is not None else have))
        else:
            gen = torch.Generator().manual_seed(seed + 1000003 * k)
            pick = sorted(torch.randperm(have, generator=gen)[:want].tolist())
        ids, mask = win.tensors(pick)
        all_ids.append(ids)
        all_mask.append(mask)
        infos.append(SourceInfo(src.term, src.kind, origin, domain, len(pick), int(mask.sum())))
    return CalibrationData(
        torch.cat(all_ids), torch.cat(all_mask), spec, seq_len, seed, padding, chat_template, infos
    )


def _task_rows(src: SourceSpec, tokenizer, seq_len: int, seed: int, chat_template: bool):
    """(input_ids, attention_mask, SourceInfo) of a ``task:`` term: one padded row per rendered prompt."""
    tp = task_prompts(src.name, src.count if src.count is not None else DEFAULT_TASK_DOCS, seed, src.split)
    win = Windows(seq_len, True, getattr(tokenizer, "eos_token_id", None), pad_id(tokenizer))
    for ids in encode_documents(tokenizer, tp.prompts, chat_template):
        win.add(list(ids))
    ids, mask = win.tensors(list(range(len(win))))
    overlap = ", the split it is evaluated on" if tp.overlaps_evaluation else ""
    origin = f"lm-eval task {tp.task}, {tp.documents} of {tp.available} {tp.split} documents{overlap}"
    domain = f"{tp.task} prompts (lm-eval zero-shot rendering, unlabeled)"
    return (
        ids,
        mask,
        SourceInfo(src.term, "task", origin, domain, len(win), int(mask.sum()), tp.documents, tp.split),
    )


def load_tokenizer(source: str, tokenizer: str | None = None, trust_remote_code: bool = False):
    """The model's tokenizer (or an explicit one); one sentence when the directory has none. trust_remote_code
    goes to transformers as a bool, never None (which makes it prompt on a terminal for a tokenizer's own code)."""
    from transformers import AutoTokenizer

    from ..models.loading import hub_reachable

    name = tokenizer or source
    refusal = (
        f"No tokenizer could be loaded from {name}; pass --tokenizer with a directory or hub id holding "
        "the model's tokenizer."
    )
    try:
        tok = AutoTokenizer.from_pretrained(
            name, local_files_only=not hub_reachable(), trust_remote_code=bool(trust_remote_code)
        )
    except Exception:
        raise MoECompressError(refusal) from None
    # a directory with a config.json but no tokenizer files gives the family's tokenizer class with an empty
    # vocabulary (two special tokens), which would encode every text to nothing
    if len(tok) <= 2 and not tok("a b c").input_ids:
        raise MoECompressError(refusal)
    return tok
