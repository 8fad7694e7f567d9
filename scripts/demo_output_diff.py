#!/usr/bin/env python3
"""Every compression arm of the demo recipe, exported by two source trees, compared tensor by tensor.

    python scripts/demo_output_diff.py --old-src /path/to/old/src [--out build/demo_diff] [--arms a,b]

Each tree runs in its own interpreters (PYTHONPATH): it calibrates the recipe's union statistics once, as
`compare` does, then compresses every arm from that store, one process per arm (the distillation arm's
student is the dense arm's: `distill` is not part of compress). The report lists, per arm, whether every file is byte-identical
and, for tensors that differ, how many elements and the largest difference relative to the tensor's
largest magnitude. Results: <out>/diff.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import moecompress
try:
    from moecompress.workflows import pipeline
except ImportError:  # a tree from before the workflows/ package (issue 34)
    from moecompress import pipeline
from moecompress.calibrate import calibrate
from moecompress.models import resolve_source
from moecompress.recipe import load_recipe

recipe_path, out, what = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
r = load_recipe(recipe_path)
arms = [a for a in r.arms if a.distill is None]
model, c = str(resolve_source(r.model)), r.calibration
if what == "--calibrate":
    needs = sorted({s for a in arms for s in pipeline.needs_for(a.method, a.params, a.quant)})
    calibrate(model, c.data, seq_len=c.seq_len, seed=c.seed, out=out / "stats", stats=needs, progress=False,
              overwrite=True)
else:
    a = next(a for a in arms if a.name == what)
    moecompress.compress(model, a.method, a.params, calib=out / "stats", out=out / a.name, seed=c.seed,
                         quant=a.quant.model_dump() if a.quant else None, progress=False, overwrite=True)
"""


def produce(src: Path, out: Path, arms: str) -> None:
    """One interpreter for the union calibration, then one per arm: an arm never sees another arm's state."""
    import yaml

    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    recipe = ROOT / "src" / "moecompress" / "recipes" / "demo.yaml"
    names = [a["name"] for a in yaml.safe_load(recipe.read_text())["arms"] if "distill" not in a]
    for what in ["--calibrate"] + [n for n in names if arms == "all" or n in arms.split(",")]:
        subprocess.run([sys.executable, "-c", _CHILD, str(recipe), str(out), what], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        print(src, what, flush=True)


def compare(a: Path, b: Path) -> dict:
    import torch
    from safetensors import safe_open

    rows = {}
    for arm in sorted(p.name for p in a.iterdir() if p.is_dir() and p.name != "stats"):
        files = sorted(p.name for p in (a / arm).iterdir() if p.suffix in (".safetensors", ".json"))
        row = {"identical": True, "tensors": {}}
        for f in files:
            if (a / arm / f).read_bytes() == (b / arm / f).read_bytes():
                continue
            row["identical"] = False
            if f.endswith(".json"):
                row.setdefault("json_differs", []).append(f)
                continue
            with safe_open(str(a / arm / f), "pt") as fa, safe_open(str(b / arm / f), "pt") as fb:
                if set(fa.keys()) != set(fb.keys()):  # another plan: the tensors do not correspond
                    row["other_plan"] = sorted(set(fa.keys()) ^ set(fb.keys()))[:4]
                    continue
                for k in fa.keys():  # noqa: SIM118  a safe_open handle, not a dict
                    x, y = fa.get_tensor(k), fb.get_tensor(k)
                    if x.shape != y.shape:
                        row.setdefault("other_plan", []).append(k)
                        continue
                    if torch.equal(x, y):
                        continue
                    xd, yd = x.double(), y.double()
                    scale = float(xd.abs().max()) or 1.0
                    row["tensors"][k] = {"elements": int((x != y).sum()), "of": x.numel(),
                                         "max_rel_diff": float((xd - yd).abs().max()) / scale}
                    if k.endswith("tilt_U"):  # a tilt's factors are a basis: compare the operator U Vᵀ itself
                        v = k[:-1] + "V"
                        m1 = xd @ fa.get_tensor(v).double().transpose(-1, -2)
                        m2 = yd @ fb.get_tensor(v).double().transpose(-1, -2)
                        rel = (m1 - m2).flatten(1).norm(dim=1) / m1.flatten(1).norm(dim=1).clamp(min=1e-30)
                        row["tensors"][k]["operator_rel_diff"] = float(rel.max())
        rows[arm] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-src", required=True, type=Path)
    ap.add_argument("--out", default=ROOT / "build" / "demo_diff", type=Path)
    ap.add_argument("--arms", default="all")
    ap.add_argument("--reuse-old", action="store_true", help="keep <out>/old from an earlier run")
    a = ap.parse_args()
    if not a.reuse_old:
        produce(a.old_src, a.out / "old", a.arms)
    produce(ROOT / "src", a.out / "new", a.arms)
    rows = compare(a.out / "old", a.out / "new")
    (a.out / "diff.json").write_text(json.dumps(rows, indent=1) + "\n")
    for arm, row in rows.items():
        worst = max((t["max_rel_diff"] for t in row["tensors"].values()), default=0.0)
        n = sum(t["elements"] for t in row["tensors"].values())
        op = max((t.get("operator_rel_diff", 0.0) for t in row["tensors"].values()), default=0.0)
        what = "identical" if row["identical"] else (f"{len(row['tensors'])} tensors differ, {n} elements, max rel "
                                                     f"{worst:.2e}" + (f", tilt operators U Vᵀ max rel {op:.2e}" if op else ""))
        if row.get("other_plan"):
            what = f"another plan (tensors differ in name or shape, e.g. {row['other_plan'][0]})"
        print(f"{arm}: {what}" + (f" (json: {row['json_differs']})" if row.get("json_differs") else ""))


if __name__ == "__main__":
    main()
