"""Perplexity, next-token accuracy and KL to a reference model, over fixed windows of a token stream.

Windows (the sliding-window evaluation of the HF perplexity guide): windows of `window` tokens
start every `stride` tokens (at most window - 1, so neighbours share a token); each token t >= 1
of the stream is scored exactly once, in the first window that contains it with at least one
token of context before it, with all of that window's earlier tokens as context. The default
stride (window - 1) scores disjoint spans; a smaller stride gives every scored token more context
at more compute.

Per scored token t (p = the evaluated model, q = the reference model, both on the same window):

    nll_t = -log p(x_t | x_<t)                                   perplexity = exp(sum nll_t / N)
    acc_t = [argmax_v p(v | x_<t) == x_t]                        next-token accuracy = mean acc_t
    kl_t  = sum_v q(v | x_<t) (log q(v | x_<t) - log p(v | x_<t)) KL(original || compressed) = mean kl_t

Per window (the paired item) we keep the window's mean nll / acc / kl and its token count, so two
arms evaluated on the same stream can be paired window by window (`stats.paired_bootstrap`).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import MoECompressError
from ..safejson import parse_json


def _read_text_file(path: Path) -> str:
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = parse_json(
                line, f"{path} line {n}", 'a .jsonl text file needs one {"text": ...} object per line'
            )
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise MoECompressError(
                    f"{path} line {n} has no string field 'text'; write one "
                    '{"text": ...} object per line.'
                )
            texts.append(row["text"])
        return "\n\n".join(texts)
    return path.read_text(encoding="utf-8")


def load_text(spec: str | os.PathLike) -> str:
    """The text of a local .txt / .jsonl file (fallback when `moecompress.data` is not installed)."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise MoECompressError(
            f"No text file at {spec}: pass a local .txt or .jsonl file (one "
            '{"text": ...} per line) or a list of token ids.'
        )
    return _read_text_file(path)


def token_stream(data, tokenizer=None, max_tokens: int | None = None) -> tuple[torch.Tensor, dict]:
    """(1-D LongTensor of token ids, source info) from token ids or a data spec.

    A string is a data spec in the calibration syntax (`moecompress.data`: a .txt/.jsonl path,
    fixture-heldout, wikitext2, c4, ...; documents joined with EOS); token ids are used as given.
    """
    info: dict = {}
    if isinstance(data, torch.Tensor):
        ids = data.reshape(-1).long()
        info["source"] = "token ids"
    elif isinstance(data, (list, tuple)) and all(isinstance(x, int) for x in data):
        ids = torch.tensor(data, dtype=torch.long)
        info["source"] = "token ids"
    elif isinstance(data, (str, os.PathLike)):
        if tokenizer is None:
            raise MoECompressError(
                "Perplexity on a text spec needs the model's tokenizer; pass tokenizer= "
                "(or give token ids instead of text)."
            )
        try:
            from ..data import token_stream as spec_stream
        except ImportError:  # older checkout without the data-spec module: plain local files only
            spec_stream = None
        info["source"] = str(data)
        if spec_stream is not None:
            stream = spec_stream(str(data), tokenizer)
            ids = stream.ids.reshape(-1).long()
            info["domain"] = "; ".join(sorted({s.domain for s in stream.sources if s.domain}))
        else:
            ids = torch.tensor(
                tokenizer(load_text(data), add_special_tokens=False)["input_ids"], dtype=torch.long
            )
    else:
        raise MoECompressError(
            f"Cannot evaluate on a {type(data).__name__}; pass a text file path or data spec, "
            "or a list of token ids."
        )
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise MoECompressError(
            f"The evaluation text has {ids.numel()} token(s); at least 2 are needed — give a longer text."
        )
    return ids, info


def windows(n_tokens: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window over a stream of `n_tokens` tokens (see module doc).

    Window k covers [k*s, min(k*s + window, n)) with s = min(stride, window - 1): adjacent windows
    share at least one token, so every token t >= 1 is predicted from context (stride = window is
    read as window - 1: the disjoint-targets setting, as in lm-eval's rolling loglikelihood).
    """
    stride = window - 1 if stride is None else stride
    if window < 2 or not (1 <= stride <= window):
        raise MoECompressError(
            f"Window {window} / stride {stride} is invalid; use window >= 2 and 1 <= stride <= window."
        )
    stride = min(stride, window - 1)
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _device(model) -> torch.device:
    try:
        return next(p.device for p in model.parameters() if p.device.type != "meta")
    except StopIteration:
        return torch.device("cpu")


def _fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:12]


@torch.no_grad()
def evaluate_stream(
    model,
    data,
    tokenizer=None,
    *,
    reference=None,
    window: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4,
    name: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity, next-token accuracy and (with `reference`) KL(reference || model) over windows.

    Returns a task entry of the results dict (docs/evaluation.md): ``output_type`` "perplexity",
    ``aggregate`` {ppl, nll, acc[, kl]} (token-weighted), ``higher_is_better``, ``primary`` "nll",
    ``n``/``n_tokens``, window settings, the stream ``fingerprint``, and ``items``: one per window
    with ids "<fingerprint>:<begin>", mean ``nll``, ``acc``, ``kl`` and ``n_tokens``.
    """
    ids, info = token_stream(data, tokenizer, max_tokens)
    wins = windows(ids.numel(), window, stride)
    fp = _fingerprint(ids)
    dev = _device(model)
    ref_dev = _device(reference) if reference is not None else None
    recs: list[dict] = []
    batches = _window_batches(wins, batch_size)
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task("perplexity windows", total=len(wins))
        for batch in batches:
            x = torch.stack([ids[b:e] for b, e, _ in batch])
            logits, ref_logits = _batch_logits(model, reference, x, dev, ref_dev)
            recs.extend(_window_records(batch, ids, logits, ref_logits, fp))
            bar.advance(job, len(batch))
    recs.sort(key=lambda r: int(r["id"].split(":")[1]))
    n = sum(r["n_tokens"] for r in recs)
    aggregate, higher, items = _stream_summary(recs, n, reference is not None)
    return {
        "output_type": "perplexity",
        "source": name if name is not None else info["source"],
        **({"domain": info["domain"]} if info.get("domain") else {}),
        "window": window,
        "stride": min(stride or window, window - 1),
        "fingerprint": fp,
        "n": len(recs),
        "n_tokens": n,
        "aggregate": aggregate,
        "higher_is_better": higher,
        "primary": "nll",
        "items": items,
    }


def _window_batches(wins: list, batch_size: int) -> list[list[tuple[int, int, int]]]:
    """`wins` in batches of at most `batch_size`; windows of equal length batch together (all but possibly
    the last one)."""
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in wins:
        groups.setdefault(w[1] - w[0], []).append(w)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def _batch_logits(model, reference, x: torch.Tensor, dev, ref_dev):
    """The model's logits on the batch `x`, and the reference's (or None); one sentence when their vocabularies
    differ."""
    logits = model(input_ids=x.to(dev), use_cache=False).logits
    ref_logits = reference(input_ids=x.to(ref_dev), use_cache=False).logits if reference is not None else None
    if ref_logits is not None and ref_logits.shape[-1] != logits.shape[-1]:
        raise MoECompressError(
            f"The reference model's vocabulary ({ref_logits.shape[-1]}) differs from the "
            f"model's ({logits.shape[-1]}); KL needs the same tokenizer and vocabulary."
        )
    return logits, ref_logits


def _window_records(batch, ids: torch.Tensor, logits, ref_logits, fp: str) -> list[dict]:
    """One record per window of `batch`: its id, scored tokens, mean nll and accuracy (and KL with a
    reference)."""
    recs = []
    for j, (b, e, first) in enumerate(batch):
        # logits at position p predict token p+1: scored tokens first..e-1 use positions first-1-b..e-2-b
        sl = slice(first - 1 - b, e - 1 - b)
        target = ids[first:e].to(logits.device)
        logp = torch.log_softmax(logits[j, sl].float(), dim=-1)
        nll = -logp.gather(-1, target[:, None]).squeeze(-1)
        acc = (logp.argmax(-1) == target).float()
        rec = {
            "id": f"{fp}:{b}",
            "n_tokens": e - first,
            "nll": nll.mean().item(),
            "acc": acc.mean().item(),
        }
        if ref_logits is not None:
            logq = torch.log_softmax(ref_logits[j, sl].float().to(logp.device), dim=-1)
            kl = (logq.exp() * (logq - logp)).sum(-1).clamp_min(0.0)
            rec["kl"] = kl.mean().item()
        recs.append(rec)
    return recs


def _stream_summary(recs: list[dict], n: int, with_kl: bool) -> tuple[dict, dict, dict]:
    """The token-weighted aggregate of the window records `recs` (`n` tokens), each metric's direction, and
    the per-window items."""

    def wmean(key: str) -> float:
        return sum(r[key] * r["n_tokens"] for r in recs) / n

    nll = wmean("nll")
    aggregate = {"ppl": math.exp(nll), "nll": nll, "acc": wmean("acc")}
    higher = {"ppl": False, "nll": False, "acc": True}
    metrics = ["nll", "acc"]
    if with_kl:
        aggregate["kl"] = wmean("kl")
        higher["kl"] = False
        metrics.append("kl")
    items: dict[str, list] = {"ids": [r["id"] for r in recs], "n_tokens": [r["n_tokens"] for r in recs]}
    for k in metrics:
        items[k] = [r[k] for r in recs]
    return aggregate, higher, items


def kl_divergence(model, reference, data, tokenizer=None, **kwargs) -> float:
    """Mean KL(reference || model) per scored token (convenience wrapper over `evaluate_stream`)."""
    return evaluate_stream(model, data, tokenizer, reference=reference, **kwargs)["aggregate"]["kl"]


def perplexity(model, data, tokenizer=None, **kwargs) -> float:
    """Token-weighted perplexity over windows (convenience wrapper over `evaluate_stream`)."""
    return evaluate_stream(model, data, tokenizer, **kwargs)["aggregate"]["ppl"]


def item_values(entry: dict, metric: str | None = None) -> tuple[list, list[float]]:
    """(ids, per-item values of `metric`, default the entry's primary) from a task entry."""
    metric = metric or entry["primary"]
    items = entry["items"]
    if metric not in items:
        raise MoECompressError(
            f"The results have no per-item values for '{metric}' (available: "
            f"{', '.join(k for k in items if k != 'ids')}); re-run the evaluation with per-item "
            "logging."
        )
    return list(items["ids"]), [float(v) if v is not None else float("nan") for v in items[metric]]


__all__: Sequence[str] = (
    "evaluate_stream",
    "item_values",
    "kl_divergence",
    "load_text",
    "perplexity",
    "token_stream",
    "windows",
)
