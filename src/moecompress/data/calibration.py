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
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

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


# ----------------------------------------------------------------------------------- tokenizing
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


def _pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


class _Windows:
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


def _source_documents(src: SourceSpec, seed: int, purpose: str) -> tuple[Iterator[Document], str, str, bool]:
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


def _chunks(it: Iterator[Document], n: int) -> Iterator[list[Document]]:
    buf: list[Document] = []
    for d in it:
        buf.append(d)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def load_calibration(
    spec: str,
    tokenizer,
    seq_len: int = 2048,
    seed: int = 0,
    padding: bool = False,
    chat_template: bool = False,
) -> CalibrationData:
    """Tokenize, pack (or pad) and select the sequences a data spec asks for.

    Raises one sentence for a spec that names nothing, an empty file, a hub name offline, or data
    too short for the sequences requested.
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
        docs, origin, domain, lazy = _source_documents(src, seed, "calib")
        want = src.count if src.count is not None else (DEFAULT_HUB_COUNT if src.kind == "hub" else None)
        win = _Windows(seq_len, padding, eos, _pad_id(tokenizer))
        for group in _chunks(docs, 64):
            for ids in encode_documents(tokenizer, group, chat_template):
                win.add(list(ids))
            if lazy and want is not None and len(win) >= want:
                break
        have = len(win)
        if have == 0 or (want is not None and have < want):
            what = f"{want} sequences" if want is not None else "one sequence"
            raise MoECompressError(
                f"The data '{src.term}' holds {win.tokens:,} tokens, {have} full sequence(s) of {seq_len}, fewer than "
                f"the {what} requested; pass more text, a smaller count or a smaller --seq-len."
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
    win = _Windows(seq_len, True, getattr(tokenizer, "eos_token_id", None), _pad_id(tokenizer))
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


@dataclass
class Resample:
    """One draw of a spec for resampling studies: its sequences and which of the spec's documents it used."""

    data: CalibrationData
    documents: list[int]  # indices into the spec's documents (terms concatenated in order), each used once


def _pool(spec: str, tokenizer, seed: int, chat_template: bool, need: int) -> list[list[int]]:
    """Token ids of the spec's documents, terms concatenated; a streamed hub term is read until `need` tokens."""
    pool: list[list[int]] = []
    for src in parse_spec(spec):
        if src.kind == "task":
            raise MoECompressError(f"'{src.term}' draws task documents itself; resample a text spec instead.")
        docs, _, _, lazy = _source_documents(src, seed, "calib")
        if lazy and not need:
            raise MoECompressError(
                f"'{src.term}' is streamed from the hub; give the number of sequences per draw."
            )
        have = 0
        for group in _chunks(docs, 64):
            for ids in encode_documents(tokenizer, group, chat_template):
                pool.append(list(ids))
                have += len(ids)
            if lazy and have >= need:
                break
    return pool


def _deal(pool: list[list[int]], order: list[int], need: int, resamples: int) -> list[list[int]] | None:
    """Documents (in `order`) each draw takes to reach `need` packed tokens (+1 EOS each), or None if they run out."""
    draws, pos = [], 0
    for _ in range(resamples):
        used, have = [], 0
        while have < need and pos < len(order):
            used.append(order[pos])
            have += len(pool[order[pos]]) + 1
            pos += 1
        if have < need:
            return None
        draws.append(used)
    return draws


def max_resample_sequences(pool: list[list[int]], order: list[int], seq_len: int, resamples: int) -> int:
    """The most windows of `seq_len` each of `resamples` disjoint draws can fill (0 if not even one)."""
    n = sum(len(d) + 1 for d in pool) // (resamples * seq_len)
    while n > 0 and _deal(pool, order, n * seq_len, resamples) is None:
        n -= 1
    return n


def disjoint_resamples(
    spec: str,
    tokenizer,
    seq_len: int,
    sequences: int | None,
    resamples: int,
    seed: int = 0,
    chat_template: bool = False,
) -> list[Resample]:
    """`resamples` draws of `spec`, each exactly `sequences` packed windows of `seq_len` tokens, on disjoint documents.

    The spec's documents are shuffled with `seed` and dealt out in that order: draw r takes documents until
    its packed stream (EOS after each document, as `load_calibration` packs) fills its windows; the document
    cut at the end of a draw is not used again, so no document feeds two draws. Same spec and seed, same
    draws. `sequences=None` takes the most the spec can fill; too little text gives one sentence saying how
    many it can.
    """
    if resamples < 1 or (sequences is not None and sequences < 1):
        raise MoECompressError(
            f"Resampling needs at least one sequence and one draw (got {sequences} sequences, "
            f"{resamples} draws)."
        )
    pool = _pool(spec, tokenizer, seed, chat_template, (sequences or 0) * seq_len * resamples)
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    most = max_resample_sequences(pool, order, seq_len, resamples)
    if sequences is None:
        sequences = most
    if sequences > most or most == 0:
        raise MoECompressError(
            f"The data '{spec}' is too short for {resamples} disjoint draws of {sequences} x "
            f"{seq_len} tokens; it fills at most {most} sequences per draw, so ask for that many "
            "or fewer draws."
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for r, used in enumerate(_deal(pool, order, sequences * seq_len, resamples)):
        win = _Windows(seq_len, False, eos, _pad_id(tokenizer))
        for d in used:
            win.add(pool[d])
        ids, mask = win.tensors(list(range(sequences)))
        info = SourceInfo(
            f"{spec}#draw{r}",
            "resample",
            f"{spec}, draw {r} of {resamples} (seed {seed})",
            spec,
            sequences,
            int(mask.sum()),
            len(used),
        )
        out.append(
            Resample(
                CalibrationData(ids, mask, f"{spec}#draw{r}", seq_len, seed, False, chat_template, [info]),
                sorted(used),
            )
        )
    return out


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
        docs, origin, domain, _ = _source_documents(src, seed, "eval")
        stream: list[int] = []
        for group in _chunks(docs, 64):
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


def load_tokenizer(source: str, tokenizer: str | None = None):
    """The model's tokenizer (or an explicit one); one sentence when the directory has none."""
    from transformers import AutoTokenizer

    from ..models.loading import hub_reachable

    name = tokenizer or source
    refusal = (
        f"No tokenizer could be loaded from {name}; pass --tokenizer with a directory or hub id holding "
        "the model's tokenizer."
    )
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=not hub_reachable())
    except Exception:
        raise MoECompressError(refusal) from None
    # a directory with a config.json but no tokenizer files gives the family's tokenizer class with an empty
    # vocabulary (two special tokens), which would encode every text to nothing
    if len(tok) <= 2 and not tok("a b c").input_ids:
        raise MoECompressError(refusal)
    return tok
