"""`dense` streams its teacher: one decoder layer resident at a time, the same student as the loaded path."""

import pytest
import torch

from moecompress.methods.dense_fit import DenseConfig
from moecompress.testing import fixture_dir


def test_dense_streams_teacher_one_layer_at_a_time_and_matches_loaded_path(tmp_path, monkeypatch):
    from moecompress.checkpoint.view import StreamedAdapter
    from moecompress.distill.dense_export import export_dense
    from moecompress.models import load_model

    path = fixture_dir("olmoe-tiny")
    if not (path / "config.json").is_file():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    resident_at_install: list[int] = []
    install = StreamedAdapter._install

    def spy(self, i, dtype):
        # decoder layers holding real tensors when layer i is brought in: the previous one must be gone
        resident_at_install.append(
            sum(any(not p.is_meta for p in layer.parameters()) for layer in self.decoder_layers)
        )
        install(self, i, dtype)

    monkeypatch.setattr(StreamedAdapter, "_install", spy)
    cfg = DenseConfig(criterion="frequency", grouping="wc", scaling="uniform", mass_scale=True, K=8)
    kw = dict(calib="fixture-calib:4", seq_len=32, progress=False)
    new = export_dense(str(path), tmp_path / "new", cfg, dtype="float32", **kw)
    # one statistics forward, one conversion pass, one copy pass: each layer read exactly three times
    assert new["teacher_layer_loads"] == {0: 3, 1: 3, 2: 3, 3: 3}
    assert len(resident_at_install) == 12 and max(resident_at_install) == 0
    old = export_dense(
        load_model(str(path), dtype="float32"), tmp_path / "old", cfg, tokenizer_source=str(path), **kw
    )
    assert "teacher_layer_loads" not in old
    for name in ("model.safetensors", "config.json", "dense_plan.json"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name


def test_dense_auto_dtype_is_the_checkpoints(tmp_path):
    from safetensors import safe_open

    from moecompress.distill.dense_export import export_dense

    path = fixture_dir("qwen3-moe-tiny")
    if not (path / "config.json").is_file():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    from moecompress.data import load_tokenizer
    from moecompress.distill.dense_export import load_stats, teacher_view

    view = teacher_view(str(path))
    assert view.compute_dtype == torch.bfloat16  # the fixture is stored in bf16
    stats, _ = load_stats(
        "fixture-calib:4", view.model, load_tokenizer(str(path)), seq_len=32, progress=False
    )
    s = export_dense(str(path), tmp_path / "d", DenseConfig(), calib=stats, progress=False)
    assert s["teacher_layer_loads"] == {0: 2, 1: 2, 2: 2, 3: 2}  # given statistics: no forward
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
