r"""GPTQ input Hessians of named (non-expert) linear layers, one decoder layer at a time (issue 30, item 2).

GPTQ quantizes W [out, in] to minimise Σ_t ‖(W − Ŵ) x_t‖² over the inputs x_t of that very linear (Frantar et
al. 2023, eq. 1-2), whose Hessian is H_W = Σ_t x_t x_tᵀ [in, in]. `linear_hessian_pass` computes it for a set of
checkpoint weights (``model.layers.3.self_attn.q_proj.weight``, ``...mlp.shared_expert.down_proj.weight``,
``lm_head.weight``) with forward-pre-hooks on their modules while the `SequentialRunner` pushes every calibration
batch through each decoder layer, as `calibrate` does: real tokens only (the batch's attention mask), sums in
float64 (as `hessian.py`). A layer's Hessians are yielded while the layer is loaded and dropped before the next
layer is read, so the pass holds one layer and its Hessians; lm_head's input (the final norm of the last hidden
states) is computed after the last layer. Inputs are the original model's (no error propagation, as for the
routed experts: docs/quantization.md, "Defaults").
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import MoECompressError


def _calibration(model: str, data: dict):
    """The reader and tokenized sequences of the calibration run a statistics store records (``meta["data"]``)."""
    from ..checkpoint import CheckpointReader
    from ..data import load_calibration, load_tokenizer

    if not isinstance(data, dict) or "spec" not in data:
        raise MoECompressError(
            "The calibration statistics do not record their data spec, which GPTQ of non-expert "
            "weights re-reads; calibrate again with this version or use --quant-algo rtn."
        )
    reader = CheckpointReader(model)
    calib = load_calibration(
        str(data["spec"]),
        load_tokenizer(str(reader.path)),
        int(data["seq_len"]),
        int(data["seed"]),
        bool(data.get("padded", False)),
        bool(data.get("chat_template", False)),
        seq_len_from="--seq-len when calibrating again (this seq_len is the statistics store's)",
    )
    if data.get("fingerprint") not in (None, calib.fingerprint()):
        raise MoECompressError(
            f"The calibration data '{data['spec']}' no longer tokenizes to what the statistics "
            "were gathered on; calibrate again or use --quant-algo rtn."
        )
    return reader, calib


def _accumulate(acc: dict[str, torch.Tensor], name: str, valid: dict, x: torch.Tensor) -> None:
    x = x.reshape(-1, x.shape[-1])
    mask = valid.get("mask")
    if mask is not None and mask.numel() == x.shape[0]:
        x = x[mask.reshape(-1).to(device=x.device, dtype=torch.bool)]
    x = x.double()
    h = x.T @ x
    acc[name] = h if name not in acc else acc[name] + h


def _final_norm(model: nn.Module) -> nn.Module | None:
    return getattr(model.base_model, "norm", None)


def linear_hessian_pass(
    model: str, data: dict, names: list[str], batch_size: int = 8
) -> Iterator[tuple[int | None, dict[str, torch.Tensor]]]:
    """(decoder layer, {weight name: H [in, in] float64}) for each layer holding some of `names`, in order, then
    (None, {...}) for those outside the layers (lm_head); `data`: a store's ``meta["data"]`` (spec, seq_len, seed).
    A name whose module saw no real token is left out (its weight falls back to round-to-nearest)."""
    from .runner import SequentialRunner

    reader, calib = _calibration(model, data)
    runner = SequentialRunner(reader, calib, "cpu", None, batch_size)
    prefix = reader.layers_prefix
    by_layer: dict[int | None, list[str]] = {}
    for n in names:
        m = re.match(re.escape(prefix) + r"\.(\d+)\.", n)
        by_layer.setdefault(int(m.group(1)) if m else None, []).append(n)
    valid: dict = {}

    def before(b: int) -> None:
        valid["mask"] = runner._masks[b]

    try:
        runner.embed()
        last = max((i for i in by_layer if i is not None), default=-1)
        through = len(runner.layers) - 1 if None in by_layer else last
        for i in range(through + 1):
            runner.load_layer(i)
            acc: dict[str, torch.Tensor] = {}
            hooks = [
                runner.model.get_submodule(n.removesuffix(".weight")).register_forward_pre_hook(
                    lambda mod, args, n=n, acc=acc: _accumulate(acc, n, valid, args[0])
                )
                for n in by_layer.get(i, [])
            ]
            try:
                runner.run_layer(i, before_batch=before)
            finally:
                for h in hooks:
                    h.remove()
            runner.commit(i)
            if i in by_layer:
                yield i, acc
            del acc
            runner.free_layer(i)
        if None in by_layer:
            reader.load_non_layer(runner.model, "cpu", None)
            norm = _final_norm(runner.model)
            acc = {}
            if norm is not None:
                with torch.no_grad():
                    for b, _ in runner.batches:
                        before(b)
                        x = norm(runner.cache.read(b))
                        for n in by_layer[None]:
                            _accumulate(acc, n, valid, x)
            yield None, acc
    finally:
        runner.cache.clear()
