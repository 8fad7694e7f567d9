"""`MoEAdapter`: the only door to a model's MoE internals.

It finds the MoE blocks of a HuggingFace causal LM (declared family or auto-detected),
exposes each block's router semantics as a `RouterSpec`, reads and writes experts in the
orientation documented in `storage.py`, and re-implements routing + experts so that
`moe_forward` equals the HF block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..errors import MoECompressError
from .families import FAMILIES, FamilySpec
from .router import RouterSpec, Routing, route
from .storage import ExpertActivation, ExpertStorage, ExpertWeights, expert_apply

_BLOCK_ATTRS = ("mlp", "block_sparse_moe", "feed_forward", "moe", "ffn")
_ROUTER_ATTRS = ("gate", "router")
_SHARED_ATTRS = ("shared_expert", "shared_experts", "shared_mlp")


@dataclass
class MoELayer:
    """Handles on one decoder layer's MoE block."""

    index: int
    block_attr: str
    block: nn.Module
    router: nn.Module
    storage: ExpertStorage
    spec: RouterSpec
    act: ExpertActivation
    shared: nn.Module | None
    shared_gate: nn.Module | None
    verified: bool  # router semantics checked against the HF router (always true for declared families)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise MoECompressError(
        f"Cannot find the decoder layers of {type(model).__name__}; this architecture is not supported "
        "(see docs/models.md for the supported families)."
    )


def _find_router(block: nn.Module, num_experts: int, attrs: tuple[str, ...]) -> nn.Module | None:
    for name in attrs:
        r = getattr(block, name, None)
        w = getattr(r, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts:
            return r
    return None


def _router_top_k(router: nn.Module, config) -> int:
    k = getattr(router, "top_k", None) or getattr(config, "num_experts_per_tok", None)
    if not k:
        raise MoECompressError(
            "The model's config does not say how many experts each token uses "
            "(num_experts_per_tok); fix config.json and retry."
        )
    return int(k)


def _fallback_candidates(config, router: nn.Module, e: int, k: int) -> list[RouterSpec]:
    """Router conventions to try, the one the config suggests first."""
    n_group = int(getattr(config, "n_group", None) or 1)
    topk_group = int(getattr(config, "topk_group", None) or 1)
    base = RouterSpec(
        num_experts=e,
        top_k=k,
        scoring="sigmoid" if getattr(config, "scoring_func", "softmax") == "sigmoid" else "softmax",
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        has_bias=getattr(router, "bias", None) is not None,
        has_correction_bias=getattr(router, "e_score_correction_bias", None) is not None,
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2_sum" if getattr(router, "e_score_correction_bias", None) is not None else "max",
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
    )
    out = [base]
    for scoring in ("softmax", "sigmoid"):
        for norm in (False, True):
            for before in (False, True):
                for eps in (0.0, 1e-20):
                    out.append(
                        replace(
                            base,
                            scoring=scoring,
                            norm_topk_prob=norm,
                            topk_before_softmax=before,
                            norm_eps=eps,
                        )
                    )
    return out


def _router_matches(spec: RouterSpec, router: nn.Module) -> bool:
    """Does `route(spec)` reproduce the HF router on random tokens?"""
    w = router.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(64, w.shape[1], generator=gen).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            out = router(h)
    except Exception:  # a router with an unfamiliar call signature: not reproducible here
        return False
    if not isinstance(out, tuple) or len(out) < 3:
        return False
    hf_w, hf_i = out[1], out[2]
    if not (isinstance(hf_w, torch.Tensor) and hf_w.shape == (64, spec.top_k)):
        return False
    ours = route(spec, h, w, getattr(router, "bias", None), getattr(router, "e_score_correction_bias", None))
    a_i, a_o = hf_i.sort(dim=-1)
    b_i, b_o = ours.index.sort(dim=-1)
    return torch.equal(a_i, b_i) and torch.allclose(
        hf_w.float().gather(1, a_o), ours.weight.float().gather(1, b_o), atol=1e-5, rtol=1e-4
    )


class MoEAdapter:
    """Structure, router semantics and expert access for one loaded HF MoE causal LM."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.model_type = getattr(self.config, "model_type", type(model).__name__)
        self.family: FamilySpec | None = FAMILIES.get(self.model_type)
        self.decoder_layers = _decoder_layers(model)
        self.layers: dict[int, MoELayer] = {}
        for i, layer in enumerate(self.decoder_layers):
            found = self._detect_layer(i, layer)
            if found is not None:
                self.layers[i] = found
        if not self.layers:
            raise MoECompressError(
                f"{type(model).__name__} (model_type '{self.model_type}') has no routed-expert layers "
                "this toolkit can read: it is a dense model or an unsupported MoE; pass a MoE checkpoint "
                "(see docs/models.md)."
            )
        if self.family is None:
            # a verified router does not prove the block has nothing else in it (a post-norm, a custom
            # activation, transposed expert storage): accept an auto-detected block only if we reproduce it
            for i, layer in self.layers.items():
                if layer.verified and not self._block_matches(i):
                    raise MoECompressError(
                        f"The MoE block of model_type '{self.model_type}' (layer {i}) computes something this "
                        "toolkit cannot reproduce from its router and experts; it is unsupported for now "
                        "(see docs/models.md)."
                    )

    # ----------------------------------------------------------------- detection
    def _detect_layer(self, i: int, layer: nn.Module) -> MoELayer | None:
        fam = self.family
        for attr in fam.block_attrs if fam else _BLOCK_ATTRS:
            block = getattr(layer, attr, None)
            if block is None:
                continue
            experts = getattr(block, fam.experts_attr if fam else "experts", None) or nn.Module()
            storage = ExpertStorage.detect(experts, fam.layout if fam else None)
            if storage is None:
                continue
            e = storage.num_experts
            router = _find_router(block, e, (fam.router_attr,) if fam else _ROUTER_ATTRS)
            if router is None:
                continue
            k = _router_top_k(router, self.config)
            if not 1 <= k <= e:  # torch.topk would fail deep inside the first forward
                raise MoECompressError(
                    f"Layer {i} of the model routes each token to {k} experts but has only {e} "
                    "(num_experts_per_tok exceeds the expert count); fix config.json."
                )
            if fam is not None:
                spec, verified = fam.router_spec(self.config, e, k), True
            else:
                spec, verified = self._infer_router(router, e, k)
            shared_names = (fam.shared_attr,) if fam and fam.shared_attr else (() if fam else _SHARED_ATTRS)
            shared = next(
                (getattr(block, n) for n in shared_names if getattr(block, n, None) is not None), None
            )
            gate_name = fam.shared_gate_attr if fam else "shared_expert_gate"
            shared_gate = getattr(block, gate_name, None) if gate_name else None
            return MoELayer(
                i,
                attr,
                block,
                router,
                storage,
                spec,
                storage.activation(self.config),
                shared,
                shared_gate,
                verified,
            )
        return None

    def _infer_router(self, router: nn.Module, e: int, k: int) -> tuple[RouterSpec, bool]:
        candidates = _fallback_candidates(self.config, router, e, k)
        if router.weight.is_meta:
            return candidates[0], False
        for spec in candidates:
            if _router_matches(spec, router):
                return spec, True
        raise MoECompressError(
            f"The router of model_type '{self.model_type}' follows a convention this toolkit cannot reproduce; "
            "it is unsupported for now (see docs/models.md)."
        )

    def _block_matches(self, i: int) -> bool:
        """Does `moe_forward` reproduce the HF block on random tokens (median per-token relative error)?"""
        layer = self.layers[i]
        params = list(layer.block.parameters())
        if any(p.is_meta for p in params):
            return True  # offloaded (meta) weights cannot be run here; the router check stands alone
        expert = next(layer.storage.module.parameters())
        gen = torch.Generator(device="cpu").manual_seed(0)
        h = torch.randn(1, 16, self.hidden_size, generator=gen).to(expert.device, expert.dtype)
        was_training = layer.block.training
        layer.block.eval()  # training-mode blocks add jitter noise
        try:
            with torch.no_grad():
                ref = layer.block(h)
                ref = ref[0] if isinstance(ref, tuple) else ref
                ours = self.moe_forward(i, h)
        except Exception:  # a block that needs other inputs, or experts we misread: not reproducible
            return False
        finally:
            layer.block.train(was_training)
        if not isinstance(ref, torch.Tensor) or ours.shape != ref.shape:
            return False
        err = (ours.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-12)
        tol = 1e-3 if expert.dtype in (torch.float32, torch.float64) else 5e-2
        return err.median().item() <= tol

    # ----------------------------------------------------------------- structure
    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.layers)

    @property
    def dense_layers(self) -> list[int]:
        return [i for i in range(len(self.decoder_layers)) if i not in self.layers]

    def layer(self, i: int) -> MoELayer:
        try:
            return self.layers[i]
        except KeyError:
            raise MoECompressError(
                f"Layer {i} has no routed experts; MoE layers are {self.moe_layers}."
            ) from None

    def router_spec(self, i: int) -> RouterSpec:
        return self.layer(i).spec

    def num_experts(self, i: int) -> int:
        return self.layer(i).storage.num_experts

    def top_k(self, i: int) -> int:
        return self.layer(i).spec.top_k

    def intermediate_size(self, i: int) -> int:
        return self.layer(i).storage.intermediate_size

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def returns_tuple(self) -> bool:
        """True when the family's MoE block returns (hidden, extra), as GPT-OSS's does."""
        return bool(self.family and self.family.block_returns_tuple)

    # ----------------------------------------------------------------- weights
    def experts(self, i: int) -> ExpertWeights:
        """All experts of layer i stacked (views of the model's storage where possible)."""
        return self.layer(i).storage.read_all()

    def experts_at_rest(self, i: int) -> ExpertWeights:
        """Layer i's experts for a method that holds several layers at once (a ConMoE scope): in memory they are
        `experts(i)`; a streamed view (`checkpoint/view.py`) copies them at the checkpoint's precision."""
        return self.experts(i)

    def expert_part_at_rest(self, i: int, name: str) -> torch.Tensor:
        """One projection (``gate``, ``up`` or ``down``) of layer i's stacked experts, as `experts_at_rest` holds
        it: a method that needs a scope's projections one at a time (ConMoE distances) holds a third of them."""
        return getattr(self.experts_at_rest(i), name)

    def expert_dtype(self, i: int) -> torch.dtype:
        """The dtype `experts(i)` / `storage.read` hand out (what plan tensors are fitted in), without a copy."""
        return self.layer(i).storage.read(0).gate.dtype

    def get_expert(self, i: int, e: int) -> ExpertWeights:
        """A detached copy of expert e of layer i."""
        return self.layer(i).storage.read(e).map(lambda t: t.detach().clone())

    def set_expert(self, i: int, e: int, w: ExpertWeights) -> None:
        self.layer(i).storage.write(e, w)

    def router_params(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight [E, H], bias [E] or None, e_score_correction_bias [E] or None)."""
        r = self.layer(i).router
        return r.weight, getattr(r, "bias", None), getattr(r, "e_score_correction_bias", None)

    def hold_layer(self, i: int) -> None:
        """Make layer i's modules usable directly, not only through this adapter's reads (a streamed view brings
        the layer in, in its compute dtype); a model in memory always is."""

    @contextlib.contextmanager
    def computing_in(self, dtype: torch.dtype):
        """Forwards compute in `dtype` until the block exits, as a model loaded in `dtype` computes: every
        floating parameter cast as from_pretrained casts it (`loading.dtype_target`; buffers such as rotary
        frequencies keep theirs), then given back its own tensor. For a model whose weights came from a `dtype`
        checkpoint the forward is the one the served model runs (auto's divergence probe)."""
        from .loading import dtype_target

        target = dtype_target(self.model, dtype)
        saved = []
        try:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    want = target(name, p)
                    if not p.is_meta and want != p.dtype:
                        saved.append((p, p.data))
                        p.data = p.data.to(want)
            yield
        finally:
            for p, data in saved:
                p.data = data

    def set_block(self, i: int, module: nn.Module) -> None:
        """Install `module` in place of layer i's MoE block (used by the runtime)."""
        layer = self.layer(i)
        setattr(self.decoder_layers[i], layer.block_attr, module)

    def block_forward(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The MoE block installed in layer i (the original or a runtime's) on tokens h [N, H] -> [N, H]."""
        out = getattr(self.decoder_layers[i], self.layer(i).block_attr)(h[None])
        return (out[0] if isinstance(out, tuple) else out).reshape(h.shape)

    # ----------------------------------------------------------------- compute
    def route(self, i: int, h: torch.Tensor, **masks) -> Routing:
        """Router logits, probabilities, selected experts and gate weights for tokens h [N, H]."""
        weight, bias, corr = self.router_params(i)
        return route(self.router_spec(i), h, weight, bias, corr, **masks)

    def expert_forward(self, i: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """f_e(x) for tokens x [N, H] (no gate weight applied)."""
        layer = self.layer(i)
        return expert_apply(layer.storage.read(e), x, layer.act)

    def shared_forward(self, i: int, h: torch.Tensor) -> torch.Tensor | None:
        """Output of the layer's shared experts (with Qwen2-MoE's sigmoid gate), or None."""
        layer = self.layer(i)
        if layer.shared is None:
            return None
        out = layer.shared(h)
        if layer.shared_gate is not None:
            out = torch.sigmoid(layer.shared_gate(h)) * out
        return out

    def moe_forward(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The whole MoE block re-implemented from `route` and `expert_forward`; h [..., H]."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        r = self.route(i, x)
        out = torch.zeros_like(x)
        for e in r.index.unique().tolist():
            tok, slot = torch.where(r.index == e)
            y = self.expert_forward(i, e, x[tok]) * r.weight[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        shared = self.shared_forward(i, x)
        if shared is not None:
            out = out + shared
        return out.reshape(shape)
