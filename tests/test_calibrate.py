"""The calibration engine: layer-wise runner == full forward, statistics == naive references, resume,
multi-process, dry run, CLI and the sentences for bad input."""

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecompress.calibrate import (
    COLLECTORS,
    STAT_PROVIDERS,
    SequentialRunner,
    StatsStore,
    UnreachedExpertsWarning,
    calibrate,
)
from moecompress.calibrate.hooks import LayerObserver
from moecompress.checkpoint import CheckpointReader
from moecompress.data import CalibrationData, char_tokenizer
from moecompress.errors import MoECompressError
from moecompress.methods import register_method_stats, stats_for_method
from moecompress.models import MoEAdapter, load_model
from moecompress.testing import FAMILY_NAMES, save_tiny

# the engine's own collectors (method modules contribute more, tested where they live)
ALL_STATS = sorted(
    s for s, c in STAT_PROVIDERS.items() if COLLECTORS[c].__module__.endswith("calibrate.collectors")
)
# shared experts (qwen2_moe, deepseek_*), dense first layer + group-limited routing (deepseek_*), sigmoid router
# (deepseek_v3), biases + clamped SwiGLU + tuple block (gpt_oss), renormalised top-k (mixtral)
STAT_FAMILIES = ("qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer()
    out = {}
    for f in FAMILY_NAMES:
        out[f] = save_tiny(f, root / f, seed=4)
        tok.save_pretrained(out[f])
    return out


def _padded_data(n=6, t=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (n, t), generator=gen)
    lengths = torch.tensor([t, 9, t, 4, 12, t][:n])
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return CalibrationData.from_tokens(ids, mask)


# ----------------------------------------------------------------------------- naive references
def _reference(path, data, moment_experts=(0, 3), block_override=None):
    """Statistics from a full HF forward: hooks capture each MoE block's input and output; routing from the
    HF router; expert outputs recomputed in float64 from the expert weights and checked to rebuild the block."""
    model = load_model(str(path), dtype="float32")
    adapter = MoEAdapter(model)
    if block_override:
        for i, mod in block_override.items():
            adapter.set_block(i, mod)
    caught = {}
    hooks = [
        adapter.layer(i).block.register_forward_hook(
            lambda m, inp, out, i=i: caught.__setitem__(
                i, (inp[0], out[0] if isinstance(out, tuple) else out)
            )
        )
        for i in adapter.moe_layers
    ]
    with torch.no_grad():
        model(input_ids=data.input_ids, attention_mask=data.attention_mask)
    for h in hooks:
        h.remove()
    valid = data.attention_mask.reshape(-1).bool()
    ref = {}
    for i in adapter.moe_layers:
        if i not in caught:  # an overridden block
            continue
        inp, out = caught[i]
        H = inp.shape[-1]
        x32 = inp.reshape(-1, H)[valid]
        x = x32.double()
        layer = adapter.layer(i)
        spec = layer.spec
        E, k = spec.num_experts, spec.top_k
        with torch.no_grad():
            _, hf_w, hf_i = layer.router(x32)
            w_r, b_r, _ = adapter.router_params(i)
            logits = F.linear(x, w_r.double(), None if b_r is None else b_r.double())
            probs = torch.sigmoid(logits) if spec.scoring == "sigmoid" else torch.softmax(logits, -1)
            experts = [adapter.get_expert(i, e).map(torch.Tensor.double) for e in range(E)]
            mids = [
                layer.act(F.linear(x, w.gate, w.gate_bias), F.linear(x, w.up, w.up_bias)) for w in experts
            ]
            f_all = torch.stack(
                [F.linear(a, w.down, w.down_bias) for a, w in zip(mids, experts)]
            )  # [E, N, H]
            # the reference rebuilds the HF block output: it is faithful to HF, not to our adapter
            rebuilt = sum(
                hf_w[:, s, None].double() * f_all[hf_i[:, s], torch.arange(len(x))] for s in range(k)
            )
            shared = adapter.shared_forward(i, x32)
            if shared is not None:
                rebuilt = rebuilt + shared.double()
            torch.testing.assert_close(rebuilt, out.reshape(-1, H)[valid].double(), atol=2e-5, rtol=1e-4)
        n = len(x)
        r = {"tokens": torch.tensor(n)}
        sel = torch.zeros(n, E, dtype=torch.bool).scatter_(1, hf_i, True)
        gate = torch.zeros(n, E, dtype=torch.float64).scatter_(1, hf_i, hf_w.double())
        cnt = sel.sum(0)
        norms = f_all.norm(dim=-1).T  # [N, E]

        def cmean(v, cnt=cnt):  # mean over routed tokens, 0 for unreached experts
            return torch.where(cnt > 0, v / cnt.clamp(min=1), torch.zeros_like(v))

        r["counts"] = cnt
        r["routing_mass"] = gate.sum(0)
        r["pp"] = probs.mean(0)
        r["cp"] = cmean((probs * sel).sum(0))
        r["reap"] = cmean((gate * norms * sel).sum(0))
        r["ean"] = (norms * sel).sum(0)
        r["out_norm_mean"] = cmean((norms * sel).sum(0))
        r["out_norm_sq_mean"] = cmean((norms**2 * sel).sum(0))
        mean, var, inn, midn = [], [], [], []
        for e in range(E):
            ye = f_all[e][sel[:, e]]
            mean.append(ye.mean(0) if len(ye) else torch.zeros(H, dtype=torch.float64))
            var.append(ye.var(0, unbiased=False) if len(ye) else torch.zeros(H, dtype=torch.float64))
            inn.append(x[sel[:, e]].norm(dim=0))
            midn.append(mids[e][sel[:, e]].norm(dim=0))
        r["out_mean"], r["out_var"] = torch.stack(mean), torch.stack(var)
        r["in_channel_norm"], r["mid_channel_norm"] = torch.stack(inn), torch.stack(midn)
        r["gram"] = torch.einsum("anh,bnh->ab", f_all, f_all) / n
        r["out_mean_all"] = f_all.mean(1)
        r["router_logit_corr"] = torch.corrcoef(logits.T)
        r["router_logit_mean"] = logits.mean(0)
        S = list(moment_experts)
        r["moment_experts"] = torch.tensor(S)
        r["moment_count"] = cnt[S]
        r["moment_in_mean"] = torch.stack([x[sel[:, e]].mean(0) for e in S])
        r["moment_out_mean"] = torch.stack([f_all[e][sel[:, e]].mean(0) for e in S])
        r["input_moment"] = torch.stack([x[sel[:, e]].T @ x[sel[:, e]] / cnt[e] for e in S])
        r["cross_moment"] = torch.stack([x[sel[:, e]].T @ f_all[e][sel[:, e]] / cnt[e] for e in S])
        ref[i] = r
    return ref


def _assert_stats_equal(store, ref, layers=None):
    for i in layers or store.layers:
        for name, want in ref[i].items():
            got = store.get(i, name)
            assert got.shape == want.shape, (i, name)
            if not want.is_floating_point():
                assert torch.equal(got.long(), want.long()), (i, name)
            else:
                # the [S, H, H] moments are float32 sums (docs/calibration.md); everything else float64
                assert got.dtype == (
                    torch.float32 if name in ("input_moment", "cross_moment") else torch.float64
                ), name
                got = got.double()
                torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-4, msg=f"layer {i} {name}")


@pytest.mark.parametrize("family", STAT_FAMILIES)
def test_every_statistic_equals_a_naive_reference(models, family, tmp_path):
    data = _padded_data()
    store = calibrate(
        str(models[family]),
        data,
        out=tmp_path / "s",
        stats=ALL_STATS,
        batch_size=4,
        moment_experts=[0, 3],
        progress=False,
    )
    ref = _reference(models[family], data)
    assert store.layers == sorted(ref)
    assert set(store.names) == set(ALL_STATS)
    _assert_stats_equal(store, ref)
    assert store.token_count == data.num_tokens  # padding never counts
    assert int(store.get(store.layers[0], "tokens")) == data.num_tokens


def test_trained_fixture_from_text(tmp_path):
    from moecompress.data import load_calibration, load_tokenizer
    from moecompress.testing import fixture_dir

    path = fixture_dir("qwen3-moe-tiny")
    if not (path / "model.safetensors").is_file():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    data = load_calibration("fixture-heldout:4", load_tokenizer(str(path)), 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreachedExpertsWarning)  # 256 tokens leave some of 16 experts idle
        # the fixture is stored in bf16: calibrate upcast, to compare with the float32 HF forward of _reference
        store = calibrate(
            str(path),
            "fixture-heldout:4",
            seq_len=64,
            out=tmp_path / "s",
            stats=["reap", "out_var"],
            dtype="float32",
            progress=False,
        )
    assert store.token_count == 256 and "fixture corpus" in store.describe()
    ref = _reference(path, data)
    _assert_stats_equal(
        store, {i: {k: ref[i][k] for k in ("counts", "pp", "cp", "reap", "out_var")} for i in ref}
    )


def test_routing_only_path_hooks_the_hf_block(models, tmp_path):
    data = _padded_data(seed=3)
    store = calibrate(str(models["olmoe"]), data, out=tmp_path / "s", batch_size=2, progress=False)
    ref = _reference(models["olmoe"], data)
    assert set(store.names) == {"counts", "tokens", "routing_mass", "pp", "cp"}
    _assert_stats_equal(store, {i: {k: ref[i][k] for k in store.names} for i in ref})


# ----------------------------------------------------------------------------- runner == full forward
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_runner_hidden_states_equal_full_forward(models, family):
    data = _padded_data(seed=1)
    model = load_model(str(models[family]), dtype="float32")
    with torch.no_grad():
        hs = model(input_ids=data.input_ids, attention_mask=data.attention_mask, output_hidden_states=True)
    caught = {}
    layers = MoEAdapter(model).decoder_layers
    hooks = [
        l.register_forward_hook(lambda m, i, o, j=j: caught.__setitem__(j, o)) for j, l in enumerate(layers)
    ]
    with torch.no_grad():
        model(input_ids=data.input_ids, attention_mask=data.attention_mask)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(caught[0], hs.hidden_states[1], atol=0, rtol=0)

    reader = CheckpointReader(str(models[family]))
    runner = SequentialRunner(reader, data, "cpu", None, batch_size=4)
    outs = {}
    runner.embed()
    valid = data.attention_mask.bool()
    for i in range(reader.num_layers):
        layer = runner.load_layer(i)
        obs = None
        if i in runner.adapter.moe_layers and i % 2 == 1:  # also exercise the output-sharing block stand-in
            from moecompress.calibrate.collectors import ReapCollector

            obs = LayerObserver(runner.adapter, i, [ReapCollector(runner.adapter, i)])
            obs.attach()
        runner.run_layer(
            i, layer, observer=obs, on_output=lambda j, b, o: outs.setdefault(j, {}).__setitem__(b, o.clone())
        )
        if obs:
            obs.detach()
        runner.commit(i)
        runner.free_layer(i)
        got = torch.cat([outs[i][b] for b in sorted(outs[i])])
        torch.testing.assert_close(got[valid], caught[i][valid], atol=1e-5, rtol=1e-5, msg=f"layer {i}")
    assert all(p.is_meta for p in runner.model.parameters())  # everything was freed


# ----------------------------------------------------------------------------- resume
def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family, offload", [("deepseek_v2", False), ("qwen3_moe", True)])
def test_kill_and_resume_is_byte_identical(models, tmp_path, family, offload):
    data = _padded_data(seed=2)
    kw = {"stats": ["reap", "out_mean", "gram", "router_logit_corr"], "batch_size": 2, "progress": False}
    full = calibrate(str(models[family]), data, out=tmp_path / "full", **kw)
    first = full.layers[0]

    def kill(i, stats):
        if i == first:
            raise KeyboardInterrupt("simulated kill")

    off = {"offload_dir": tmp_path / "off"} if offload else {}
    with pytest.raises(KeyboardInterrupt):
        calibrate(str(models[family]), data, out=tmp_path / "resumed", on_layer_end=kill, **off, **kw)
    assert not (tmp_path / "resumed").exists() and (tmp_path / ".resumed.partial").is_dir()
    seen = []
    resumed = calibrate(
        str(models[family]),
        data,
        out=tmp_path / "resumed",
        resume=True,
        on_layer_end=lambda i, s: seen.append(i),
        **off,
        **kw,
    )
    assert first not in seen and seen  # finished layers were not recomputed
    assert _files(resumed.path) == _files(full.path)
    assert not (tmp_path / ".resumed.partial").exists()


def test_resume_after_the_last_layer_only_writes_the_store(models, tmp_path):
    data = _padded_data(seed=2)
    full = calibrate(str(models["olmoe"]), data, out=tmp_path / "full", progress=False)

    def kill(i, stats):
        if i == full.layers[-1]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(str(models["olmoe"]), data, out=tmp_path / "r", on_layer_end=kill, progress=False)
    seen = []
    resumed = calibrate(
        str(models["olmoe"]),
        data,
        out=tmp_path / "r",
        resume=True,
        on_layer_end=lambda i, s: seen.append(i),
        progress=False,
    )
    assert seen == [] and _files(resumed.path) == _files(full.path)


def test_resume_refuses_a_partial_run_of_another_model(models, tmp_path):
    data = _padded_data()

    def kill(i, stats):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(str(models["olmoe"]), data, out=tmp_path / "s", on_layer_end=kill, progress=False)
    with pytest.raises(MoECompressError, match="interrupted run .* another model"):
        calibrate(str(models["qwen3_moe"]), data, out=tmp_path / "s", resume=True, progress=False)


# ----------------------------------------------------------------------------- store identity
def test_store_reuse_and_refusal(models, tmp_path):
    data = _padded_data()
    out = tmp_path / "s"
    a = calibrate(str(models["olmoe"]), data, out=out, stats="reap", progress=False)
    again = calibrate(
        str(models["olmoe"]), data, out=out, stats="reap", progress=False
    )  # reused, not recomputed
    assert again.meta == a.meta
    with pytest.raises(MoECompressError, match="another model"):
        calibrate(str(models["mixtral"]), data, out=out, progress=False)
    with pytest.raises(MoECompressError, match="lacks gram"):
        calibrate(str(models["olmoe"]), data, out=out, stats="gram", progress=False)
    with pytest.raises(MoECompressError, match="another model"):
        StatsStore.load(out, model_fingerprint=CheckpointReader(str(models["mixtral"])).fingerprint())
    with pytest.raises(MoECompressError, match="computed on data"):
        StatsStore.load(out, data_spec="c4:128")
    with pytest.raises(MoECompressError, match="lacks 'gram'.*--for-method hc-smoe"):
        a.require("gram", method="hc-smoe")
    with pytest.raises(MoECompressError, match="not a stats store"):
        StatsStore.load(tmp_path)
    meta = json.loads((out / "stats.json").read_text())
    assert meta["data"]["tokens"] == data.num_tokens and meta["model"]["moe_layers"] == a.layers
    assert set(meta["versions"]) >= {"torch", "transformers", "moecompress"}
    assert "tokens" in a.describe()


# ----------------------------------------------------------------------------- transform callback
class _Zero(nn.Module):
    def __init__(self, tuple_out=False):
        super().__init__()
        self.tuple_out = tuple_out

    def forward(self, h):
        return (torch.zeros_like(h), None) if self.tuple_out else torch.zeros_like(h)


def test_transform_feeds_later_layers_compressed_outputs(models, tmp_path):
    data = _padded_data()
    path = models["qwen3_moe"]
    calls = []

    def transform(i, layer, adapter, stats):
        calls.append((i, stats is not None))
        if i == 0:
            adapter.set_block(0, _Zero())
            return layer
        return None

    store = calibrate(
        str(path), data, out=tmp_path / "s", stats=["reap"], transform=transform, progress=False
    )
    assert calls == [(0, True), (1, True)]
    plain = _reference(path, data)
    compressed = _reference(path, data, block_override={0: _Zero()})
    _assert_stats_equal(
        store, {0: {k: plain[0][k] for k in ("counts", "reap")}}, layers=[0]
    )  # original experts
    _assert_stats_equal(store, {1: {k: compressed[1][k] for k in ("counts", "reap", "pp")}}, layers=[1])


# ----------------------------------------------------------------------------- warnings, registry, dry run
def test_unreached_experts_warn_once_and_stay_finite(models, tmp_path):
    data = CalibrationData.from_tokens(torch.tensor([[5, 6]]))  # 2 tokens x top-2 < 8 experts
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        store = calibrate(str(models["qwen3_moe"]), data, out=tmp_path / "s", stats=ALL_STATS, progress=False)
    ours = [x for x in w if issubclass(x.category, UnreachedExpertsWarning)]
    assert len(ours) == 1 and "layer 0: experts [" in str(ours[0].message)
    for i in store.layers:
        unreached = torch.nonzero(store.get(i, "counts") == 0).flatten()
        assert len(unreached) >= 4 and store.unreached()[i] == unreached.tolist()
        for name in store.names:
            t = store.get(i, name)
            assert not t.is_floating_point() or bool(torch.isfinite(t).all()), name
        assert bool((store.get(i, "cp")[unreached] == 0).all()) and bool(
            (store.get(i, "reap")[unreached] == 0).all()
        )


def test_method_registry():
    assert "reap" in stats_for_method("reap") and "out_mean_all" in stats_for_method("hc-smoe")
    assert "gram" not in stats_for_method("hc-smoe")  # what HC-SMoE reads, from its registration (issue 34)
    register_method_stats("my-test-method", ["counts"])
    register_method_stats("my-test-method", ["ean"])
    assert stats_for_method("my-test-method") == ("counts", "ean")
    with pytest.raises(MoECompressError, match="Unknown method"):
        stats_for_method("nope")
    with pytest.raises(ValueError):
        register_method_stats("x", ["not-a-stat"])


def test_dry_run_estimates_and_refuses(models, tmp_path, monkeypatch):
    data = _padded_data()
    est = calibrate(
        str(models["qwen3_moe"]), data, out=tmp_path / "s", stats="gram", dry_run=True, progress=False
    )
    assert est.fits and est.time_s > 0 and est.probe["batch_s_observed"] > 0
    assert est.activation_cache_bytes == 6 * 16 * 32 * 4 and est.layer_bytes > 0 and est.stats_bytes > 0
    assert not (tmp_path / "s").exists()
    import psutil

    class Tiny:
        available = 1

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: type("M", (), {"rss": 1})())
    with pytest.raises(MoECompressError, match="needs about .* of memory but only"):
        calibrate(str(models["qwen3_moe"]), data, out=tmp_path / "s", progress=False)


def test_bad_data_inputs_give_sentences(models, tmp_path, monkeypatch):
    path = str(models["olmoe"])
    empty = tmp_path / "e.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    cases = [
        (str(empty), "is empty"),
        ("+", "names no dataset"),
        (f"{short}:2", "fewer than the 2 sequences"),
        ("c4:8", "unreachable"),
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec, msg in cases:
        with pytest.raises(MoECompressError, match=msg):
            calibrate(path, spec, seq_len=32, out=tmp_path / "s", progress=False)
    with pytest.raises(MoECompressError, match="Unknown statistic"):
        calibrate(path, str(short), seq_len=4, out=tmp_path / "s", stats="nope", progress=False)


# ----------------------------------------------------------------------------- CLI
def test_cli_calibrate_and_dry_run(models, tmp_path, capsys):
    from moecompress.cli import main

    out = tmp_path / "s"
    text = tmp_path / "t.txt"
    text.write_text("Calibration text for the command line test. " * 20)
    main(
        [
            "calibrate",
            str(models["mixtral"]),
            "--data",
            f"{text}:4",
            "--seq-len",
            "32",
            "--out",
            str(out),
            "--for-method",
            "mone",
            "--batch-size",
            "2",
        ]
    )
    store = StatsStore.load(out)
    assert {"out_mean", "out_var", "counts"} <= set(store.names) and store.token_count == 128
    capsys.readouterr()
    main(
        [
            "calibrate",
            str(models["mixtral"]),
            "--data",
            f"{text}:4",
            "--seq-len",
            "32",
            "--out",
            str(tmp_path / "d"),
            "--dry-run",
            "--json",
        ]
    )
    est = json.loads(capsys.readouterr().out)
    assert est["fits"] and est["time_s"] > 0 and est["peak_memory_bytes"] > 0
    assert not (tmp_path / "d").exists()
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", str(models["mixtral"]), "--data", "nothing-here:3", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "Unknown dataset 'nothing-here'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- multi-process
_SCRIPT = textwrap.dedent("""
    import sys, torch
    from moecompress.calibrate import calibrate
    from moecompress.data import CalibrationData
    ids = torch.load(sys.argv[3], weights_only=True)
    data = CalibrationData.from_tokens(ids["ids"], ids["mask"])
    calibrate(sys.argv[1], data, out=sys.argv[2], stats=["reap", "out_var", "gram", "router_logit_corr"],
              batch_size=2, progress=False)
""")


def test_torchrun_two_processes_equal_one(models, tmp_path):
    data = _padded_data(seed=5)
    torch.save({"ids": data.input_ids, "mask": data.attention_mask}, tmp_path / "data.pt")
    (tmp_path / "run.py").write_text(_SCRIPT)
    path = str(models["deepseek_v2"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float32 kernels as each worker: only the float64 sum order differs
    try:
        single = calibrate(
            path,
            data,
            out=tmp_path / "one",
            stats=["reap", "out_var", "gram", "router_logit_corr"],
            batch_size=2,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            str(tmp_path / "run.py"),
            path,
            str(tmp_path / "two"),
            str(tmp_path / "data.pt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = StatsStore.load(tmp_path / "two")
    assert two.layers == single.layers and two.names == single.names
    for i in single.layers:
        for n in single.names:
            a, b = single.get(i, n), two.get(i, n)
            if a.is_floating_point():
                torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
            else:
                assert torch.equal(a, b), n
    assert two.token_count == single.token_count
    print(f"torchrun took {time.time() - t0:.1f}s")


def test_calibrate_keywords_are_the_options():
    """`calibrate(...)` is a thin wrapper: its keywords (the CLI's and the public API's) are `CalibrationOptions`'s
    fields with the same defaults, so the two cannot drift apart."""
    import dataclasses
    import inspect

    from moecompress.calibrate import CalibrationOptions, calibrate

    params = list(inspect.signature(calibrate).parameters.values())[2:]  # after model, data
    fields = dataclasses.fields(CalibrationOptions)
    assert [p.name for p in params] == [f.name for f in fields]
    assert all(p.default == f.default for p, f in zip(params, fields))


def test_finished_layers_statistics_are_not_kept_in_memory(models, tmp_path):
    """A layer's statistics live in its file once saved: the run keeps no copy of earlier layers (with input/cross
    moments of every expert that copy was E·H² float64 values per layer, all layers at once)."""
    import gc
    import weakref

    data = _padded_data()
    refs, alive = {}, {}

    def on_end(i, stats):
        if stats is None:
            return
        gc.collect()
        alive[i] = [j for j, r in refs.items() if r() is not None]  # earlier layers' moments still reachable
        refs[i] = weakref.ref(stats["input_moment"])

    store = calibrate(
        str(models["qwen3_moe"]),
        data,
        out=tmp_path / "s",
        stats=["input_moment", "cross_moment"],
        batch_size=4,
        progress=False,
        on_layer_end=on_end,
    )
    layers = store.layers
    assert len(layers) >= 2 and sorted(alive) == layers
    assert all(not earlier for earlier in alive.values()), alive  # none, from the second layer on
    meta = json.loads((store.path / "stats.json").read_text())
    assert meta["shapes"]["input_moment"] == list(store.get(layers[0], "input_moment").shape)


def test_all_finite_decides_by_the_sum_and_falls_back_on_overflow():
    from moecompress.calibrate.layer_pass import _all_finite

    assert _all_finite(torch.ones(4, 4))
    assert not _all_finite(torch.tensor([1.0, float("nan"), 2.0]))
    assert not _all_finite(torch.tensor([float("inf"), float("-inf")]))  # the sum is NaN
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    assert not bool(torch.isfinite(big.sum())) and _all_finite(big)
