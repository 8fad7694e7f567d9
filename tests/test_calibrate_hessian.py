"""GPTQ Hessians from the calibration engine: equal to an explicit computation from hooks on the HF experts,
gate²-weighted variant, store round trip, union of a merged expert's sources, layer subsets, CLI and dry run."""

import json

import pytest
import torch
import torch.nn.functional as F

from moecompress.calibrate import StatsStore, calibrate, union_hessian
from moecompress.data import CalibrationData
from moecompress.errors import MoECompressError
from moecompress.methods import stats_for_method
from moecompress.models import load_model
from moecompress.testing import fixture_dir, run_cli, save_tiny

HESS = ["hessian_in", "hessian_mid", "hessian_in_g2", "hessian_mid_g2"]
FAMILIES = ("olmoe", "qwen3_moe")


def _ids():
    return torch.randint(3, 96, (6, 20), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _hf_reference(path, ids):
    """Per layer: routing (index, weight) and float64 Hessians, from a pre-hook on the HF experts module that
    receives (block input, top-k index, top-k weights); intermediates recomputed from the fused gate_up_proj and
    checked to rebuild the experts module's own output."""
    model = load_model(str(path), dtype="float32")
    caught = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        hooks.append(ex.register_forward_hook(lambda m, args, out, i=i: caught.__setitem__(i, (*args, out))))
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    ref = {}
    for i, (x, index, weight, out) in caught.items():
        ex = model.model.layers[i].mlp.experts
        x, weight = x.double(), weight.double()
        E, I = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[1] // 2
        rebuilt = torch.zeros_like(x)
        r = {n: [] for n in HESS}
        for e in range(E):
            tok, slot = torch.where(index == e)
            gate, up = F.linear(x[tok], ex.gate_up_proj[e].double()).chunk(2, dim=-1)
            a = ex.act_fn(gate) * up  # [n_e, I]
            g = weight[tok, slot][:, None]
            rebuilt.index_add_(0, tok, g * F.linear(a, ex.down_proj[e].double()))
            xe = x[tok]
            r["hessian_in"].append(xe.T @ xe)
            r["hessian_mid"].append(a.T @ a)
            r["hessian_in_g2"].append((g * g * xe).T @ xe)
            r["hessian_mid_g2"].append((g * g * a).T @ a)
        torch.testing.assert_close(rebuilt, out.double(), rtol=1e-4, atol=1e-5)
        ref[i] = {n: torch.stack(v) for n, v in r.items()}
        ref[i]["x"], ref[i]["index"], ref[i]["I"] = x, index, I
    return ref


@pytest.fixture(scope="module", params=FAMILIES)
def calibrated(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = save_tiny(request.param, root / "model", seed=3)
    in_memory = {}
    store = calibrate(
        str(path),
        CalibrationData.from_tokens(_ids()),
        seq_len=20,
        out=root / "stats",
        stats=[*HESS, "hessian_mid_g2_diag"],
        batch_size=4,
        dtype="float32",
        progress=False,
        on_layer_end=lambda i, s: in_memory.__setitem__(i, s),
    )
    return path, store, in_memory, _hf_reference(path, _ids())


def test_hessians_equal_explicit_hf_computation(calibrated):
    _, store, _, ref = calibrated
    assert store.layers == sorted(ref)
    for i in store.layers:
        for n in HESS:
            got = store.get(i, n)
            assert got.dtype == torch.float32
            want = ref[i][n]
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        counts = torch.bincount(ref[i]["index"].reshape(-1), minlength=store.get(i, "counts").numel())
        assert torch.equal(store.get(i, "counts"), counts)
        # the weighting matters on these routers (g < 1), so the g2 check is not the plain one again
        assert float((ref[i]["hessian_in"] - ref[i]["hessian_in_g2"]).abs().max()) > 1e-3
        # the fast search's vector per expert: the gate²-weighted mid Hessian's diagonal, gathered on its own
        want = ref[i]["hessian_mid_g2"].diagonal(dim1=-2, dim2=-1)
        got = store.get(i, "hessian_mid_g2_diag")
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_store_round_trip(calibrated):
    _, store, in_memory, _ = calibrated
    again = StatsStore.load(store.path)
    assert set(HESS) <= set(again.names)
    for i in again.layers:
        for n in HESS:
            assert torch.equal(again.get(i, n), in_memory[i][n])


def test_union_hessian_counts_co_routed_tokens_once_per_source(calibrated):
    _, store, _, ref = calibrated
    i = store.layers[0]
    index, x = ref[i]["index"], ref[i]["x"]
    # the pair of experts most often selected together, so the multiplicity choice is visible
    E = store.get(i, "counts").numel()
    both = torch.tensor(
        [[int(((index == a).any(1) & (index == b).any(1)).sum()) for b in range(E)] for a in range(E)]
    )
    both.fill_diagonal_(-1)
    a, b = divmod(int(both.argmax()), E)
    assert both[a, b] > 0
    m = ((index == a).sum(1) + (index == b).sum(1)).double()  # m_t(S) = |K(t) ∩ {a, b}|
    h, n = union_hessian(store, i, [a, b])
    want = (m[:, None] * x).T @ x
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert n == int(m.sum())
    once = x[m > 0].T @ x[m > 0]  # the set union differs by the co-routed tokens
    assert float((h - once).abs().max()) > 1e-3 * float(once.abs().max())
    # (layer, expert) pairs as in StoredExpert.sources; the mid Hessian is the sources' sum
    h2, _ = union_hessian(store, 99, [(i, a), (i, b)])
    assert torch.equal(h2, h)
    mid, _ = union_hessian(store, i, [a, b], kind="mid", g2=True)
    torch.testing.assert_close(
        mid, ref[i]["hessian_mid_g2"][a] + ref[i]["hessian_mid_g2"][b], rtol=1e-5, atol=1e-6
    )
    with pytest.raises(MoECompressError, match="out of range"):
        union_hessian(store, i, [E])
    with pytest.raises(MoECompressError, match="kind must be"):
        union_hessian(store, i, [0], kind="out")


def test_method_registry_asks_for_hessians():
    for method in ("quant", "gptq"):
        assert {"counts", "hessian_in", "hessian_mid"} <= set(stats_for_method(method))
    assert {"hessian_in_g2", "hessian_mid_g2"} <= set(stats_for_method("gptq-g2"))


def test_hessian_layers_subset_and_dry_run_bytes(tmp_path):
    path = save_tiny("olmoe", tmp_path / "model", seed=3)
    data = CalibrationData.from_tokens(_ids())
    kw = {"seq_len": 20, "batch_size": 4, "dtype": "float32", "progress": False}
    E, H, I, L = 8, 32, 16, 2
    base = calibrate(str(path), data, out=tmp_path / "d0", stats=["counts"], dry_run=True, **kw)
    both = ["hessian_in", "hessian_mid"]
    full = calibrate(str(path), data, out=tmp_path / "d1", stats=both, dry_run=True, **kw)
    one = calibrate(str(path), data, out=tmp_path / "d2", stats=both, hessian_layers=[1], dry_run=True, **kw)
    mid = calibrate(str(path), data, out=tmp_path / "d3", stats=["hessian_mid"], dry_run=True, **kw)
    tri = lambda d: d * (d + 1) // 2  # a store keeps each symmetric matrix's upper triangle
    assert (
        mid.stats_bytes - base.stats_bytes == L * E * tri(I) * 4
    )  # the down projection's alone: no [E, H, H] sums
    assert mid.accumulator_bytes - base.accumulator_bytes == E * I * I * 8
    per_layer = E * (H * H + I * I)
    assert full.stats_bytes - base.stats_bytes == L * E * (tri(H) + tri(I)) * 4  # stored in float32, packed
    assert one.stats_bytes - base.stats_bytes == E * (tri(H) + tri(I)) * 4
    assert (
        full.accumulator_bytes - base.accumulator_bytes == per_layer * 8
    )  # float64 sums of one layer, whole
    assert "collector sums (one layer)" in dict(full.rows())

    store = calibrate(str(path), data, out=tmp_path / "s", stats=both, hessian_layers="1", **kw)
    assert store.get(0, "hessian_in").shape == (0, H, H) and store.get(0, "hessian_mid").shape == (0, I, I)
    assert store.get(1, "hessian_in").shape == (E, H, H)
    torch.testing.assert_close(
        store.get(1, "hessian_in").double(),
        _hf_reference(path, _ids())[1]["hessian_in"],
        rtol=1e-5,
        atol=1e-4,
    )
    with pytest.raises(MoECompressError, match="no 'hessian_in' for layer 0"):
        union_hessian(store, 0, [1])
    with pytest.raises(MoECompressError, match="not a MoE layer"):
        calibrate(str(path), data, out=tmp_path / "bad", stats=["hessian_in"], hessian_layers=[7], **kw)
    with pytest.raises(MoECompressError, match="not a list of layer ids"):
        calibrate(str(path), data, out=tmp_path / "bad", stats=["hessian_in"], hessian_layers="a,b", **kw)
    assert not (tmp_path / "bad").exists()


def test_cli_for_method_quant_on_fixture(tmp_path, capsys):
    model = str(fixture_dir("olmoe-tiny"))
    out = tmp_path / "S"
    code, _, err = run_cli(
        [
            "calibrate",
            model,
            "--data",
            "fixture-calib:8",
            "--seq-len",
            "64",
            "--out",
            str(out),
            "--for-method",
            "quant",
            "--stats",
            "in_channel_norm,mid_channel_norm",
        ],
        capsys,
    )
    assert code == 0, err
    store = StatsStore.load(out)
    cfg = json.loads((fixture_dir("olmoe-tiny") / "config.json").read_text())
    E, H, I = cfg["num_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    for i in store.layers:
        hin, hmid = store.get(i, "hessian_in").double(), store.get(i, "hessian_mid").double()
        assert hin.shape == (E, H, H) and hmid.shape == (E, I, I)
        torch.testing.assert_close(hin, hin.transpose(1, 2))
        # the diagonal is another collector's channel norm squared: Σ_{t∈T_e} h_{t,j}²
        torch.testing.assert_close(
            hin.diagonal(dim1=1, dim2=2), store.get(i, "in_channel_norm").double() ** 2, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            hmid.diagonal(dim1=1, dim2=2),
            store.get(i, "mid_channel_norm").double() ** 2,
            rtol=1e-4,
            atol=1e-6,
        )
    code, stdout, _ = run_cli(
        [
            "calibrate",
            model,
            "--data",
            "fixture-calib:8",
            "--seq-len",
            "64",
            "--out",
            str(tmp_path / "D"),
            "--for-method",
            "quant",
            "--dry-run",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    est = json.loads(stdout)
    assert (
        est["stats_bytes"] >= len(store.layers) * E * (H * (H + 1) + I * (I + 1)) // 2 * 4
    )  # upper triangles
    assert est["accumulator_bytes"] >= E * (H * H + I * I) * 8
    code, _, err = run_cli(
        [
            "calibrate",
            model,
            "--data",
            "fixture-calib:8",
            "--out",
            str(tmp_path / "X"),
            "--for-method",
            "quant",
            "--hessian-layers",
            "0,x",
        ],
        capsys,
    )
    assert code == 2 and "not a list of layer ids" in err
