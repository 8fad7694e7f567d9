"""Forward-pass measurements of `auto`: the calibration token ids, log-probs and KL to the original, a layer's
output perturbed or run through a plan, and the noise sensitivity s_l of a layer (`layer_sensitivity`)."""

from __future__ import annotations

import contextlib
import math

import torch

from ...errors import MoECompressError


def sig(x: float, digits: int = 6) -> float:
    """x rounded to `digits` significant digits (stable JSON, decisions robust to last-bit noise)."""
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


def calibration_ids(stats, adapter, sequences: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """Token ids [B, T] for the sensitivity passes: the calibration spec of `stats` re-tokenised with the
    model's tokenizer when possible, else seeded random ids (and a note saying so)."""
    spec = stats.meta.get("data", {}).get("spec", "") if stats is not None else ""
    source = getattr(adapter.model, "name_or_path", "") or ""
    if spec and not spec.startswith("tokens:") and source:
        with contextlib.suppress(MoECompressError, OSError, ValueError):
            from ...data import load_calibration, load_tokenizer

            data = load_calibration(spec, load_tokenizer(str(source)), seq_len, seed)
            ids = data.input_ids[:sequences]
            return ids, f"{spec} (first {len(ids)} sequences of {seq_len} tokens)"
    vocab = int(adapter.model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sequences, seq_len), generator=gen)
    return (
        ids,
        f"random token ids ({sequences} x {seq_len}, seed {seed}): calibration spec '{spec}' not reloadable",
    )


# ----------------------------------------------------------------------------- KL measurements
def input_device(model) -> torch.device:
    """Where a forward's inputs go: the device of the model's first materialised parameter. Not
    ``model.device``: on the streamed view every parameter is meta until the forward's hooks load it, and
    ids moved to meta gave garbage logits on the first forward (auto's reference log-probs)."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def logprobs(model, ids: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """Log-probs (float64) of `model` on `ids`, `batch` sequences per forward: the streamed view reads every layer
    once per forward, so the default probe set (8 sequences) takes one read of the checkpoint, not two; its
    logits cost 8 × seq_len × vocab float64 values once (as much as the reference kept)."""
    out = []
    device = input_device(model)
    with torch.no_grad():
        for s in range(0, len(ids), batch):
            logits = model(ids[s : s + batch].to(device)).logits
            out.append(torch.log_softmax(logits.double(), -1).cpu())
    return torch.cat(out)


def kl_to(ref: torch.Tensor, model, ids: torch.Tensor) -> float:
    """Mean over tokens of KL(original ‖ model) given the original's log-probs `ref`."""
    return _kl(ref, logprobs(model, ids))


def _kl(ref: torch.Tensor, lp: torch.Tensor) -> float:
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def kl_per_slice(ref: torch.Tensor | None, model, ids: torch.Tensor, n: int) -> list[float]:
    """`kl_to` of n variants in one forward: `ids` repeated n times along the batch, variant v's hooks acting on
    rows v·len(ids) … (v+1)·len(ids) (`tensors.rounded_installed`). One read of a streamed checkpoint instead of n;
    its logits are n × len(ids) × seq_len × vocab float32 values at once, each variant's log-probs in float64
    after the other. `ref` None: variant 0 is the original, the reference of the other n − 1 (whose KLs are
    returned), computed in the same forward."""
    b = len(ids)
    with torch.no_grad():
        logits = model(ids.repeat(n, 1).to(input_device(model))).logits
        rows = lambda v: torch.log_softmax(logits[v * b : (v + 1) * b].double(), -1).cpu()  # noqa: E731
        first = 0 if ref is not None else 1
        ref = rows(0) if ref is None else ref
        return [_kl(ref, rows(v)) for v in range(first, n)]


def output_hook(fn):
    """A forward hook replacing a module's output o (or its first element, if a tuple) by fn(o)."""

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (fn(output[0]),) + tuple(output[1:])
        return fn(output)

    return hook


@contextlib.contextmanager
def perturbed(adapter, layer: int, fn):
    """Temporarily replace layer `layer`'s MoE output o by fn(o) (a forward hook on its block)."""
    handle = adapter.layer(layer).block.register_forward_hook(output_hook(fn))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def plan_installed(adapter, plan, tensors, layers):
    """Temporarily run `layers` of the in-memory model through the plan's runtime blocks (originals kept)."""
    from ...runtime import CompressedMoEBlock, build_ops, build_scope
    from ...runtime.build import scope_dtype

    source = lambda l, e: adapter.layer(l).storage.read(e)
    installed = []
    try:
        with torch.no_grad():
            for i in layers:
                lp = plan.layer(i)
                sc = plan.scope(lp.scope)
                layer = adapter.layer(i)
                stored = build_scope(plan, sc, layer, source, tensors, config=adapter.model.config)
                ops = build_ops(plan, lp, layer, tensors, scope_dtype(stored), layer.router.weight.device)
                adapter.set_block(i, CompressedMoEBlock(layer, lp, stored, ops, adapter.returns_tuple))
                installed.append(i)
        yield
    finally:
        for i in installed:
            adapter.set_block(i, adapter.layer(i).block)


def sample_layer_error(adapter, plan, tensors, layer: int, x: torch.Tensor) -> float:
    """Mean over the sampled block inputs x of ‖ŷ − y‖²: the plan's real error in `layer` (all interactions)."""
    x = x.to(adapter.expert_dtype(layer))
    with torch.no_grad():
        ref = adapter.moe_forward(layer, x)
        with plan_installed(adapter, plan, tensors, [layer]):
            adapter.hold_layer(layer)  # the block below runs on the layer's own router (and shared experts)
            out = adapter.block_forward(layer, x)
    return float((out.double() - ref.double()).square().sum(-1).mean())
