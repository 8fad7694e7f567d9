"""What a calibration run records and compares: the identity a resumed run must match, the settings that
change a store's content, and the store's metadata (stats.json)."""

from __future__ import annotations

import json

import torch

from .store import FORMAT, versions


def run_identity(reader, fingerprint, calib, names, params, dtype, device, batch_size) -> dict:
    """What must match for a resumed run to give identical statistics (normalised through JSON)."""
    return json.loads(
        json.dumps(
            {
                "model_fingerprint": fingerprint,
                "model_source": str(reader.path),
                "data_spec": calib.spec,
                "data_source": calib.spec,
                "data_fingerprint": calib.fingerprint(),
                "seq_len": calib.seq_len,
                "seed": calib.seed,
                "stats": names,
                "params": params,
                "dtype": str(dtype).replace("torch.", ""),
                "device": torch.device(device).type,
                "batch_size": batch_size,
            },
            default=str,
        )
    )


def settings_differ(meta: dict, params: dict, dtype, batch_size: int, dev) -> tuple | None:
    """(setting, stored, requested) for the first content-changing setting that differs from the store's."""
    want = _meta_settings(params, dtype, batch_size, dev)
    for key, value in want.items():
        if key in meta and json.loads(json.dumps(meta[key], default=str)) != json.loads(
            json.dumps(value, default=str)
        ):
            return (
                {
                    "params": "collector parameters",
                    "dtype": "dtype",
                    "batch_size": "batch size",
                    "device": "device",
                }[key],
                meta[key],
                value,
            )
    return None


def _meta_settings(params: dict, dtype, batch_size: int, dev) -> dict:
    """The settings besides model and tokens that change a store's content (recorded in stats.json)."""
    return {
        "params": {
            k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
            for k, v in params.items()
        },
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else "auto",
        "batch_size": batch_size,
        "device": torch.device(dev).type,
    }


def store_meta(
    reader,
    fingerprint,
    adapter,
    calib,
    names,
    params,
    dtype,
    batch_size,
    layer_stats,
    unreached,
    _device="cpu",
) -> dict:
    cfg = reader.config
    stats_held = sorted(set().union(*(set(s) for s in layer_stats.values())))
    shapes = {n: list(layer_stats[adapter.moe_layers[0]][n].shape) for n in stats_held}
    return {
        "format": FORMAT,
        "model": {
            "source": str(reader.path),
            "fingerprint": fingerprint,
            "model_type": getattr(cfg, "model_type", None),
            "architecture": (getattr(cfg, "architectures", None) or [None])[0],
            "num_layers": reader.num_layers,
            "moe_layers": adapter.moe_layers,
            "num_experts": {str(i): adapter.num_experts(i) for i in adapter.moe_layers},
            "top_k": {str(i): adapter.top_k(i) for i in adapter.moe_layers},
            "router": {str(i): adapter.router_spec(i).describe() for i in adapter.moe_layers},
            "hidden_size": adapter.hidden_size,
        },
        "data": calib.to_dict(),
        "stats": stats_held,
        "requested": names,
        "shapes": shapes,
        **_meta_settings(params, dtype, batch_size, _device),
        "layers": adapter.moe_layers,
        "unreached": {str(i): v for i, v in unreached.items()},
        "versions": versions(),
        "nan_policy": "experts with no routed token get 0 for every per-token mean",
    }
