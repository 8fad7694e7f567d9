"""Disjoint resamples of a data spec: draws of the same size on documents no other draw uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoECompressError
from .calibration import CalibrationData, SourceInfo
from .encoding import Windows, chunks, encode_documents, pad_id, source_documents
from .spec import parse_spec


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
        docs, _, _, lazy = source_documents(src, seed, "calib")
        if lazy and not need:
            raise MoECompressError(
                f"'{src.term}' is streamed from the hub; give the number of sequences per draw."
            )
        have = 0
        for group in chunks(docs, 64):
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
        win = Windows(seq_len, False, eos, pad_id(tokenizer))
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
