"""Untrusted files, round three (issue 51, items 6-9 and 11): model identity is every byte, rich markup in user
text is printed as text, crafted JSON and configs are refused within limits, and the medium messages.

Policy (docs/architecture.md, "Bad input"): exit 2 with one `error:` sentence, no traceback, nothing of the
user's touched (`assert_refused`). Cases run in-process (`run_cli`) on a copy of the qwen3-moe-tiny fixture with
one tiny store and one compact export, built once per module.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moecompress.atomic import MARKER
from moecompress.testing import assert_refused, fixture_dir, run_cli

Q = fixture_dir("qwen3-moe-tiny")
PRUNE = ["--method", "prune", "--criterion", "frequency", "--ratio", "0.5"]
PPL = ["--ppl", "fixture-heldout", "--max-tokens", "32", "--window", "16"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(file: Path, pick, change) -> None:
    """Change one tensor of a safetensors file in place (a user replacing weights between two runs)."""
    tensors = load_file(str(file))
    key = next(k for k in sorted(tensors) if pick(k))
    tensors[key] = change(tensors[key].clone())
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_json(file: Path, change) -> None:
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


def _error_line(err: str) -> str:
    """The one `error:` line, last on stderr (transformers' "Loading weights" bars may come before it)."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A copy of the fixture (`m`), a store of it (`s`), a compact export (`exp`); ~10 s."""
    import moecompress

    root = tmp_path_factory.mktemp("untrusted")
    m = _copy(Q, root / "m")
    with warnings.catch_warnings():  # 2 short sequences leave some experts unreached; expected here
        warnings.simplefilter("ignore")
        moecompress.calibrate(
            str(m), "fixture-calib:2", seq_len=16, out=root / "s", for_method="frequency", progress=False
        )
        moecompress.compress(
            str(m),
            "prune",
            {"criterion": "frequency", "ratio": 0.5},
            calib=root / "s",
            out=root / "exp",
            format="compact",
            progress=False,
        )
    return root


# ----------------------------------------------------------------------------- items 6, 7: model identity


def test_the_fingerprint_changes_with_any_tensor_byte(tmp_path):
    """The sampled fingerprint read 4 x 64 KiB per shard; one changed value anywhere now changes it."""
    from moecompress.checkpoint import checkpoint_fingerprint, legacy_fingerprint

    m = _copy(Q, tmp_path / "m")
    before = checkpoint_fingerprint(m)
    assert before.startswith("sha256-full/1:") and not legacy_fingerprint(before)
    assert checkpoint_fingerprint(m) == before  # stable
    _edit(
        m / "model.safetensors",
        lambda k: "layers.2.mlp.experts" in k,
        lambda t: t.index_fill_(0, torch.tensor([1]), 0.5),
    )
    assert checkpoint_fingerprint(m) != before
    assert legacy_fingerprint("ab" * 32)


def test_compress_refuses_a_store_of_other_weights(ws, tmp_path, capsys):
    """Item 7: a store made from the model before its embeddings were doubled was accepted."""
    m2 = _copy(ws / "m", tmp_path / "m2")
    _edit(m2 / "model.safetensors", lambda k: k.endswith("embed_tokens.weight"), lambda t: t * 2)
    line = assert_refused(
        ["compress", str(m2), *PRUNE, "--calib", str(ws / "s"), "--out", str(tmp_path / "c")],
        capsys,
        "other weights of it",
        [ws, tmp_path],
    )
    assert str(ws / "s") in line


def test_calibrate_resume_refuses_changed_weights(ws, tmp_path, capsys):
    """Item 7: `calibrate --resume` kept layers 0-1 of the old weights and computed 2-3 from the new ones."""
    import moecompress

    m = _copy(ws / "m", tmp_path / "m")

    def kill(i, stats):
        if i == 1:
            raise KeyboardInterrupt

    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        moecompress.calibrate(
            str(m), "fixture-calib:2", seq_len=16, out=tmp_path / "s", for_method="frequency",
            on_layer_end=kill, progress=False,
        )  # fmt: skip
    assert (tmp_path / ".s.partial" / "layer_0001.safetensors").is_file()
    _edit(m / "model.safetensors", lambda k: "layers.3.mlp.experts" in k, lambda t: t + 0.01)
    args = ["--data", "fixture-calib:2", "--seq-len", "16", "--for-method", "frequency", "--resume"]
    assert_refused(
        ["calibrate", str(m), *args, "--out", str(tmp_path / "s")],
        capsys,
        "made with another model or other weights of it",
        [tmp_path],
    )


def test_compare_resume_refuses_changed_weights(ws, tmp_path, capsys):
    """Item 6: `compare --resume` reported 3 arms of the old weights beside 2 of the new ones, exit 0."""
    from moecompress.compare import _identity, with_quant_baselines
    from moecompress.compare.journal import ArmJournal
    from moecompress.recipe import load_recipe

    m = _copy(ws / "m", tmp_path / "m")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {m}\ncalibration: {{data: 'fixture-calib:2', seq_len: 16}}\n"
        "arms:\n  - {method: prune, params: {criterion: frequency, ratio: 0.5}}\n"
    )
    out = tmp_path / "c"
    # what an interrupted run leaves: the journal with its identity and one finished arm
    journal = ArmJournal(out, _identity(with_quant_baselines(load_recipe(recipe)), str(m), True))
    journal.start(resume=False)
    journal.save({"name": "original", "metrics": {}})
    _edit(m / "model.safetensors", lambda k: "layers.0.self_attn.q_proj" in k, lambda t: t * 1.01)
    assert_refused(
        ["compare", str(recipe), "--out", str(out), "--resume"],
        capsys,
        "made from other weights of the model",
        [tmp_path],
    )


def test_a_store_with_the_old_sampled_fingerprint_is_refused(ws, tmp_path, capsys):
    s = _copy(ws / "s", tmp_path / "s")
    _edit_json(s / "stats.json", lambda d: {**d, "model": {**d["model"], "fingerprint": "ab" * 32}})
    assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(s), "--out", str(tmp_path / "c")],
        capsys,
        "by an earlier moecompress (its model fingerprint sampled the weights",
        [ws, tmp_path],
    )


def test_swapped_layer_files_are_refused(ws, tmp_path, capsys):
    s = _copy(ws / "s", tmp_path / "s")
    a, b = s / "layer_0000.safetensors", s / "layer_0001.safetensors"
    a.rename(s / "tmp")
    b.rename(a)
    (s / "tmp").rename(b)
    assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(s), "--out", str(tmp_path / "c")],
        capsys,
        "holds the statistics of layer 1, not 0",
        [ws, tmp_path],
    )


# ----------------------------------------------------------------------------- item 8: rich markup


@pytest.mark.parametrize("name", ["res[/x]", "r[bold red]x[v2]"])
def test_markup_in_an_output_path_is_printed_verbatim(ws, tmp_path, capsys, monkeypatch, name):
    """`--out 'res[/]'` exported, then printing its path raised MarkupError (exit 1); `[v2]` vanished."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(ws / "s"), "--out", name], capsys
    )
    assert code == 0, err
    assert "Traceback" not in err
    assert f"checkpoint at {name}:" in out.replace("\n", " ")
    assert (tmp_path / name / MARKER).is_file()


def test_markup_in_an_error_message_is_printed_verbatim(tmp_path, capsys):
    line = assert_refused(
        ["inspect", str(tmp_path / "n[/x]o[bold red]pe")], capsys, "n[/x]o[bold red]pe", [tmp_path]
    )
    assert line.startswith("error: No model directory")


def test_a_huge_value_is_cut_in_the_one_sentence(ws, capsys, tmp_path):
    """A 300 KB value came back whole as the "one sentence"."""
    huge = "x" * 300_000
    line = assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--quant-scope", huge, "--out", str(tmp_path / "c")],
        capsys,
        "--quant-scope",
        [tmp_path],
    )
    assert len(line) < 2500 and "…" in line and line.endswith("use experts or all.")


# ----------------------------------------------------------------------------- item 9: crafted files


@pytest.mark.parametrize(
    ("file", "text", "fragment"),
    [
        ("plan.json", "[" * 200_000 + "]" * 200_000, "nests its JSON too deeply"),
        ("plan.json", '{"schema_version": ' + "9" * 5000 + "}", "a number of more than 64 digits"),
        ("base_config.json", None, "sets hidden_size to 1000000000"),
    ],
    ids=["plan-deep", "plan-5000-digits", "base-config-hidden-1e9"],
)
def test_crafted_export_files_are_one_sentence(ws, tmp_path, capsys, file, text, fragment):
    exp = _copy(ws / "exp", tmp_path / "exp")
    if text is None:
        _edit_json(exp / file, lambda d: {**d, "hidden_size": 10**9})  # an 8 TB allocation was attempted
    else:
        (exp / file).write_text(text)
    assert_refused(["eval", str(exp), *PPL], capsys, fragment, [tmp_path])


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"hidden_size": 256}, "says vocab_size 4096 and hidden_size 256, but model.safetensors stores"),
        ({"num_hidden_layers": 40}, "says num_hidden_layers 40, but the weights"),
        ({"moe_intermediate_size": 2**20}, "describes a model of"),
        ({"num_local_experts": 1.5}, "sets num_local_experts to 1.5, not an integer"),
    ],
    ids=["hidden", "layers", "skeleton", "float-count"],
)
def test_config_sizes_are_checked_against_the_weights(tmp_path, capsys, change, fragment):
    """Sizes within bounds but not the weights' are refused before a skeleton allocates from them."""
    m = _copy(Q, tmp_path / "m")
    _edit_json(m / "config.json", lambda d: {**d, **change})
    assert_refused(["inspect", str(m)], capsys, fragment, [tmp_path])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"[]", "does not hold a JSON object"),
        (None, "'model' is missing"),
        (b'{"format": "moecompress-stats/2", "x": "\xff\xfe"}', "is not UTF-8 text"),
        ("stats-null", "'stats' must be a list of statistic names"),
    ],
    ids=["list", "no-model", "not-utf8", "stats-null"],
)
def test_crafted_stats_json_is_one_sentence(ws, tmp_path, capsys, content, fragment):
    """[] (AttributeError), no "model" (KeyError), not UTF-8 (UnicodeDecodeError), "stats": null (TypeError)."""
    s = _copy(ws / "s", tmp_path / "s")
    meta = s / "stats.json"
    if content is None:
        _edit_json(meta, lambda d: {k: v for k, v in d.items() if k != "model"})
    elif content == "stats-null":
        _edit_json(meta, lambda d: {**d, "stats": None})
    else:
        meta.write_bytes(content)
    assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(s), "--out", str(tmp_path / "c")],
        capsys,
        fragment,
        [ws, tmp_path],
    )


def test_a_deeply_nested_config_or_marker_is_one_sentence(ws, tmp_path, capsys):
    m = _copy(Q, tmp_path / "m")
    (m / "config.json").write_text("{" + '"a":{' * 100_000 + "}" * 100_001)
    assert_refused(["inspect", str(m)], capsys, "nests its JSON too deeply", [tmp_path])
    out = tmp_path / "o"
    out.mkdir()
    (out / MARKER).write_text("[" * 200_000 + "]" * 200_000)  # a marker no run of ours wrote
    assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(ws / "s"), "--out", str(out), "--overwrite"],
        capsys,
        "cannot be read",
        [tmp_path],
    )


def test_a_recipe_key_given_twice_is_refused(ws, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {ws / 'm'}\nmethod: prune\nparams:\n  criterion: frequency\n  ratio: 0.25\n  ratio: 0.75\n"
    )
    assert_refused(
        ["compress", str(ws / "m"), "--recipe", str(recipe), "--out", str(tmp_path / "c")],
        capsys,
        "sets 'ratio' twice (line 6)",
        [tmp_path],
    )


# ----------------------------------------------------------------------------- item 11: messages


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_eval_on_cuda_without_cuda_is_one_sentence(ws, capsys):
    assert_refused(["eval", str(ws / "exp"), *PPL, "--device", "cuda"], capsys, "sees no CUDA device", [ws])


def test_eval_names_a_bogus_device(ws, capsys):
    line = assert_refused(
        ["eval", str(ws / "exp"), *PPL, "--device", "bogus"], capsys, "'bogus' is not a device", [ws]
    )
    assert "checkpoint" not in line


def test_kl_against_another_family_is_refused(ws, capsys):
    """The fixtures share a tokenizer, so KL of a qwen3-moe export against olmoe was computed silently."""
    code, _, err = run_cli(["eval", str(ws / "exp"), *PPL, "--reference", "fixture:olmoe-tiny"], capsys)
    assert code == 2
    assert "KL compares the same family" in _error_line(err)


def test_json_without_dry_run_is_refused(ws, tmp_path, capsys):
    assert_refused(
        ["compress", str(ws / "m"), *PRUNE, "--calib", str(ws / "s"), "--json", "--out", str(tmp_path / "c")],
        capsys,
        "add --dry-run or drop --json",
        [tmp_path],
    )


def test_the_stores_seq_len_is_not_called_the_users_seq_len(ws, tmp_path):
    """Re-reading a store's data (GPTQ of non-expert weights, --imatrix) named its seq_len `--seq-len`."""
    from moecompress.calibrate.linear_hessian import _calibration
    from moecompress.errors import MoECompressError

    text = tmp_path / "short.txt"
    text.write_text("a few words of calibration text\n")
    with pytest.raises(MoECompressError, match="this seq_len is the statistics store's"):
        _calibration(str(ws / "m"), {"spec": str(text), "seq_len": 4096, "seed": 0})
