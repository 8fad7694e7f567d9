"""`StreamedAdapter`: the method context's read-only view of a checkpoint, one decoder layer at a time.

A method asks the adapter for structure (``moe_layers``, ``num_experts(i)``, ``layer(i).spec``,
``ModelInfo.from_model``) and for weights (``layer(i).storage.read(e)`` / ``read_all()``,
``experts(i)``, ``get_expert``, ``router_params``, ``route``, ``expert_forward``). This view answers
structure from a meta skeleton (no memory) and weights by materialising ONE decoder layer from the
`CheckpointReader` when a weight of that layer is first asked for; the previously resident layer is
evicted (its parameters go back to the meta device). Weights are handed out in ``compute_dtype``
(float32, the dtype `compress` used to load the whole model in, so every method's arithmetic and every
plan stay exactly what they were; ``bfloat16`` holds a bf16 checkpoint at its own precision instead):

* reads that copy out (one expert: ``read(e)`` / ``get_expert`` / ``expert_forward``; the router) take the
  layer as it is resident, or bring it in as stored, and upcast each copy (exact): the layer costs its size
  on disk, not its float32 size. "As stored" applies to the routed experts, the bulk of a layer; the rest
  (router, shared experts, attention, norms) is always upcast, so ``hold_layer`` (a method running the
  layer's router or shared experts itself) is satisfied by either residency;
* ``read_all`` and forwards need the experts in the compute dtype too: the layer is read tensor by tensor,
  each tensor upcast as it arrives. ``read_all`` hands out views of that layer, which a method that needs a
  scope of layers (ConMoE) keeps alive itself.

A reader that holds the layer already (the streamed statistics' pass, `calibrate.streamed.each_layer`)
can `lend` it: reading it as stored then neither reads the disk nor copies, so the layer is in memory once.

``layer_loads[i]`` counts how often layer i was read from disk for a method (a plan that needs no
weights, REAP pruning, leaves it empty), ``layer_lends[i]`` how often it was taken from a lent layer.
``model`` is the skeleton with streaming forward hooks: a forward (auto's sensitivities and measured KL)
loads each decoder layer just before it runs (``forward_loads``), so even full-model forwards hold one
layer plus the embeddings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..memory import release_freed_memory
from ..models import MoEAdapter
from ..models.storage import ExpertStorage, ExpertWeights


@dataclass
class _StreamedStorage(ExpertStorage):
    """An `ExpertStorage` over a meta module whose reads first bring the layer in (float copies out)."""

    view: StreamedAdapter | None = None
    index: int = -1

    def read_all(self) -> ExpertWeights:
        self.view._ensure(self.index)
        return super().read_all()  # views of the resident layer: they outlive its eviction on their own

    def read(self, e: int) -> ExpertWeights:
        self.view._ensure_any(self.index)
        if self.layout == "modulelist":
            return super().read(e).map(self.view._out)
        return super().read_all().map(lambda t: self.view._out(t[e]))

    def write(self, e: int, w: ExpertWeights) -> None:
        from ..errors import MoECompressError

        raise MoECompressError(
            "The streamed checkpoint view is read-only; a method must return its changes as "
            "plan tensors, not write them into the model."
        )


class StreamedAdapter(MoEAdapter):
    """A `MoEAdapter` over checkpoint `path` that holds at most one decoder layer (see the module doc)."""

    def __init__(self, path: str, compute_dtype: torch.dtype = torch.float32, reader=None):
        from ..models import skeleton
        from ..models.loading import DEFAULT_DTYPE_LOCK
        from .reader import CheckpointReader

        self.reader = reader or CheckpointReader(str(path))
        self.compute_dtype = compute_dtype
        with (
            DEFAULT_DTYPE_LOCK
        ):  # the default dtype is process-wide: one thread at a time sets and restores it
            prev = torch.get_default_dtype()
            torch.set_default_dtype(compute_dtype)  # meta parameters report the dtype the methods compute in
            try:
                model = skeleton(self.reader.config)
            finally:
                torch.set_default_dtype(prev)
        model.name_or_path = str(self.reader.path)  # byte accounting reads the checkpoint's own headers
        model.config.name_or_path = str(self.reader.path)
        super().__init__(model)
        prefix = self.reader.layers_prefix
        # native name -> (module, leaf) of the ORIGINAL modules, so loading and freeing never depends on what a
        # method installed in the layer meanwhile (auto's CompressedMoEBlock, dense's FFN)
        self._slots: dict[int, dict[str, tuple[nn.Module, str]]] = {
            i: {} for i in range(len(self.decoder_layers))
        }
        # what a layer's meta tensors report, resident or not: the compute dtype (a skeleton built from a bf16
        # config is bf16 whatever the default dtype), never the dtype of the last at-rest read
        self._meta_dtype: dict[str, torch.dtype] = {}
        for mname, module in model.named_modules():
            if not mname.startswith(prefix + "."):
                continue
            i = int(mname[len(prefix) + 1 :].split(".")[0])
            for leaf in list(module._parameters) + list(module._buffers):
                self._slots[i][f"{mname}.{leaf}"] = (module, leaf)
                t = getattr(module, leaf)
                if t is not None:
                    self._meta_dtype[f"{mname}.{leaf}"] = compute_dtype if t.is_floating_point() else t.dtype
        for i in self._slots:
            self._free(i, meta_too=True)
        self._expert_names: dict[int, set[str]] = {
            i: set() for i in self._slots
        }  # the routed experts' tensors
        for i, layer in self.layers.items():
            s = layer.storage
            layer.storage = _StreamedStorage(s.module, s.layout, s.names, view=self, index=i)
            mods = set(s.module.modules())
            self._expert_names[i] = {n for n, (m, _) in self._slots[i].items() if m in mods}
        self.resident: int | None = None
        self._at_rest = False  # the resident layer is as stored (experts_at_rest), not in the compute dtype
        self._stored_dtype: dict[
            int, torch.dtype | None
        ] = {}  # layer -> its one on-disk float dtype (None: mixed)
        self.layer_loads: dict[int, int] = {}
        self.layer_lends: dict[int, int] = {}  # layer -> times made resident from a lent layer (`lend`)
        self._lent: tuple[int, dict[str, torch.Tensor]] | None = None
        self.forward_loads: dict[int, int] = {}
        self._non_layer = False
        self._hooks = [model.register_forward_pre_hook(self._pre_model)]
        for i, dec in enumerate(self.decoder_layers):
            self._hooks.append(dec.register_forward_pre_hook(lambda m, a, i=i: self._ensure(i, forward=True)))

    # ---------------------------------------------------------------- residency
    def _out(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """An independent copy in the compute dtype: one expert read must not pin its whole fused layer tensor
        after eviction (a layer resident as stored is upcast here, one tensor at a time)."""
        if t is None:
            return None
        return t.detach().to(self.compute_dtype if t.is_floating_point() else t.dtype, copy=True)

    def _install(self, i: int, at_rest: bool) -> None:
        """Read layer i tensor by tensor, casting each as it arrives (the layer is never held twice: one native
        tensor at the checkpoint's precision is the only transient); see `_place`."""
        self._place(
            i,
            (
                item
                for native in self.reader._by_layer.get(i, [])
                for item in self.reader._state([native]).items()
            ),
            at_rest,
        )

    def _place(self, i: int, named, at_rest: bool) -> None:
        """Put each (native name, tensor) of `named` into layer i's modules in the compute dtype; `at_rest`: the
        routed experts' tensors (the bulk of the layer) as given, the rest (router, shared experts, attention,
        norms) still upcast, so the layer's own modules run on compute-dtype inputs either way."""
        from .reader import _recreate_buffers

        stored = set()
        for name, t in named:
            module, leaf = self._slots[i][name]
            if t.is_floating_point():
                expert = name in self._expert_names[i]
                if expert:
                    stored.add(t.dtype)
                t = t if at_rest and expert else t.to(self.compute_dtype)
            if leaf in module._parameters:
                module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                module._buffers[leaf] = t
        for module in {m for m, _ in self._slots[i].values()}:
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                _recreate_buffers(module, "cpu")
        self._stored_dtype[i] = stored.pop() if len(stored) == 1 else None  # of the routed experts

    def lend(self, i: int, tensors: Mapping[str, torch.Tensor], checkpoint: str) -> bool:
        """Until `unlend`, take layer i as stored from `tensors` (native names) that another reader of the same
        `checkpoint` holds already (the streamed statistics' pass: `calibrate.streamed.each_layer`), so the layer
        is in memory once for both: reading it as stored neither reads the disk nor copies. False (nothing done)
        when they are not all of that layer's tensors."""
        names = [n for n, (m, leaf) in self._slots[i].items() if getattr(m, leaf) is not None]
        if Path(checkpoint).resolve() != Path(self.reader.path).resolve() or any(
            n not in tensors or tensors[n].is_meta for n in names
        ):
            return False
        self.unlend()
        self._lent = (i, {n: tensors[n].detach() for n in names})
        return True

    def unlend(self) -> None:
        """Give the lent layer back: it is evicted if resident, and read from disk when asked for again."""
        if self._lent is not None:
            if self.resident == self._lent[0]:
                self.release()
            self._lent = None

    def _free(self, i: int, meta_too: bool = False) -> None:
        for name, (module, leaf) in self._slots[i].items():
            store = module._parameters if leaf in module._parameters else module._buffers
            t = store[leaf]
            if t is not None and (meta_too or not t.is_meta):
                meta = torch.empty_like(t, device="meta", dtype=self._meta_dtype.get(name, t.dtype))
                store[leaf] = nn.Parameter(meta, requires_grad=False) if store is module._parameters else meta

    def _ensure(self, i: int, forward: bool = False, at_rest: bool = False) -> None:
        """Make decoder layer i resident in the compute dtype (`at_rest`: as stored), evicting the previous one."""
        if self.resident != i or self._at_rest != at_rest:
            self.release()
            if at_rest and self._lent is not None and self._lent[0] == i:
                self._place(i, self._lent[1].items(), at_rest=True)
                counts = self.layer_lends
            else:
                self._install(i, at_rest)
                counts = self.forward_loads if forward else self.layer_loads
            self.resident, self._at_rest = i, at_rest
            counts[i] = counts.get(i, 0) + 1

    def _ensure_any(self, i: int) -> None:
        """Make layer i resident for reads that copy out (one expert, the router): either residency will do, and
        a layer not yet resident comes in as stored, so it costs its size on disk, not its float32 size."""
        if self.resident != i:
            self._ensure(i, at_rest=True)

    def hold_layer(self, i: int) -> None:
        self._ensure_any(i)  # either residency has every module but the routed experts in the compute dtype

    def release(self) -> None:
        """Evict the resident layer (the plan is built: nothing of the checkpoint stays in memory)."""
        if self.resident is not None:
            self._free(self.resident)
            self.resident = None
            release_freed_memory()

    # ---------------------------------------------------------------- streaming forwards
    @contextlib.contextmanager
    def computing_in(self, dtype: torch.dtype):
        """Forwards compute in `dtype` until the block exits: layers and the non-layer modules are read again in
        it (one more read of each for the forwards inside), and in the compute dtype after."""
        previous = self.compute_dtype
        self._recast(dtype)
        try:
            yield
        finally:
            self._recast(previous)

    def _recast(self, dtype: torch.dtype) -> None:
        self.release()
        self.compute_dtype = dtype
        if self._non_layer:
            self.reader.load_non_layer(self.model, "cpu", dtype)

    def _pre_model(self, module, args) -> None:
        if not self._non_layer:
            self.reader.load_non_layer(self.model, "cpu", self.compute_dtype)
            self._non_layer = True

    # ---------------------------------------------------------------- weights (copies in compute dtype)
    def expert_dtype(self, i: int) -> torch.dtype:
        return self.compute_dtype

    def experts_at_rest(self, i: int) -> ExpertWeights:
        """Layer i's experts stacked at the checkpoint's own precision when the layer is stored in one float dtype
        (exact: the compute-dtype values are upcast from it), else in the compute dtype. The layer is read as
        stored (not upcast) and evicted; what is handed out are its expert tensors themselves, so a method that
        holds several layers at once (a ConMoE scope) or a layer's experts (PuzzleMoE) pays their size on disk."""
        self._ensure(i, at_rest=True)
        w = ExpertStorage.read_all(self.layer(i).storage)  # views of the layer as stored: no upcast, no copy
        self.release()  # the views keep only the expert tensors alive
        if self._stored_dtype[i] is None:  # mixed float dtypes on disk: hand them out in the compute dtype
            w = w.map(lambda t: t.to(self.compute_dtype))
        return w

    def expert_part_at_rest(self, i: int, name: str) -> torch.Tensor:
        """One projection of layer i's experts as stored, in a tensor of its own: a fused storage's gate (a slice
        of ``gate_up_proj``) is copied out, so the whole fused tensor is not kept alive for it."""
        t = getattr(self.experts_at_rest(i), name)
        return t if t._base is None else t.clone(memory_format=torch.contiguous_format)

    def router_params(self, i: int):
        layer = self.layer(i)
        self._ensure_any(i)
        r = layer.router
        return (
            self._out(r.weight),
            self._out(getattr(r, "bias", None)),
            self._out(getattr(r, "e_score_correction_bias", None)),
        )

    def get_expert(self, i: int, e: int) -> ExpertWeights:
        return self.layer(i).storage.read(e)

    def set_expert(self, i: int, e: int, w: ExpertWeights) -> None:
        self.layer(i).storage.write(e, w)

    def shared_forward(self, i: int, h: torch.Tensor) -> torch.Tensor | None:
        layer = self.layer(i)
        if layer.shared is None:
            return None
        self._ensure_any(i)  # the shared experts are upcast in either residency
        return super().shared_forward(i, h)


def is_streamed(adapter) -> bool:
    return isinstance(adapter, StreamedAdapter)


class SpilledTensors(Mapping):
    """Plan tensors kept on disk, one safetensors file per `update` batch (a layer's), read back one tensor per
    lookup. A method that produces tensors for every layer (PuzzleMoE's packed merges) holds them here on the
    streamed view, so building the plan keeps one layer's worth in memory instead of every layer's until the
    export. The files live in a private temporary directory, removed when the mapping is collected; it carries
    our marker (`atomic.temporary_dir`), so the one a killed run (SIGKILL, the out-of-memory killer) leaves is
    removed by the next run (`atomic.clean_stale_spills`, here and whenever an output is written). The part
    file last read stays open: opening one per lookup parsed its header again for each of a layer's hundreds of
    tensors (6 % of a streamed GPTQ run's time on the wide benchmark model)."""

    def __init__(self):
        import os
        import shutil
        import tempfile
        import threading
        import weakref

        from ..atomic import SPILL_PREFIX, clean_stale_spills, temporary_dir

        self._open: tuple[Path, object] | None = None
        self._parts = 0
        self._lock = threading.Lock()  # lookups may come from the export's prefetch thread

        clean_stale_spills()
        self.dir = temporary_dir(tempfile.gettempdir(), f"{SPILL_PREFIX}{os.getpid()}-", "plan-tensors")
        self._file: dict[str, Path] = {}
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        # a counter, not the live file count: after a deletion that count named an existing part
        self._parts += 1
        path = self.dir / f"part{self._parts:05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path))
        self._file.update(dict.fromkeys(tensors, path))

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file[key]
        with self._lock:
            if self._open is None or self._open[0] != path:
                self._open = (path, safe_open(str(path), framework="pt"))
            return self._open[1].get_tensor(key)

    def __delitem__(self, key: str) -> None:
        # the bytes stay in their part file until the mapping is collected; only the lookup goes
        del self._file[key]

    def __contains__(self, key) -> bool:
        return key in self._file

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def plan_tensor_store(adapter) -> SpilledTensors | dict:
    """Where a method collects its plan tensors: on disk for the streamed view (`SpilledTensors`), else a dict."""
    return SpilledTensors() if is_streamed(adapter) else {}
