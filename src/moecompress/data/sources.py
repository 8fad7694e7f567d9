"""Where calibration and evaluation text comes from: hub datasets, local files, the shipped fixtures.

A source yields *documents*: a string, or a ``(prompt, response)`` pair for instruction data
(rendered as a user/assistant exchange when a chat template is requested).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MoECompressError
from ..safejson import parse_json

Document = str | tuple[str, str]


@dataclass(frozen=True)
class HubDataset:
    """A hub dataset by its exact id, config and splits, and how a record becomes a document."""

    dataset_id: str
    config: str | None
    calib_split: str
    eval_split: str
    domain: str
    fields: tuple[str, ...] = ("text",)
    data_files: dict = field(default_factory=dict)  # split -> file inside the repo (C4 is 1024 shards)
    streaming: bool = False
    whole_split: bool = False  # WikiText: the split is one running text (lines joined), not documents


HUB_DATASETS: dict[str, HubDataset] = {
    # the GPTQ/SparseGPT convention: first training shard of C4 English, first validation shard for eval
    "c4": HubDataset(
        "allenai/c4",
        None,
        "train",
        "validation",
        "web crawl (C4, English)",
        data_files={
            "train": "en/c4-train.00000-of-01024.json.gz",
            "validation": "en/c4-validation.00000-of-00008.json.gz",
        },
        streaming=True,
    ),
    "wikitext2": HubDataset(
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
        "train",
        "test",
        "encyclopedic (Wikipedia, WikiText-2 raw)",
        whole_split=True,
    ),
    "fineweb-edu": HubDataset(
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
        "train",
        "educational web pages (FineWeb-Edu)",
        streaming=True,
    ),
    "gsm8k": HubDataset(
        "openai/gsm8k",
        "main",
        "train",
        "test",
        "grade-school math word problems (GSM8K)",
        fields=("question", "answer"),
    ),
}

_FIXTURE_DOMAIN = (
    "English prose: CPython 3.11 docs, World English Bible, The Devil's Dictionary "
    "(moecompress fixture corpus)"
)
FIXTURES: dict[str, tuple[str, str]] = {
    "fixture-calib": ("calib.txt", _FIXTURE_DOMAIN),
    "fixture-heldout": ("heldout.txt", _FIXTURE_DOMAIN),
}

# The three corpora inside each fixture text, as runs of its documents (scripts/build_fixture_corpus.py writes
# the Python docs, then the Bible books, then the dictionary letters, each split keeping that order).
# tests/test_drift_data.py checks every run's content.
FIXTURE_DOMAINS: dict[str, dict[str, tuple[int, int, str]]] = {
    "fixture-calib": {
        "technical": (0, 35, "technical documentation (CPython 3.11 docs)"),
        "scripture": (35, 40, "scripture (World English Bible)"),
        "aphorisms": (40, 43, "aphorisms (The Devil's Dictionary)"),
    },
    "fixture-heldout": {
        "technical": (0, 40, "technical documentation (CPython 3.11 docs)"),
        "scripture": (40, 48, "scripture (World English Bible)"),
        "aphorisms": (48, 51, "aphorisms (The Devil's Dictionary)"),
    },
}

# documents inside a .txt file are separated by two empty lines (the fixture corpus format)
_DOC_BREAK = re.compile(r"\n[ \t]*\n[ \t]*\n+")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")


def fixture_path(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "fixtures" / "data" / FIXTURES[name.split("/")[0]][0]


def fixture_domain(name: str) -> tuple[str, str] | None:
    """(fixture, domain) of a fixture domain term such as ``fixture-calib/scripture``, else None."""
    base, _, dom = name.partition("/")
    return (base, dom) if dom and dom in FIXTURE_DOMAINS.get(base, {}) else None


def fixture_documents(name: str) -> list[str]:
    """The documents of a fixture text, or of one of its corpora (``fixture-calib/aphorisms``).

    A corpus has too few documents for disjoint resamples (the dictionary is three letters), so a domain
    term's documents are its *passages*: the paragraphs of its documents (a dictionary entry, a paragraph
    of verses, a paragraph of documentation)."""
    docs = text_documents(fixture_path(name).read_text(encoding="utf-8"))
    dom = fixture_domain(name)
    if dom is None:
        return docs
    a, b, _ = FIXTURE_DOMAINS[dom[0]][dom[1]]
    return [p.strip("\n") for d in docs[a:b] for p in _PARAGRAPH_BREAK.split(d) if p.strip()]


def text_documents(text: str) -> list[str]:
    """A plain-text file's documents: blocks separated by two (or more) empty lines."""
    return [d.strip("\n") for d in _DOC_BREAK.split(text) if d.strip()]


def file_documents(path: str, fld: str | None) -> list[Document]:
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MoECompressError(f"{path} is not UTF-8 text; convert it to UTF-8.") from None
    if not raw.strip():
        raise MoECompressError(f"The data file {path} is empty; pass a file that holds text.")
    if p.suffix.lower() == ".txt":
        return text_documents(raw)
    records = []
    if p.suffix.lower() == ".json":
        # within `safejson`'s limits: nesting (no RecursionError) and number digits (no int-digit ValueError)
        data = parse_json(raw, str(path), 'pass a list of {"text": ...} objects', expect=None)
        records = data if isinstance(data, list) else [data]
    else:
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                records.append(
                    parse_json(
                        line,
                        f"Line {n} of {path}",
                        "a .jsonl file holds one JSON record per line",
                        expect=None,
                    )
                )
    docs = []
    for rec in records:
        if not isinstance(rec, dict) or fld not in rec:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise MoECompressError(
                f"A record of {path} has no field '{fld}' (it has: {keys}); pass "
                f"{path}#<field> naming the text field."
            )
        if isinstance(rec[fld], str) and rec[fld].strip():
            docs.append(rec[fld])
    if not docs:
        raise MoECompressError(
            f"The field '{fld}' of {path} holds no text; pass a file with non-empty records."
        )
    return docs


def hub_documents(name: str, split: str, seed: int, shuffle: bool = True) -> Iterator[Document]:
    """Documents of a hub dataset, shuffled with `seed` unless `shuffle` is False (streamed where large).

    Raises one sentence when the hub cannot be reached: offline, pass a local file instead.
    """
    from ..models.loading import hub_reachable

    ds_info = HUB_DATASETS[name]
    if not hub_reachable():
        raise MoECompressError(
            f"The dataset '{name}' ({ds_info.dataset_id}) comes from the HuggingFace hub, which "
            "is unreachable (offline); pass a local file instead, e.g. --data path/to/file.txt "
            "or path/to/file.jsonl#text."
        )
    try:
        import datasets
    except ImportError:  # pragma: no cover - the eval extra is missing
        raise MoECompressError(
            "Hub datasets need the 'datasets' package; pip install 'moecompress[eval]' or pass a local file."
        ) from None
    kwargs: dict = {"split": split, "streaming": ds_info.streaming}
    if ds_info.data_files:
        if split not in ds_info.data_files:
            raise MoECompressError(
                f"The dataset '{name}' has no split '{split}' here; use one of "
                f"{', '.join(ds_info.data_files)}."
            )
        kwargs["data_files"] = {split: ds_info.data_files[split]}
    elif ds_info.config is not None:
        kwargs["name"] = ds_info.config
    try:
        ds = datasets.load_dataset(ds_info.dataset_id, **kwargs)
    except Exception as exc:  # network errors, unknown split, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise MoECompressError(
            f"Could not load {ds_info.dataset_id} split '{split}' from the hub ({first}); "
            "check the split name or pass a local file."
        ) from None
    if ds_info.whole_split:
        # WikiText is one running text split into lines: joined as GPTQ does, one single document
        yield "\n\n".join(r["text"] for r in ds)
        return
    if shuffle:
        ds = ds.shuffle(seed=seed, buffer_size=10_000) if ds_info.streaming else ds.shuffle(seed=seed)
    for rec in ds:
        vals = [rec.get(f) or "" for f in ds_info.fields]
        if len(vals) == 2:
            yield (vals[0], vals[1])
        elif vals[0].strip():
            yield vals[0]
