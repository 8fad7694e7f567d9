"""`moecompress compress` end to end on a tiny model: stats dir in, smaller checkpoint out."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moecompress.calibrate import calibrate
from moecompress.data import CalibrationData
from moecompress.testing import run_cli, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    path = save_tiny("qwen3_moe", root / "model", seed=1)
    ids = torch.randint(3, 96, (6, 16), generator=torch.Generator().manual_seed(0))
    calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=16,
        out=root / "stats",
        stats=["counts", "tokens", "reap", "out_mean", "out_var", "out_norm_sq_mean", "routing_mass"],
        dtype="float32",
        progress=False,
    )
    return root, path


def test_renorm_pruning_writes_a_vanilla_smaller_checkpoint(tiny, capsys):
    root, path = tiny
    out = root / "pruned"
    code, stdout, err = run_cli(
        [
            "compress",
            str(path),
            "--method",
            "prune",
            "--criterion",
            "reap",
            "--ratio",
            "0.5",
            "--gate",
            "renorm",
            "--calib",
            str(root / "stats"),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    assert "hf checkpoint" in stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_experts == 4
    plan = json.loads((out / "plan.json").read_text())
    assert plan["method"] == "prune" and plan["params"]["criterion"] == "reap"
    assert torch.isfinite(model(torch.randint(3, 96, (1, 8))).logits).all()


def test_constant_operator_goes_compact(tiny, capsys):
    root, path = tiny
    out = root / "const"
    code, stdout, err = run_cli(
        [
            "compress",
            str(path),
            "--operator",
            "constant",
            "--criterion",
            "mone",
            "--ratio",
            "0.25",
            "--calib",
            str(root / "stats"),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    assert "compact checkpoint" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ratio", "1.5"], "--ratio must be >= 0.0 and < 1.0"),
        (["--param", "rank"], "is not key=value"),
        (["--method", "prunee"], "Unknown method 'prunee'"),
        (["--format", "hf", "--operator", "constant"], "use --format compact"),
        (["--format", "bogus"], "Unknown export format 'bogus'"),
        (["--method", "auto", "--budget", "1.5"], "Budget '1.5' is not a fraction in (0, 1] or a size"),
        (["--method", "auto", "--budget", "4XB"], "Budget '4XB' is not a fraction in (0, 1] or a size"),
        (["--method", "auto", "--budget", "half"], "Budget 'half' is not a fraction in (0, 1] or a size"),
        (["--method", "auto", "--budget", "0GB"], "Budget '0GB' is not a fraction in (0, 1] or a size"),
    ],
)
def test_bad_input_is_one_sentence(tiny, capsys, args, message):
    root, path = tiny
    out = root / "bad"
    code, _, err = run_cli(
        ["compress", str(path), "--calib", str(root / "stats"), "--out", str(out), *args], capsys
    )
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_a_full_disk_is_one_sentence_and_leaves_nothing(tiny, capsys, monkeypatch):
    import errno

    from moecompress.export.writer import ShardWriter

    root, path = tiny
    out = root / "full"

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ShardWriter, "add", full)
    code, _, err = run_cli(
        [
            "compress",
            str(path),
            "--method",
            "prune",
            "--criterion",
            "reap",
            "--ratio",
            "0.5",
            "--calib",
            str(root / "stats"),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 2 and "The disk is full; free space there" in err and "Traceback" not in err
    assert not out.exists() and not list(root.glob(".full*"))  # neither the output nor its temporary sibling


def test_format_help_lists_every_registered_format(capsys, monkeypatch):
    from moecompress.export.formats import FORMATS

    monkeypatch.setenv("COLUMNS", "250")  # rich would wrap the help text inside its box
    code, stdout, _ = run_cli(["compress", "--help"], capsys)
    assert code == 0
    assert " | ".join(("auto", *FORMATS)) in stdout


def test_router_merge_through_compress_routes_with_merged_rows(tmp_path, capsys):
    """M-SMoE with merged router rows: the exported vanilla checkpoint routes with the merged rows."""
    from moecompress.api import apply_plan
    from moecompress.methods import MethodContext, get_method, parse_config
    from moecompress.methods.merging import install_merged_router
    from moecompress.models import MoEAdapter, load_model

    path = save_tiny("qwen3_moe", tmp_path / "m", seed=4)
    ids = torch.randint(3, 96, (6, 16), generator=torch.Generator().manual_seed(0))
    calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=16,
        out=tmp_path / "s",
        stats=["counts", "tokens", "router_logit_corr"],
        dtype="float32",
        progress=False,
    )
    out = tmp_path / "merged"
    code, _, err = run_cli(
        [
            "compress",
            str(path),
            "--method",
            "m-smoe",
            "--ratio",
            "0.5",
            "--param",
            "router=merge",
            "--calib",
            str(tmp_path / "s"),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    exported = AutoModelForCausalLM.from_pretrained(out)
    # reference: the same plan applied in memory after installing the merged router rows
    from moecompress.calibrate import StatsStore

    adapter = MoEAdapter(load_model(str(path), dtype="float32"))
    plan, tensors = get_method("m-smoe").build(
        parse_config("m-smoe", {"ratio": 0.5, "router": "merge"}),
        MethodContext(adapter, StatsStore.load(tmp_path / "s")),
    )
    install_merged_router(adapter, plan, tensors)
    ref = apply_plan(adapter.model, plan, tensors)
    x = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, ref(x).logits, atol=1e-5, rtol=1e-4)


def test_rank_zero_reaches_the_method_the_config_alone_checks_ranges(monkeypatch, capsys):
    """`--rank 0` (MoNE's constant) is a valid PruneConfig rank; the CLI no longer refuses it with a rule of its own."""
    import moecompress.cli.compress as cli_compress
    from moecompress.methods import parse_config

    seen = {}

    def compress(model, method, params, **kw):
        seen.update(params)
        raise SystemExit(0)

    monkeypatch.setattr(cli_compress, "compress", compress)
    code, _, err = run_cli(
        [
            "compress",
            "fixture:olmoe-tiny",
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--operator",
            "tilt",
            "--rank",
            "0",
            "--out",
            "unused",
        ],
        capsys,
    )
    assert code == 0 and seen["rank"] == 0, err
    assert parse_config("prune", dict(seen)).rank == 0
