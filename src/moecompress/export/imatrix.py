"""llama.cpp's importance matrix from our calibration statistics (issue 31, item 2): one calibration serves both.

llama.cpp's K- and i-quants (`llama-quantize --imatrix FILE model.gguf out.gguf Q4_K_M`) weigh each weight
column by the mean squared input it sees. `llama-imatrix` writes that as a GGUF file (its
tools/imatrix/imatrix.cpp, `save_imatrix`; read by common/imatrix-loader.cpp): ``general.type = "imatrix"``,
``imatrix.datasets`` / ``imatrix.chunk_count`` / ``imatrix.chunk_size``, and per weight tensor (llama.cpp's
name, e.g. ``blk.3.ffn_down_exps.weight``) two F32 tensors:

* ``<name>.in_sum2`` [n_mat, n_in] — Σ_t x_t,j² over the tokens reaching matrix m (n_mat = the experts of a
  stacked ``*_exps`` tensor, else 1);
* ``<name>.counts`` [n_mat, 1] — those tokens' count (the quantizer divides the sums by it).

We write the same from statistics we already gather: for the experts, each expert's routed-token channel norms
(`in_channel_norm`² for ffn_gate/up_exps, `mid_channel_norm`² for ffn_down_exps) and routed counts, in the order
the GGUF stacks the kept experts; for the other linears (attention, shared experts, dense MLPs, output), the
diagonal of the input Hessian Σ_t x_t x_tᵀ (`calibrate.linear_hessian`) over all calibration tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import MoECompressError
from ..plan import CompressionPlan

IMATRIX_FILE = "imatrix.gguf"
EXPERT_STATS = ("counts", "tokens", "in_channel_norm", "mid_channel_norm")


def expert_entries(plan: CompressionPlan, stats) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """llama.cpp name -> (in_sum2 [n_mat, n_in], counts [n_mat]) of every stacked expert tensor of the plan's
    GGUF: the kept slots in slot order, each from its own expert's statistics."""
    import gguf

    stats.require(*EXPERT_STATS, method="an importance matrix")
    names = {
        part: gguf.TENSOR_NAMES[t]
        for part, t in (
            ("gate", gguf.MODEL_TENSOR.FFN_GATE_EXP),
            ("up", gguf.MODEL_TENSOR.FFN_UP_EXP),
            ("down", gguf.MODEL_TENSOR.FFN_DOWN_EXP),
        )
    }
    out = {}
    for lp in sorted(plan.layers, key=lambda x: x.layer):
        kept = [e for e, t in enumerate(lp.slots) if isinstance(t, int)]
        idx = torch.tensor(kept)
        counts = stats.get(lp.layer, "counts").double()[idx].numpy()
        x2 = stats.get(lp.layer, "in_channel_norm").double()[idx].square().numpy()
        a2 = stats.get(lp.layer, "mid_channel_norm").double()[idx].square().numpy()
        for part, sums in (("gate", x2), ("up", x2), ("down", a2)):
            out[names[part].format(bid=lp.layer) + ".weight"] = (sums, counts)
    return out


def linear_entries(
    diag: dict[str, torch.Tensor], tokens: int, name_map
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """llama.cpp name -> (in_sum2 [1, n_in], counts [1]) from checkpoint weight name -> diag(H) (Σ_t x_t,j²)."""
    out = {}
    for name, d in diag.items():
        gname = name_map.get_name(name, try_suffixes=(".weight",))
        if gname is not None:
            out[gname] = (d.double().reshape(1, -1).numpy(), np.array([float(tokens)]))
    return out


def write_imatrix(
    path: str | Path,
    entries: dict[str, tuple[np.ndarray, np.ndarray]],
    datasets: list[str],
    chunk_size: int,
    chunk_count: int,
) -> Path:
    """The imatrix GGUF file, as `llama-imatrix` writes it (module doc)."""
    import gguf

    if not entries:
        raise MoECompressError(
            "No weight has calibration statistics for an importance matrix; calibrate with "
            f"--stats {','.join(EXPERT_STATS)}."
        )
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch="imatrix", use_temp_file=False)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", datasets)
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(entries):
        sums, counts = entries[name]
        w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(sums, dtype=np.float32))
        w.add_tensor(f"{name}.counts", np.ascontiguousarray(counts, dtype=np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
