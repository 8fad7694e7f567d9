"""Calibration and evaluation text: data specs, hub datasets, local files, packing and padding."""

from .calibration import (
    CalibrationData,
    Resample,
    SourceInfo,
    TokenStream,
    disjoint_resamples,
    encode_documents,
    load_calibration,
    load_tokenizer,
    token_stream,
)
from .sources import FIXTURES, HUB_DATASETS, HubDataset
from .spec import SourceSpec, parse_spec
from .tokenizers import char_tokenizer

__all__ = [
    "FIXTURES",
    "HUB_DATASETS",
    "CalibrationData",
    "HubDataset",
    "Resample",
    "SourceInfo",
    "SourceSpec",
    "TokenStream",
    "char_tokenizer",
    "disjoint_resamples",
    "encode_documents",
    "load_calibration",
    "load_tokenizer",
    "parse_spec",
    "token_stream",
]
