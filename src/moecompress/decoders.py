"""Decoders for stored experts whose tensors are packed (e.g. PuzzleMoE element-wise merges).

A method that writes packed tensors registers a decoder for its construction:
``register_decoder("elementwise_merge", fn)`` with ``fn(tensors, prefix, stored) -> ExpertWeights``
(dense weights in the documented orientation). The runtime calls it when it builds the fused
stored-expert tensor; tensors that are already dense (``prefix.gate/up/down``) need no decoder.
"""

from __future__ import annotations

from collections.abc import Callable

_DECODERS: dict[str, Callable] = {}


def register_decoder(construction: str, fn: Callable) -> None:
    _DECODERS[construction] = fn


def has_decoder(construction: str) -> bool:
    return construction in _DECODERS


def get_decoder(construction: str) -> Callable:
    return _DECODERS[construction]
