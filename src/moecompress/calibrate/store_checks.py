"""What a stats store's own files must say before a reader trusts them (issue 51): stats.json's fields and types
(`check_meta`), and each layer file's record of its layer and model (`check_identity`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import MoECompressError

# what every reader of stats.json relies on: key -> (type, what it must be); nested keys as "outer.inner"
_META = {
    "model": (dict, "an object"),
    "model.fingerprint": (str, "a string"),
    "model.source": (str, "a string"),
    "data": (dict, "an object"),
    "data.spec": (str, "a string"),
    "data.fingerprint": (str, "a string"),
    "data.tokens": (int, "an integer"),
    "data.seq_len": (int, "an integer"),
    "data.seed": (int, "an integer"),
    "stats": (list, "a list of statistic names"),
    "layers": (list, "a list of layer numbers"),
}


def check_meta(meta_file: Path, meta: dict) -> None:
    """Refuse, in one sentence, a stats.json that lacks a field the readers use or holds one of the wrong type
    (a crafted or damaged file: ``[]``, no "model", ``"stats": null``), before any reader trips over it."""

    def bad(key: str, what: str):
        return MoECompressError(
            f"{meta_file} is not a stats store's metadata ('{key}' {what}): the store is corrupted; re-run "
            "calibration."
        )

    for key, (kind, what) in _META.items():
        outer, _, inner = key.partition(".")
        container = meta[outer] if inner else meta  # "model" and "data" are checked before their fields
        if (inner or outer) not in container:
            raise bad(key, "is missing")
        value = container[inner or outer]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise bad(key, f"must be {what}")
    if not all(isinstance(n, str) for n in meta["stats"]):
        raise bad("stats", "must be a list of statistic names")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in meta["layers"]):
        raise bad("layers", "must be a list of layer numbers")
    unreached = meta.get("unreached", {})
    if not isinstance(unreached, dict) or not all(
        isinstance(v, list) and all(isinstance(e, int) for e in v) for v in unreached.values()
    ):
        raise bad("unreached", "must map layers to lists of experts")
    sources = meta["data"].get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(x, dict) for x in sources):
        raise bad("data.sources", "must be a list of objects")


def check_identity(path: Path, metadata: dict | None, layer: int, model_fingerprint) -> None:
    """Refuse a layer file whose own metadata names another layer (files swapped or renamed on disk) or another
    model (a file copied in from another store). Files written before issue 51 record neither and pass."""
    metadata = metadata or {}
    if "layer" in metadata and metadata["layer"] != str(layer):
        raise MoECompressError(
            f"{path} holds the statistics of layer {str(metadata['layer'])[:20]}, not {layer}: the store's "
            "files were swapped or renamed; re-run calibration."
        )
    if "model" in metadata and model_fingerprint is not None and metadata["model"] != model_fingerprint:
        raise MoECompressError(
            f"{path} was made for another model than the one its stats store's stats.json records (files of "
            "two stores were mixed, or the record was edited); re-run calibration."
        )
