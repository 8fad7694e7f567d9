"""The dense method's statistics without a stats store (`dense_fit`'s module doc names them): one full forward
with a pre-hook on every MoE block summing routing counts, probabilities, expert-output norms and the
expert-output Gram matrix in float64."""

from __future__ import annotations

import torch

from ..models import MoEAdapter

_PER_EXPERT = ("counts", "routing_mass", "prob", "prob_sel", "out_sq")


def _expert_outputs(adapter: MoEAdapter, i: int, E: int, x: torch.Tensor, r, s: dict, gram: bool) -> None:
    """Add each expert's squared output norm over its routed tokens to ``out_sq`` and, with `gram`, the
    expert-output Gram matrix over every token (every expert run on every token)."""
    outs = []
    for e in range(E):
        tok = (r.index == e).any(-1)
        if gram:
            y = adapter.expert_forward(i, e, x).double()
            outs.append(y)
            s["out_sq"][e] += y[tok].square().sum()
        elif tok.any():
            s["out_sq"][e] += adapter.expert_forward(i, e, x[tok]).double().square().sum()
    if gram:
        f = torch.stack(outs).reshape(E, -1)
        s["gram"] = s.get("gram", torch.zeros(E, E, dtype=torch.float64)) + f @ f.T


def _make_hook(adapter: MoEAdapter, i: int, sums: dict[int, dict[str, torch.Tensor]], gram: bool):
    """The forward pre-hook of MoE layer i: adds the batch's sums for the layer to ``sums[i]``."""
    E = adapter.num_experts(i)

    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        x = h.reshape(-1, h.shape[-1])
        r = adapter.route(i, x)
        s = sums.setdefault(i, {n: torch.zeros(E, dtype=torch.float64) for n in _PER_EXPERT})
        s.setdefault("tokens", torch.zeros((), dtype=torch.float64))
        idx = r.index.reshape(-1)
        s["tokens"] += x.shape[0]
        s["counts"] += torch.bincount(idx, minlength=E).double()
        s["routing_mass"].index_add_(0, idx, r.weight.reshape(-1).double())
        probs = r.probs.double()
        s["prob"] += probs.sum(0)
        s["prob_sel"].index_add_(0, idx, probs.gather(1, r.index).reshape(-1))
        _expert_outputs(adapter, i, E, x, r, s, gram)
        gate = adapter.layer(i).shared_gate
        if gate is not None:
            s["shared_gate"] = (
                s.get("shared_gate", torch.zeros((), dtype=torch.float64))
                + torch.sigmoid(gate(x).double()).sum()
            )

    return hook


def _finish(sums: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """The statistics from the sums: counts and tokens as integers, means per token or per routed token."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i, s in sums.items():
        n = s["tokens"].clamp_min(1)
        c = s["counts"]
        d = {
            "counts": c.long(),
            "tokens": s["tokens"].long(),
            "routing_mass": s["routing_mass"],
            "pp": s["prob"] / n,
            "cp": torch.where(c > 0, s["prob_sel"] / c.clamp_min(1), torch.zeros_like(c)),
            "out_norm_sq_mean": torch.where(c > 0, s["out_sq"] / c.clamp_min(1), torch.zeros_like(c)),
        }
        if "gram" in s:
            d["gram"] = s["gram"] / n
        if "shared_gate" in s:
            d["shared_gate_mean"] = s["shared_gate"] / n
        out[i] = d
    return out


@torch.no_grad()
def collect_dense_stats(
    model, input_ids: torch.Tensor, batch_size: int = 8, gram: bool = True, progress: bool = True
) -> dict[int, dict[str, torch.Tensor]]:
    """The statistics of `dense_fit`'s module doc from a full forward over packed sequences input_ids [B, T].

    Float64 sums over every token (packed text, no padding). `gram` runs every expert on every token
    (E/k times the MoE compute). Also records Qwen2-MoE's mean shared-expert gate.
    """
    adapter = MoEAdapter(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    sums: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for i in adapter.moe_layers:
        hook = _make_hook(adapter, i, sums, gram)
        handles.append(adapter.layer(i).block.register_forward_pre_hook(hook, with_kwargs=True))
    # a streamed teacher's skeleton is on the meta device until its first forward: never send the ids there
    dev = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    from rich.progress import Progress

    try:
        with Progress(transient=True, disable=not progress) as bar:
            job = bar.add_task("dense statistics", total=input_ids.shape[0])
            for b in range(0, input_ids.shape[0], batch_size):
                model(input_ids=input_ids[b : b + batch_size].to(dev), use_cache=False)
                bar.advance(job, min(batch_size, input_ids.shape[0] - b))
    finally:
        for h in handles:
            h.remove()
    return _finish(sums)
