"""The stats store: safetensors + JSON, one tensor per (layer, statistic).

Layout of ``DIR``::

    stats.json              format, model (source, fingerprint, type, MoE layers, experts, top-k, router
                            convention per layer), data (spec, seq_len, seed, packing, exact token count,
                            sources with their domain, token fingerprint), statistics held, collector
                            parameters, dtype, batch size, unreached experts, package versions
    layer_XXXX.safetensors  one file per MoE layer; tensor names are the statistic names

A run in progress keeps finished layers in a sibling ``.DIR.partial/`` (``run.json`` + the same
``layer_XXXX.safetensors`` files), so a killed run resumes from its last finished layer and the
finished files are moved, byte for byte, into the final directory, which appears only when the run
completes (written atomically). One file per layer keeps memory flat however large the statistics.

Format 2 (``moecompress-stats/2``) writes the symmetric [..., D, D] statistics (`Collector.symmetric`: the
GPTQ Hessians, ``input_moment``) as their upper triangles, [..., D(D + 1)/2] in their own dtype
(`calibrate.symmetric`), and names them in each layer file's metadata (``packed``); every read rebuilds the
full matrices bit for bit. Format 1 stores (every tensor whole, no ``packed``) read as before; any other
format is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import MoECompressError
from ..safejson import load_json, try_load_json
from .store_checks import check_identity, check_meta

FORMAT = "moecompress-stats/2"
FORMATS = (
    "moecompress-stats/1",
    FORMAT,
)  # the formats this version reads (1: no packed symmetric statistics)

# statistics whose shape follows from the model alone ("E": the layer's experts, "H": the hidden size), checked
# against the model from the files' headers (`StatsStore.check_model`)
_SHAPES = {
    **dict.fromkeys(
        ("counts", "routing_mass", "pp", "cp", "reap", "ean", "out_norm_mean", "out_norm_sq_mean"), ("E",)
    ),
    **dict.fromkeys(("out_mean", "out_var", "in_channel_norm"), ("E", "H")),
}


def _write_json(path: Path, obj) -> None:
    """Complete or absent, fsynced (`atomic.write_file`): a full disk leaves no 0-byte ``run.json.tmp``."""
    from ..atomic import write_file

    write_file(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _symmetric_names() -> frozenset[str]:
    """Statistics some registered collector leaves exactly symmetric (`Collector.symmetric`)."""
    from .registry import COLLECTORS

    return frozenset(n for cls in COLLECTORS.values() for n in cls.symmetric)


def _pack(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors with the symmetric statistics as upper triangles, the names packed). A statistic declared
    symmetric that is not exactly so (a collector's mistake) is written whole: a read must give back what was
    computed."""
    from .symmetric import is_symmetric, pack

    names = _symmetric_names()
    packed = sorted(k for k, t in tensors.items() if k in names and t.dim() >= 3 and is_symmetric(t))
    return {k: pack(t) if k in packed else t for k, t in tensors.items()}, packed


def _packed_in(metadata: dict | None) -> frozenset[str]:
    """The names a layer file holds packed, from its own metadata (none in a format 1 file)."""
    return frozenset(n for n in ((metadata or {}).get("packed") or "").split(",") if n)


def _unpacked(t: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    from .symmetric import dim_of, unpack

    if t.dim() < 1 or dim_of(t.shape[-1]) is None:
        raise MoECompressError(
            f"{path} holds '{name}' packed with {list(t.shape)} values, no upper triangle of a "
            "square matrix: the stats store is corrupted; re-run calibration."
        )
    return unpack(t)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], identity: dict | None = None) -> None:
    """One layer's file (symmetric statistics packed, `_pack`), fsynced before its rename so that a resumed run
    never trusts a file the crash left empty; the temporary is removed on any failure. `identity`: what the file
    records of itself (its layer and the model's fingerprint, `_check_identity` on every read)."""
    from ..disk import write_tensors

    tmp = path.with_suffix(path.suffix + ".tmp")
    tensors, packed = _pack(tensors)
    try:
        write_tensors(
            tmp, tensors, metadata={"format": FORMAT, "packed": ",".join(packed), **(identity or {})}
        )
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def versions() -> dict[str, str]:
    import platform

    import safetensors
    import transformers

    from .._version import __version__

    return {
        "moecompress": __version__,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


class StatsStore:
    """Read access to a finished stats store: ``StatsStore.load(dir).get(layer, name)``."""

    # a store reads any expert's rows from its file: no chunk to keep, nothing held to drop (`StatsView`)
    chunk = None

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        self.meta = meta

    def drop_rows(self) -> None:
        pass

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path, model_fingerprint: str | None = None, data_spec: str | None = None) -> StatsStore:
        """Open a store; with `model_fingerprint` / `data_spec` it refuses a store made from other inputs."""
        path = Path(path)
        meta_file = path / "stats.json"
        if not meta_file.is_file():
            raise MoECompressError(
                f"{path} is not a stats store (no stats.json); run `moecompress calibrate` to create one."
            )
        meta = load_json(meta_file, "the stats store is corrupted, so re-run calibration")
        if meta.get("format") not in FORMATS:
            raise MoECompressError(
                f"{path} holds stats format '{str(meta.get('format'))[:80]}', which this version of "
                f"moecompress does not read ({' or '.join(FORMATS)}); re-run calibration with this "
                "version."
            )
        check_meta(meta_file, meta)
        store = cls(path, meta)
        store.check(model_fingerprint, data_spec)
        return store

    def check(self, model_fingerprint: str | None = None, data_spec: str | None = None) -> None:
        """Refuse (one sentence) when the store was computed on another model or data spec."""
        from ..checkpoint import legacy_fingerprint

        m, d = self.meta["model"], self.meta["data"]
        if model_fingerprint is not None and legacy_fingerprint(m["fingerprint"]):
            raise MoECompressError(
                f"The stats store {self.path} was computed on another model or by an earlier moecompress (its "
                "model fingerprint sampled the weights, so it cannot be shown to come from this model); re-run "
                "calibration with this version (calibrate --overwrite replaces it)."
            )
        if model_fingerprint is not None and m["fingerprint"] != model_fingerprint:
            raise MoECompressError(
                f"The stats store {self.path} was computed on another model or other weights of it "
                f"({m['source']}, whose bytes differ from this model's); re-run calibration for this model "
                "or pass the store made from it."
            )
        if data_spec is not None and d["spec"] != data_spec:
            raise MoECompressError(
                f"The stats store {self.path} was computed on data '{d['spec']}', not "
                f"'{data_spec}'; re-run calibration with this data or pass --data {d['spec']}."
            )

    def check_model(
        self,
        moe_layers: list[int],
        num_experts: dict[int, int],
        hidden_size: int,
        top_k: dict[int, int] | None = None,
    ) -> None:
        """Refuse (one sentence) a store whose statistics do not fit the model.

        The recorded identity (fingerprint, source) is only text: a store copied from another model with it
        edited passed `check`. What editing stats.json cannot change is checked instead: the MoE layers, the
        shapes of the statistics that follow from the model (`_SHAPES`, from the files' headers) and, where the
        routing counts are held, that each token chose `top_k` experts (sum of counts = tokens x top-k), which
        tells apart models of the same shapes (the two fixtures)."""
        from ..disk import read_header

        if sorted(self.layers) != sorted(moe_layers):
            raise MoECompressError(
                f"The stats store {self.path} covers MoE layers {self.layers} but the model's are "
                f"{sorted(moe_layers)}: it was made for another model; re-run calibration for "
                "this model."
            )
        for i in self.layers:
            try:
                header = read_header(self._file(i))
            except (OSError, ValueError, UnicodeDecodeError):
                raise MoECompressError(
                    f"{self._file(i)} is missing or unreadable: the stats store is corrupted; "
                    "re-run calibration."
                ) from None
            dims = {"E": num_experts[i], "H": hidden_size}
            for name, entry in header.items():
                want = [dims[d] for d in _SHAPES.get(name, ())]
                if want and list(entry.get("shape", [])) != want:
                    raise MoECompressError(
                        f"The stats store {self.path} holds '{name}' of layer {i} with shape "
                        f"{entry.get('shape')}, but this model needs {want}: it was made for "
                        "another model; re-run calibration for this model."
                    )
            if top_k is not None and {"counts", "tokens"} <= set(header):
                counts, tokens = self._read(i, "counts", ...), self._read(i, "tokens", ...)
                if int(counts.sum()) != int(tokens) * top_k[i]:
                    per_token = int(counts.sum()) / max(int(tokens), 1)
                    raise MoECompressError(
                        f"The stats store {self.path} routes {per_token:g} experts per token in "
                        f"layer {i}, but this model routes {top_k[i]}: it was made for another "
                        "model; re-run calibration for this model."
                    )

    def _file(self, layer: int) -> Path:
        return self.path / f"layer_{layer:04d}.safetensors"

    # ------------------------------------------------------------------ access
    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    @property
    def names(self) -> list[str]:
        return list(self.meta["stats"])

    @property
    def token_count(self) -> int:
        return int(self.meta["data"]["tokens"])

    @property
    def data_spec(self) -> str:
        return self.meta["data"]["spec"]

    @property
    def model_fingerprint(self) -> str:
        return self.meta["model"]["fingerprint"]

    @property
    def seed(self) -> int:
        return int(self.meta["data"]["seed"])

    def has(self, *names: str) -> bool:
        return all(n in self.meta["stats"] for n in names)

    def require(self, *names: str, method: str | None = None) -> None:
        missing = [n for n in names if n not in self.meta["stats"]]
        if missing:
            hint = f"--for-method {method}" if method else f"--stats {','.join(missing)}"
            raise MoECompressError(
                f"The stats store {self.path} lacks '{missing[0]}'; re-run moecompress calibrate with {hint}."
            )

    def get(self, layer: int, name: str) -> torch.Tensor:
        """Statistic `name` of decoder layer `layer` (see docs/calibration.md for definitions and shapes)."""
        return self._read(layer, name, ...)

    def get_row(self, layer: int, name: str, index: int) -> torch.Tensor:
        """``get(layer, name)[index]``, reading only that row from the file (one expert's moments)."""
        return self._read(layer, name, index)

    def get_rows(self, layer: int, name: str, ids: list[int]) -> torch.Tensor:
        """``get(layer, name)[ids]``, reading only those rows."""
        return torch.stack([self._read(layer, name, e) for e in ids])

    def _read(self, layer: int, name: str, index) -> torch.Tensor:
        if layer not in self.meta["layers"]:
            raise MoECompressError(f"The stats store has no layer {layer}; its MoE layers are {self.layers}.")
        self.require(name)
        from safetensors import safe_open

        try:
            with safe_open(str(self._file(layer)), framework="pt") as f:
                metadata = f.metadata()
                packed = name in _packed_in(metadata)
                t = f.get_tensor(name) if index is ... else f.get_slice(name)[index]
        except Exception:
            raise MoECompressError(
                f"{self._file(layer)} is missing or unreadable: the stats store is corrupted; "
                "re-run calibration."
            ) from None
        check_identity(self._file(layer), metadata, layer, self.meta["model"]["fingerprint"])
        # calibration never writes NaN or inf (it refuses them, and unreached experts get 0), so one here was
        # edited in or damaged; it used to change the plan silently (NaN scores sort anywhere)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MoECompressError(
                f"The stats store {self.path} holds NaN or infinite values in '{name}' of layer "
                f"{layer}: it is corrupted; re-run calibration."
            )
        return _unpacked(t, name, self._file(layer)) if packed else t

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return {n: self.get(layer, n) for n in self.names}

    def unreached(self) -> dict[int, list[int]]:
        return {int(k): v for k, v in self.meta.get("unreached", {}).items()}

    def describe(self) -> str:
        """One line for reports: calibration domain, token count, seed."""
        d = self.meta["data"]
        domains = "; ".join(f"{s.get('term')}: {s.get('domain')}" for s in d.get("sources", []))
        return f"calibration {d['spec']} ({domains}), {d['tokens']:,} tokens, seq_len {d['seq_len']}, seed {d['seed']}"


def write_store(
    out: Path, partial: PartialRun, layers: list[int], meta: dict, inputs=None, overwrite: bool = False
) -> StatsStore:
    """Move the finished layer files of `partial` into a complete store at `out` (atomically).

    `inputs`: the model's fingerprint from when the run started (`atomic.fingerprint_inputs`), checked
    before the rename. `overwrite`: the run's own; a store that appeared at `out` while this run computed
    (another run finished first) is refused without it, not silently replaced."""
    from ..atomic import atomic_dir

    with atomic_dir(out, overwrite=overwrite, kind="stats", inputs=inputs) as tmp:
        packed: set[str] = set()
        for i in layers:
            os.replace(partial.dir / f"layer_{i:04d}.safetensors", Path(tmp) / f"layer_{i:04d}.safetensors")
            packed |= _file_packed(Path(tmp) / f"layer_{i:04d}.safetensors")
        # informational (each file's metadata says what it holds packed): which statistics are upper triangles
        _write_json(
            Path(tmp) / "stats.json",
            {**meta, "packed": sorted(packed), "packing": "upper triangle, torch.triu_indices order"},
        )
    return StatsStore(
        Path(out), load_json(Path(out) / "stats.json", "the stats store is corrupted, so re-run calibration")
    )


class PartialRun:
    """The resumable state of a run in progress: ``.DIR.partial/`` beside the output.

    `start` claims the output (`atomic.claim`, the same ``.DIR.lock`` the store is written under) and
    holds it until `close` or `remove`: two runs given one ``--out`` would otherwise share (and delete)
    one partial directory and write a store of mixed layers. `remove` is for every way a run ends
    except an interruption a resume can continue (the caller decides, see `Calibration._stream`)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out.parent / f".{self.out.name}.partial"
        self._claim = None

    def start(self, identity: dict, resume: bool) -> list[int]:
        """Begin (or, with resume, continue) a run; returns layers already finished.

        Refuses in one sentence while another run holds the output's lock; on any failure here the
        lock is let go again."""
        from ..atomic import claim

        if self._claim is None:
            held = claim(self.out)
            held.__enter__()
            self._claim = held
        try:
            return self._start(identity, resume)
        except BaseException:
            self.close()
            raise

    def _read_run(self) -> dict | None:
        """run.json of the partial run in `dir` when it is ours (an identity and the finished layers), else None."""
        if self.dir.is_symlink():
            return None
        # cut short by a crash of an older version, or not ours (or crafted: bounded, `safejson`)
        old = try_load_json(self.dir / "run.json")
        ours = isinstance(old, dict) and isinstance(old.get("identity"), dict)
        finished = old.get("finished") if ours else None
        layers = isinstance(finished, list) and all(type(i) is int and i >= 0 for i in finished)
        return old if layers else None

    def _start(self, identity: dict, resume: bool) -> list[int]:
        from ..atomic import clear_partial
        from ..checkpoint import legacy_fingerprint

        run = self.dir / "run.json"
        old = self._read_run()
        if self.dir.exists() and resume and (run.is_file() or run.is_symlink()):
            if old is None:  # a clear refusal, not a traceback; and not deleted: nothing proves it ours
                raise MoECompressError(
                    f"The interrupted run in {self.dir} cannot be resumed (its run.json is cut "
                    "short or unreadable); remove it and drop --resume to start over."
                ) from None
            if legacy_fingerprint(old["identity"].get("model_fingerprint")):
                raise MoECompressError(
                    f"The interrupted run in {self.dir} was made with another model or by an earlier "
                    "moecompress (its model fingerprint sampled the weights, so its finished layers cannot be "
                    "shown to come from this model); drop --resume to start over."
                )
            for key, what in (
                ("model_fingerprint", "another model or other weights of it"),
                ("data_fingerprint", "other data"),
                ("data_spec", "another data spec"),
            ):
                if old["identity"].get(key) != identity.get(key):
                    raise MoECompressError(
                        f"The interrupted run in {self.dir} was made with {what} "
                        f"({old['identity'].get(key.replace('fingerprint', 'source'), key)}); "
                        "drop --resume to start over or pass its original inputs."
                    )
            if old["identity"] != identity:
                diff = sorted(k for k in identity if old["identity"].get(k) != identity[k])
                raise MoECompressError(
                    f"The interrupted run in {self.dir} used different settings ({', '.join(diff)}); "
                    "drop --resume to start over or pass the same settings."
                )
            return [i for i in old["finished"] if (self.dir / f"layer_{i:04d}.safetensors").is_file()]
        clear_partial(self.dir, ours=old is not None)  # never deletes what moecompress did not write
        self.dir.mkdir(parents=True)
        try:
            _write_json(run, {"identity": identity, "finished": []})
        except BaseException:  # a full disk here: no run started, so nothing is left to resume
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return []

    def save_layer(self, i: int, stats: dict[str, torch.Tensor]) -> None:
        run = load_json(self.dir / "run.json", "the interrupted run is corrupted, so drop --resume")
        model = str(run.get("identity", {}).get("model_fingerprint"))
        _save_tensors(self.dir / f"layer_{i:04d}.safetensors", stats, {"layer": str(i), "model": model})
        run["finished"] = sorted(set(run["finished"]) | {i})
        _write_json(self.dir / "run.json", run)

    def load_layer(self, i: int) -> dict[str, torch.Tensor]:
        """A finished layer's statistics, symmetric ones rebuilt whole; refused when the file names another
        layer or model (`_check_identity`)."""
        run = load_json(self.dir / "run.json", "the interrupted run is corrupted, so drop --resume")
        return _load_tensors(
            self.dir / f"layer_{i:04d}.safetensors", i, run.get("identity", {}).get("model_fingerprint")
        )

    @property
    def holding(self) -> bool:
        """Whether this run holds the output's lock (`start` succeeded and no `close` / `remove` since)."""
        return self._claim is not None

    def close(self) -> None:
        """Let go of the output's lock, keeping the partial directory (for --resume)."""
        if self._claim is not None:
            claim, self._claim = self._claim, None
            claim.__exit__(None, None, None)

    def remove(self) -> None:
        """Delete the partial directory, then let go of the lock."""
        try:
            shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            self.close()


def _file_packed(path: Path) -> frozenset[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return _packed_in(f.metadata())


def _load_tensors(path: Path, layer: int, model_fingerprint) -> dict[str, torch.Tensor]:
    """Every tensor of one layer file, packed ones rebuilt (`calibrate.symmetric.unpack`)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        check_identity(path, f.metadata(), layer, model_fingerprint)
        packed = _packed_in(f.metadata())
        names = list(f.keys())  # a safe_open handle is no mapping
        return {k: _unpacked(f.get_tensor(k), k, path) if k in packed else f.get_tensor(k) for k in names}


def load_stats(path, model_fingerprint: str | None = None, data_spec: str | None = None) -> StatsStore:
    """`StatsStore.load` under a function name."""
    return StatsStore.load(path, model_fingerprint, data_spec)
