"""Matched-storage quantization baseline: round-to-nearest, group-wise, symmetric, on routed experts only.

For a weight matrix W [out, in] (gate/up: [I, H], down: [H, I]; "in" is the input dimension) and
b bits, each row is cut into groups of g = min(group_size, in) consecutive input columns (the last
group may be shorter). Per group G:

    qmax  = 2^(b-1) - 1                         (symmetric: codes in [-qmax, qmax]; 4-bit -> +-7, 3-bit -> +-3)
    s_G   = max_{j in G} |W_j| / qmax, stored as fp16 rounded *up* (so |W_j| / s_G <= qmax: no clipping)
    q_j   = round(W_j / s_G)                    (round half to even, torch.round)
    W'_j  = q_j * s_G                           => |W_j - W'_j| <= s_G / 2

Storage, exactly: b bits per weight plus 16 bits per group for the scale, i.e.
bits/weight = b + 16 * ceil(in / g) / in (4.125 and 3.125 at g = 128 when 128 divides `in`).
Expert biases (GPT-OSS) stay in the model dtype and are counted at that size.

The model is fake-quantized in memory (dequantized values written back through the adapter's
`set_expert`), so every evaluation path (perplexity, lm-eval, generate) runs it unchanged; the
reported bytes are what a packed int-b + fp16-scale format would take. llm-compressor (the
reference implementation of RTN/GPTQ schemes) cannot be installed in this project's environment:
it pins an older transformers than the v5 the adapters need.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import MoECompressError

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class QuantConfig(BaseModel):
    """Round-to-nearest baseline settings (bits in 2..8, group along the input dimension)."""

    model_config = ConfigDict(extra="forbid")

    bits: int = Field(4, ge=2, le=8)
    group_size: int = Field(128, ge=1)
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int = 128, scale_dtype: str = "float16"):
    """Quantize W [out, in] row-group-wise; return (dequantized W' [out, in] float32, scales [out, groups], codes int8).

    Scales are returned in float32 holding exactly the values of `scale_dtype` that were stored.
    """
    if w.dim() != 2:
        raise MoECompressError(f"Round-to-nearest expects a 2-D weight matrix, got shape {tuple(w.shape)}.")
    if not 2 <= bits <= 8:
        raise MoECompressError(f"{bits}-bit quantization is not supported; use 2 to 8 bits.")
    sdt = _SCALE_DTYPES[scale_dtype]
    out_dim, in_dim = w.shape
    g = min(group_size, in_dim)
    n_groups = math.ceil(in_dim / g)
    pad = n_groups * g - in_dim
    x = w.detach().float()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))  # zero columns never raise a group's max
    x = x.view(out_dim, n_groups, g)
    qmax = 2 ** (bits - 1) - 1
    s = x.abs().amax(-1) / qmax
    s_st = s.to(sdt)
    if sdt is not torch.float32:
        if torch.isinf(s_st).any():
            raise MoECompressError(f"A weight group's scale overflows {scale_dtype}; use scale_dtype='float32'.")
        low = s_st.float() < s  # storage rounding went down: step up one ulp so nothing clips
        s_st = torch.where(low, torch.nextafter(s_st, torch.full_like(s_st, float("inf"))), s_st)
    scale = s_st.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None]).clamp_(-qmax, qmax)
    deq = (codes * scale[..., None]).view(out_dim, n_groups * g)[:, :in_dim]
    return deq, scale, codes.view(out_dim, n_groups * g)[:, :in_dim].to(torch.int8)


def storage_bits(shape: tuple[int, int], bits: int, group_size: int = 128, scale_bits: int = 16) -> int:
    """Exact bits to store one [out, in] matrix: b per weight + one scale per (row, group)."""
    out_dim, in_dim = shape
    n_groups = math.ceil(in_dim / min(group_size, in_dim))
    return out_dim * in_dim * bits + out_dim * n_groups * scale_bits


def _param_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def quantize_experts(model, bits: int = 4, group_size: int = 128, scale_dtype: str = "float16",
                     layers: list[int] | None = None, progress: bool = True) -> dict[str, Any]:
    """Fake-quantize every routed expert of `model` in place; return exact storage accounting.

    Returns ``method`` "rtn", the config, ``weights`` (count), ``weight_bits``, ``scale_bits``,
    ``bits_per_weight`` (incl. scales), ``routed_bytes_before`` / ``routed_bytes_after`` (biases
    counted at model dtype), ``model_bytes_before`` / ``model_bytes_after`` (resident parameter
    bytes with the routed experts replaced by their packed size), ``max_abs_error``,
    ``rel_fro_error`` (||W - W'||_F / ||W||_F over all routed weights) and ``per_layer``.
    """
    from rich.progress import Progress

    from ..models import MoEAdapter

    cfg = QuantConfig(bits=bits, group_size=group_size, scale_dtype=scale_dtype)
    sbits = torch.finfo(_SCALE_DTYPES[cfg.scale_dtype]).bits
    adapter = MoEAdapter(model)
    layers = adapter.moe_layers if layers is None else layers
    model_before = _param_bytes(model)
    tot = dict(weights=0, weight_bits=0, scale_bits=0, before=0, bias_bytes=0, err2=0.0, norm2=0.0, maxerr=0.0)
    per_layer = []
    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task(f"RTN {cfg.bits}-bit experts", total=sum(adapter.num_experts(i) for i in layers))
        for i in layers:
            lay = dict(layer=i, experts=adapter.num_experts(i), err2=0.0, norm2=0.0, maxerr=0.0)
            for e in range(adapter.num_experts(i)):
                w = adapter.get_expert(i, e)
                new = {}
                for name, t in w.tensors().items():
                    tot["before"] += t.numel() * t.element_size()
                    if name.endswith("_bias"):
                        tot["bias_bytes"] += t.numel() * t.element_size()
                        new[name] = t
                        continue
                    deq, _, _ = rtn_quantize(t, cfg.bits, cfg.group_size, cfg.scale_dtype)
                    diff = deq - t.float()
                    lay["err2"] += float(diff.pow(2).sum())
                    lay["norm2"] += float(t.float().pow(2).sum())
                    lay["maxerr"] = max(lay["maxerr"], float(diff.abs().max()))
                    n_groups = math.ceil(t.shape[1] / min(cfg.group_size, t.shape[1]))
                    tot["weights"] += t.numel()
                    tot["weight_bits"] += t.numel() * cfg.bits
                    tot["scale_bits"] += t.shape[0] * n_groups * sbits
                    new[name] = deq.to(t.dtype)
                adapter.set_expert(i, e, type(w)(**new))
                bar.advance(job)
            tot["err2"] += lay["err2"]
            tot["norm2"] += lay["norm2"]
            tot["maxerr"] = max(tot["maxerr"], lay["maxerr"])
            per_layer.append(dict(layer=i, experts=lay["experts"], max_abs_error=lay["maxerr"],
                                  rel_fro_error=math.sqrt(lay["err2"] / lay["norm2"]) if lay["norm2"] else 0.0))
    total_bits = tot["weight_bits"] + tot["scale_bits"]
    after = math.ceil(total_bits / 8) + tot["bias_bytes"]
    return dict(method="rtn", bits=cfg.bits, group_size=cfg.group_size, scale_dtype=cfg.scale_dtype, symmetric=True,
                weights=tot["weights"], weight_bits=tot["weight_bits"], scale_bits=tot["scale_bits"],
                bits_per_weight=total_bits / tot["weights"] if tot["weights"] else 0.0,
                routed_bytes_before=tot["before"], routed_bytes_after=after, model_bytes_before=model_before,
                model_bytes_after=model_before - tot["before"] + after, max_abs_error=tot["maxerr"],
                rel_fro_error=math.sqrt(tot["err2"] / tot["norm2"]) if tot["norm2"] else 0.0, per_layer=per_layer)


def quant_arm(report: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """An arm skeleton for the results dict from a `quantize_experts` report (metrics to be filled in)."""
    return {
        "name": name or f"rtn-w{report['bits']}g{report['group_size']}",
        "method": "rtn", "kind": "quant_baseline",
        "params": {k: report[k] for k in ("bits", "group_size", "scale_dtype", "symmetric")},
        "gate_semantics": "unchanged (router untouched)",
        "bytes": {"model": report["model_bytes_after"], "routed_experts": report["routed_bytes_after"],
                  "note": "packed int-b + scale size; evaluated fake-quantized in memory"},
        "quant": {k: v for k, v in report.items() if k != "per_layer"},
        "metrics": {},
    }
