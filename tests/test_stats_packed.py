"""Stats store format 2 (issue 32 item 4): symmetric statistics (the GPTQ Hessians, input moments) kept as upper
triangles, read back whole bit for bit, GPTQ's codes unchanged, about half the bytes on disk; format 1 stores
still read; `compress --dry-run` reports the statistics' disk and memory streamed and kept, for Qwen3-30B-A3B's
config without weights."""

import json
import shutil
import warnings

import pytest
import torch

from moecompress.calibrate import StatsStore, calibrate
from moecompress.calibrate.symmetric import pack, packed_size, unpack
from moecompress.disk import read_header, write_tensors
from moecompress.errors import MoECompressError
from moecompress.models import resolve_source
from moecompress.testing import run_cli
from moecompress.workflows import pipeline

MODEL = "fixture:olmoe-tiny"
SPEC, SEQ = "fixture-calib:4", 32
SYMMETRIC = ["hessian_in", "hessian_mid", "hessian_in_g2", "hessian_mid_g2", "input_moment"]
QUANT = {"quant": "w3g64"}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A format 2 store of the symmetric statistics (and what calibration computed, before writing), and a
    format 1 copy written the old way: every tensor whole, no `packed` metadata."""
    root = tmp_path_factory.mktemp("packed")
    model = str(resolve_source(MODEL))
    computed = {}
    with warnings.catch_warnings():  # 4 short sequences leave a few experts unreached; expected here
        warnings.simplefilter("ignore")
        store = calibrate(
            model,
            SPEC,
            seq_len=SEQ,
            out=root / "new",
            progress=False,
            stats=sorted(set(SYMMETRIC) | set(pipeline.needs_for("quant", QUANT))),
            on_layer_end=lambda i, s: computed.__setitem__(i, {k: v.clone() for k, v in s.items()}),
        )
    old = root / "old"
    old.mkdir()
    for i in store.layers:
        write_tensors(
            old / f"layer_{i:04d}.safetensors", computed[i], metadata={"format": "moecompress-stats/1"}
        )
    meta = {k: v for k, v in store.meta.items() if k not in ("packed", "packing")}
    (old / "stats.json").write_text(json.dumps({**meta, "format": "moecompress-stats/1"}))
    return root, model, store, computed, StatsStore.load(old)


def test_symmetric_statistics_round_trip_bit_identical(packed):
    _, _, store, computed, _ = packed
    assert store.meta["format"] == "moecompress-stats/2" and sorted(store.meta["packed"]) == sorted(SYMMETRIC)
    for i in store.layers:
        for name, t in computed[i].items():
            got = store.get(i, name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (i, name)
        for name in SYMMETRIC:
            t = computed[i][name]
            assert torch.equal(t, t.transpose(1, 2))
            assert torch.equal(store.get_row(i, name, 3), t[3]) and torch.equal(
                store.get_rows(i, name, [5, 0]), t[[5, 0]]
            )
    d = torch.randn(3, 7, 7, dtype=torch.float64)
    d = d + d.transpose(1, 2)
    assert pack(d).shape == (3, packed_size(7)) and torch.equal(unpack(pack(d)), d)


def test_symmetric_statistics_take_about_half_the_bytes_on_disk(packed):
    _, _, store, computed, old = packed
    for i in store.layers:
        new_h, old_h = read_header(store._file(i)), read_header(old._file(i))
        size = lambda h, n: h[n]["data_offsets"][1] - h[n]["data_offsets"][0]
        for name in SYMMETRIC:
            E, D, _ = computed[i][name].shape
            assert size(old_h, name) == E * D * D * 4  # float32, whole
            assert size(new_h, name) == E * packed_size(D) * 4 <= 0.55 * size(old_h, name), name
        total = sum(size(new_h, n) for n in SYMMETRIC) / sum(size(old_h, n) for n in SYMMETRIC)
        assert total <= 0.55
        assert size(new_h, "cross_moment") == size(old_h, "cross_moment")  # not symmetric: whole


def test_a_format_1_store_reads_alike_and_gptq_codes_are_unchanged(packed):
    root, model, store, _, old = packed
    for i in store.layers:
        for name in store.names:
            assert torch.equal(old.get(i, name), store.get(i, name)), (i, name)
    a, a_tensors = pipeline.make_plan(model, "quant", QUANT, old)
    b, b_tensors = pipeline.make_plan(model, "quant", QUANT, store)
    assert a.model_dump() == b.model_dump() and sorted(a_tensors) == sorted(b_tensors)
    assert all(torch.equal(a_tensors[k], b_tensors[k]) for k in a_tensors)
    unknown = shutil.copytree(store.path, root / "future")
    meta = json.loads((unknown / "stats.json").read_text())
    (unknown / "stats.json").write_text(json.dumps({**meta, "format": "moecompress-stats/9"}))
    with pytest.raises(
        MoECompressError, match=r"format 'moecompress-stats/9', which this version .* does not read"
    ):
        StatsStore.load(unknown)


# Qwen/Qwen3-30B-A3B's config.json, sizes as published
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "dtype": "bfloat16",
}


def test_dry_run_reports_the_statistics_disk_each_way_for_qwen3_30b_a3b(tmp_path, capsys):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(**QWEN3_30B_A3B).save_pretrained(
        tmp_path / "qwen3-30b-a3b"
    )  # config.json alone, no weights
    base = [
        "compress",
        str(tmp_path / "qwen3-30b-a3b"),
        "--calib",
        "c4:128",
        "--seq-len",
        "2048",
        "--out",
        str(tmp_path / "out"),
        "--dry-run",
        "--max-memory",
        "100TB",
    ]
    L, E, H, I = 48, 128, 2048, 768
    code, stdout, err = run_cli(base + ["--method", "quant", "--quant", "w4g128", "--json"], capsys)
    assert code == 0, err
    q = json.loads(stdout)
    assert q["config_only"] and q["time_s"] is None and q["stats_streamed"]
    assert 30.4e9 * 2 < q["checkpoint_bytes"] < 30.6e9 * 2  # 30.5 B parameters in bfloat16
    assert q["stats_streamed_disk_bytes"] == 0 and q["disk_bytes"] == q["checkpoint_bytes"]
    full = L * E * (H * H + I * I) * 4  # hessian_in + hessian_mid, float32, whole: ~118 GB
    halved = L * E * (packed_size(H) + packed_size(I)) * 4
    routing = q["stats_kept_full_bytes"] - full  # counts, tokens: a few KB
    assert 0 <= routing < 1e6 and q["stats_kept_disk_bytes"] == halved + routing
    assert 0.45 < q["stats_kept_disk_bytes"] / q["stats_kept_full_bytes"] <= 0.55
    from moecompress.calibrate import streamed
    from moecompress.methods.registry import get_method

    CHUNK = get_method("quant").streamed_chunk or streamed.CHUNK

    # a chunk of experts' float64 sums, twice: not the layer's E of them
    chunk = 2 * CHUNK * (H * H + I * I) * 8
    assert chunk <= q["stats_streamed_memory_bytes"] < chunk + 2 * E * (H * H + I * I) * 8 / 16
    code, stdout, err = run_cli(base + ["--method", "quant", "--quant", "w4g128"], capsys)
    text = " ".join(stdout.split())  # rich wraps at the terminal's width
    assert code == 0 and "statistics streamed (--calib a data spec; this run): 0 B on disk" in text, err
    assert "statistics kept as a store" in text and "as full matrices" in text
    code, stdout, err = run_cli(base + ["--method", "auto", "--budget", "25%", "--json"], capsys)
    assert code == 0, err
    a = json.loads(stdout)
    assert a["stats_streamed_disk_bytes"] == 0 and a["disk_bytes"] == a["checkpoint_bytes"]
    assert a["stats_streamed_memory_bytes"] < a["stats_kept_memory_bytes"]  # a chunk of experts' square rows
    assert a["stats_kept_full_bytes"] > a["stats_kept_disk_bytes"] > q["stats_kept_disk_bytes"]
