"""Calibration and evaluation text: data specs, hub datasets, local files, packing and padding."""

from .calibration import CalibrationData, SourceInfo, load_calibration, load_tokenizer
from .encoding import encode_documents
from .resample import Resample, disjoint_resamples
from .sources import FIXTURES, HUB_DATASETS, HubDataset
from .spec import SourceSpec, parse_spec
from .stream import TokenStream, token_stream
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
