"""Tiny random MoE models of every declared family, built from configs (for tests and benchmarks)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .models import FAMILIES

# the tiny config of each declared family is family data (`FamilySpec.tiny`); families without one build none
TINY_CONFIGS: dict[str, dict] = {f.model_type: f.tiny for f in FAMILIES.values() if f.tiny is not None}

FAMILY_NAMES = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[model_type], **overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def _randomise_buffers(model: torch.nn.Module, gen: torch.Generator) -> None:
    # zero-initialised router weights / biases would make every routing a tie
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 1 and (
                "router" in name
                or ".gate." in name
                or name.endswith("gate.weight")
                or "experts" in name
                or "sinks" in name
            ):
                scale = 0.1 if "experts" in name else 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * (scale if p.dim() > 1 else 0.1))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A random tiny causal LM of `model_type` in eval mode with non-degenerate routers and experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    _randomise_buffers(model, torch.Generator().manual_seed(seed))
    return model.eval()


def save_tiny(model_type: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny model (safetensors) with a byte-level stub tokenizer-free config to `path`."""
    model = tiny_model(model_type, seed=seed, **overrides)
    model.save_pretrained(path)
    return Path(path)


def fixture_dir(name: str) -> Path:
    """Path of a shipped trained fixture ('qwen3-moe-tiny' or 'olmoe-tiny')."""
    return Path(__file__).parent / "fixtures" / name


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `moecompress ARGS` in-process; (exit code, stdout, stderr) captured by pytest's capsys."""
    from .cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def block_inputs(adapter, ids) -> dict:
    """{MoE layer: its block's input [N, H]} from one full forward of `adapter.model` on token ids."""
    inputs = {}
    hooks = [
        adapter.layer(i).block.register_forward_hook(
            lambda m, a, o, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]).detach())
        )
        for i in adapter.moe_layers
    ]
    try:
        with torch.no_grad():
            adapter.model(ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def calibrated_tiny(root: str | Path, model_type: str, seed: int, stats: list[str]):
    """A saved tiny model calibrated on 8 x 24 seeded random tokens: (path, store, adapter, block inputs)."""
    from .calibrate import calibrate
    from .data import CalibrationData
    from .models import MoEAdapter, load_model

    root = Path(root)
    path = save_tiny(model_type, root / "model", seed=seed)
    ids = torch.randint(3, 96, (8, 24), generator=torch.Generator().manual_seed(0))
    store = calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=24,
        out=root / "stats",
        stats=stats,
        batch_size=4,
        dtype="float32",
        progress=False,
    )
    adapter = MoEAdapter(load_model(str(path), dtype="float32"))
    return path, store, adapter, block_inputs(adapter, ids)


def save_as(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """A copy of checkpoint `src` stored in `dtype` ("float32", "bfloat16"), written by `save_pretrained`
    (tokenizer files copied), e.g. a float32 copy of a bf16 fixture for tests that concern bytes."""
    import shutil

    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype))
    model.save_pretrained(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def tree_snapshot(*roots: Path) -> dict:
    """Every path under `roots` with (is_dir, size, mtime_ns): equal before and after a refused run means no file
    of the user's was touched."""
    import os

    snap = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = Path(dirpath) / name
                st = p.lstat()
                snap[str(p)] = (
                    p.is_dir(),
                    0 if p.is_dir() else st.st_size,
                    0 if p.is_dir() else st.st_mtime_ns,
                )
    return snap


@contextlib.contextmanager
def another_run_writing(out: Path, pid: int = 4242):
    """Hold `out`'s lock as a second moecompress process would (its own open file, so `flock` refuses this one)."""
    import fcntl
    import os

    from .atomic import lock_path

    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"moecompress pid {pid}\n".encode())
        yield path
    finally:
        os.unlink(path)
        os.close(fd)


def assert_refused(argv: list[str], capsys, fragment: str, roots) -> str:
    """Run the CLI on `argv` and check the bad-input policy (docs/architecture.md): exit 2, one `error:` sentence
    containing `fragment`, no traceback, and no file under `roots` created, changed or removed. Returns the line."""
    before = tree_snapshot(*roots)
    code, _, err = run_cli(argv, capsys)
    after = tree_snapshot(*roots)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert fragment in lines[0], lines[0]
    assert after == before, sorted(set(after) ^ set(before))
    return lines[0]
