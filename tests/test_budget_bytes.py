"""`auto`'s budget holds as the exporter writes it, on bf16 and float32 checkpoints alike and with quantized
experts among the stored ones (issue 14): with ``budget_scope: routed`` the routed-expert tensors in the exported
safetensors equal the plan's byte count (CompressionPlan.logical_bytes) and match the tensor budget (the budget
less what auto reserves for the files' headers, issue 48) within 1 % of the original routed-expert bytes as stored;
with the default whole-file scope (issue 30) every weight tensor of the export does, against the original file's
weights. The weight files themselves, headers included, never exceed the budget (issue 48; more budgets and both
fixtures: tests/test_budget_disk.py). Also through `moecompress compress`."""

import math

import pytest
import torch

from moecompress.api import export
from moecompress.calibrate import calibrate
from moecompress.data import CalibrationData
from moecompress.disk import read_header, stored_tensors
from moecompress.methods import MethodContext, get_method, parse_config
from moecompress.methods.auto import config as A
from moecompress.models import MoEAdapter, load_model
from moecompress.plan import CompressionPlan
from moecompress.testing import run_cli, tiny_model
from moecompress.workflows.pipeline import choose_format

SIZES = {"BF16": 2, "F32": 4, "F16": 2, "I16": 2, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}
FAST = dict(
    sensitivity="uniform", measure=False, ranks=[1, 2, 4], bits=[16, 4, 2]
)  # quantized keeps included
ROUTED = dict(FAST, budget_scope="routed")


def routed_written(directory) -> int:
    """Bytes of the routed-expert tensors in an export: stored scopes and slot operators (compact/packed),
    or the experts (hf)."""
    total = 0
    for f in directory.glob("*.safetensors"):
        for k, h in read_header(f).items():
            if k.startswith("moecompress.scopes.") or ".ops." in k or ".mlp.experts." in k:
                total += SIZES[h["dtype"]] * math.prod(h["shape"])
    return total


def whole_written(directory) -> int:
    """Bytes of every tensor in an export's safetensors files (the whole file's weights)."""
    return sum(n for _, n in stored_tensors(directory).values())


def files_written(directory) -> int:
    """Bytes on disk of an export's weight files, headers included: what the budget bounds (issue 48)."""
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def tensor_budget(plan) -> int:
    """What the allocation could use: the budget less the bytes reserved for the files' headers."""
    a = plan.params["auto"]
    assert 0 < a["reserved_bytes"] and a["tensor_budget_bytes"] == a["budget_bytes"] - a["reserved_bytes"]
    return a["tensor_budget_bytes"]


# the bf16 checkpoint (what real ones are) in the default run; the float32 one with the slow tests (README)
@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def calibrated(request, tmp_path_factory):
    """A tiny OLMoE stored in `dtype`, calibrated and loaded in float32 (as `compress` computes)."""
    dtype = request.param
    root = tmp_path_factory.mktemp(f"budget_{dtype}")
    path = root / "model"
    tiny_model("olmoe", seed=5, num_experts=64, num_experts_per_tok=2).to(
        getattr(torch, dtype)
    ).save_pretrained(path)
    ids = torch.randint(3, 96, (32, 24), generator=torch.Generator().manual_seed(0))
    store = calibrate(
        str(path),
        CalibrationData.from_tokens(ids),
        seq_len=24,
        out=root / "stats",
        stats=A.needs_stats(A.AutoConfig()),
        batch_size=4,
        dtype="float32",
        progress=False,
    )
    return dtype, path, store, MoEAdapter(load_model(str(path), dtype="float32"))


def _cli_args(path, store, out) -> list[str]:
    """`compress --method auto --budget 0.5` on the calibrated checkpoint, quickly (uniform sensitivity)."""
    params = ["sensitivity=uniform", "measure=false", "ranks=[1]", "bits=[16,4]"]  # the bytes, not the search
    return [
        "compress",
        str(path),
        "--method",
        "auto",
        "--budget",
        "0.5",
        "--calib",
        str(store.path),
        "--out",
        str(out),
        *[x for p in params for x in ("--param", p)],
    ]


def _original_routed(path) -> int:
    return sum(n for k, (_, n) in stored_tensors(path).items() if ".mlp.experts." in k)


@pytest.mark.parametrize("budget", [0.5])
def test_fraction_budget_is_written_within_one_percent(calibrated, tmp_path, budget):
    dtype, path, store, adapter = calibrated
    original = _original_routed(path)
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(budget=budget, **ROUTED)), MethodContext(adapter, store)
    )
    assert plan.model.dtype == dtype and plan.model.expert_bytes == original
    out = tmp_path / "out"
    result = export(str(path), plan, out, format=choose_format(plan), tensors=tensors, quiet=True)
    written = routed_written(out)
    assert result.routed_bytes == written and result.original_routed_bytes == original
    target = math.floor(budget * original)
    assert (
        written
        == plan.logical_bytes(tensors, accounting="stored").routed
        == plan.params["auto"]["routed_bytes"]
    )
    assert tensor_budget(plan) - 0.01 * original <= written <= tensor_budget(plan) < target
    assert plan.params["auto"]["budget_bytes"] == target and not plan.tensor_quant
    # a routed budget bounds the files less the tensors outside its scope, which it leaves as they are
    assert files_written(out) <= plan.params["auto"]["files_budget_bytes"] == target + plan.model.other_bytes
    # the count holds with quantized experts (packed int32 codes + bf16 scales) among the stored ones
    assert any(s.quant is not None for sc in plan.scopes for s in sc.stored)


def test_absolute_budget_is_routed_expert_bytes(calibrated, tmp_path):
    dtype, path, store, adapter = calibrated
    original = _original_routed(path)
    size = f"{original * 0.6 / 1000:.3f}KB"  # decimal kilobytes
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(budget=size, **ROUTED)), MethodContext(adapter, store)
    )
    target = math.floor(float(size[:-2]) * 1000)
    assert plan.params["auto"]["budget_bytes"] == target
    out = tmp_path / "out"
    export(str(path), plan, out, format=choose_format(plan), tensors=tensors, quiet=True)
    assert tensor_budget(plan) - 0.01 * original <= routed_written(out) <= tensor_budget(plan)
    assert files_written(out) <= target + plan.model.other_bytes


@pytest.mark.slow  # the CLI path is the whole-file test below; routed bytes are the API tests above
def test_cli_budget_half_writes_half_the_routed_bytes(calibrated, tmp_path, capsys):
    """The reported bug: on a bf16 model --budget 0.5 wrote every routed byte (counted at 4 bytes/param)."""
    dtype, path, store, _ = calibrated
    original = _original_routed(path)
    out = tmp_path / "cli"
    args = [*_cli_args(path, store, out), "--budget-scope", "routed"]
    code, text, err = run_cli(args, capsys)
    assert code == 0, err
    plan = CompressionPlan.from_json((out / "plan.json").read_text())
    assert tensor_budget(plan) - 0.01 * original <= routed_written(out) <= tensor_budget(plan) < original // 2
    assert files_written(out) <= original // 2 + plan.model.other_bytes
    assert "auto: per-layer choices" in text and "-bit" in text  # representation × bits, per layer


# 0.5: the CLI test below; not 0.3: on this 64-expert toy model of 24-wide experts the header entries of every
# representation an export may write (auto's reserve, issue 48) already take a third of the file at 0.3
@pytest.mark.parametrize("budget", [0.4])
def test_whole_file_budget_is_written_within_one_percent(calibrated, tmp_path, budget):
    """The default scope: every weight of the export (experts, attention, embeddings, lm_head, norms, routers)
    within the tensor budget and within 1 % of it, non-expert weights quantized where that saves most (issue 30);
    the files, headers included, within the budget (issue 48)."""
    dtype, path, store, adapter = calibrated
    original = whole_written(path)
    plan, tensors = get_method("auto").build(
        parse_config("auto", dict(FAST, budget=budget, ranks=[1], bits=[16, 4])),
        MethodContext(adapter, store),
    )
    assert plan.model.expert_bytes + plan.model.other_bytes == original
    out = tmp_path / "out"
    export(str(path), plan, out, format=choose_format(plan), tensors=tensors, quiet=True)
    target = math.floor(budget * original)
    written = plan.logical_bytes(tensors, accounting="stored").total
    assert written == plan.params["auto"]["whole_bytes"] and plan.params["auto"]["budget_bytes"] == target
    assert tensor_budget(plan) - 0.01 * original <= written <= tensor_budget(plan)
    assert whole_written(out) == written  # every tensor of the file, packed codes and their shapes included
    assert written < files_written(out) <= target == plan.params["auto"]["files_budget_bytes"]


def test_cli_budget_is_the_whole_file_by_default(calibrated, tmp_path, capsys):
    dtype, path, store, _ = calibrated
    original = whole_written(path)
    out = tmp_path / "cli"
    args = _cli_args(path, store, out)
    code, text, err = run_cli(args, capsys)
    assert code == 0, err
    plan = CompressionPlan.from_json((out / "plan.json").read_text())
    assert tensor_budget(plan) - 0.02 * original <= whole_written(out) <= tensor_budget(plan)
    assert files_written(out) <= original // 2  # the files on disk, headers included (issue 48)
    assert f"of the {original // 2}-byte budget" in " ".join(text.split())  # the summary prints the budget


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.5", (0.5, None)),
        (0.25, (0.25, None)),
        ("50%", (0.5, None)),
        ("1", (1.0, None)),
        ("4GB", (None, 4 * 10**9)),
        ("500MB", (None, 500 * 10**6)),
        ("500mb", (None, 500 * 10**6)),
        ("1.5GiB", (None, 3 * 2**29)),
        ("64KiB", (None, 65536)),
        ("1200B", (None, 1200)),
        ("2 MiB", (None, 2 * 2**20)),
    ],
)
def test_parse_budget(text, expected):
    assert A.parse_budget(text) == expected


@pytest.mark.parametrize("text", ["1.5", "0", "-0.5", "4XB", "half", "GB", "0GB", "", "nan", True, 2])
def test_bad_budget_is_one_sentence(text):
    with pytest.raises(
        A.MoECompressError, match=r"^Budget '.*' is not a fraction in \(0, 1\] or a size such as"
    ):
        A.parse_budget(text)
    with pytest.raises(A.MoECompressError, match="is not a fraction"):
        parse_config("auto", {"budget": text})
