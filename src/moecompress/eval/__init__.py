"""Evaluation: perplexity / accuracy / KL over windows, lm-eval bridge, paired statistics, RTN baseline,
memory and latency, and the markdown + PNG report (docs/evaluation.md).

Names are imported lazily so that `moecompress --help` does not pay for torch, lm-eval or matplotlib.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "evaluate_stream": "metrics",
    "perplexity": "metrics",
    "kl_divergence": "metrics",
    "token_stream": "metrics",
    "windows": "metrics",
    "load_text": "metrics",
    "item_values": "metrics",
    "run_lm_eval": "lmeval",
    "resolve_tasks": "lmeval",
    "FIXTURE_TASKS": "lmeval",
    "paired_bootstrap": "stats",
    "paired_bootstrap_tasks": "stats",
    "holm": "stats",
    "apply_holm": "stats",
    "verdict": "stats",
    "PairedResult": "stats",
    "disk_bytes": "bench",
    "resident_bytes": "bench",
    "peak_memory": "bench",
    "measure_latency": "bench",
    "benchmark": "bench",
    "write_report": "report",
    "compare_arms": "report_comparisons",
    "checklist": "report_checklist",
    "validate_results": "schema",
    "SCHEMA": "schema",
    "evaluate_model": "runner",
    "model_info": "runner",
    "plan_arm_fields": "runner",
    "ppl_task_name": "runner",
    "min_replicates": "report_comparisons",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
