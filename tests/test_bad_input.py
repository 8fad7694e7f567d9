"""The bad-input matrix: every verb, every repro of issue 15, one sentence, exit 2, nothing lost.

Each case runs in-process (`run_cli`) from a working directory inside a temporary tree, and the
whole tree (plus the shipped fixtures) is snapshotted before and after: a bad input may neither
create nor remove nor change a file. Most cases fail before any model is loaded.
"""

from __future__ import annotations

import shutil
import warnings

import pytest

from moecompress.atomic import MARKER
from moecompress.testing import assert_refused, fixture_dir, run_cli

F = fixture_dir("olmoe-tiny")
Q = fixture_dir("qwen3-moe-tiny")
CAL = ["--calib", "fixture-calib:4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """root/{w (cwd), s (stats store of F), other (not ours), prev (an earlier report), afile.txt, empty,
    corrupt (F with truncated weights), recipes}."""
    from moecompress.calibrate import calibrate

    root = tmp_path_factory.mktemp("bad")
    (root / "w").mkdir()
    (root / "w" / "keep.txt").write_text("mine\n")
    with warnings.catch_warnings():  # 4 short sequences leave some experts unreached; expected here
        warnings.simplefilter("ignore")
        calibrate(str(F), "fixture-calib:4", seq_len=32, out=root / "s", batch_size=8, progress=False)
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("not moecompress's\n")
    (root / "other.json").write_text('{"mine": true}\n')
    (root / "prev").mkdir()
    (root / "prev" / "report.md").write_text("# the previous report\n")
    (root / "prev" / MARKER).write_text('{"kind": "report"}\n')
    (root / "afile.txt").write_text("a file\n")
    (root / "empty").mkdir()
    bad = root / "corrupt"
    bad.mkdir()
    for p in F.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, bad / p.name)
    (bad / "model.safetensors").write_bytes((F / "model.safetensors").read_bytes()[: 1 << 20])
    recipes = {
        "list.yaml": "- a\n",
        "typo.yaml": "method: prune\nparms: {criterion: frequency, ratio: 0.5}\n",
        "escape.yaml": f"model: {F}\nname: ../../escaped\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\n",
        "corrupt.yaml": f"model: {bad}\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\n"
        "eval: {tasks: [], latency: false, quant_baselines: []}\n",
        "notmap.yaml": "42\n",
    }
    for name, text in recipes.items():
        (root / name).write_text(text)
    return root


# (case id, argv with {R}=workspace root, {F}/{Q}=fixtures, expected fragment of the one sentence)
CASES = [
    # --overwrite may only replace what moecompress wrote (issue 15, item 1)
    (
        "compress-out-cwd",
        ["compress", "{F}", "--criterion", "reap", "--ratio", "0.5", *CAL, "--out", ".", "--overwrite"],
        "current directory",
    ),
    (
        "compress-out-ancestor",
        ["compress", "{F}", "--ratio", "0.5", *CAL, "--out", "{R}", "--overwrite"],
        "current directory or one of its ancestors",
    ),
    (
        "compress-out-is-model",
        ["compress", "{R}/corrupt", "--ratio", "0.5", *CAL, "--out", "{R}/corrupt", "--overwrite"],
        "which this run reads",
    ),
    (
        "compress-out-is-store",
        ["compress", "{F}", "--ratio", "0.5", "--calib", "{R}/s", "--out", "{R}/s", "--overwrite"],
        "which this run reads",
    ),
    (
        "compress-out-unmarked",
        ["compress", "{F}", "--ratio", "0.5", *CAL, "--out", "{R}/other", "--overwrite"],
        "not written by moecompress",
    ),
    (
        "compress-out-file",
        ["compress", "{F}", "--ratio", "0.5", *CAL, "--out", "{R}/afile.txt", "--overwrite"],
        "existing file",
    ),
    (
        "compress-out-exists",
        ["compress", "{F}", "--ratio", "0.5", *CAL, "--out", "{R}/prev"],
        "already exists",
    ),
    (
        "compress-out-unwritable",
        ["compress", "{F}", "--ratio", "0.5", *CAL, "--out", "{R}/afile.txt/sub"],
        "not a writable directory",
    ),
    # numeric options are range-checked first
    ("compress-ratio-high", ["compress", "{F}", "--ratio", "1.5", "--out", "x"], "--ratio must be"),
    ("compress-ratio-neg", ["compress", "{F}", "--ratio", "-0.1", "--out", "x"], "--ratio must be"),
    ("compress-ratio-nan", ["compress", "{F}", "--ratio", "nan", "--out", "x"], "--ratio must be"),
    ("compress-ratio-text", ["compress", "{F}", "--ratio", "abc", "--out", "x"], "--ratio"),
    # the range lives in PruneConfig alone (0 is MoNE's constant, which the CLI used to refuse)
    (
        "compress-rank-negative",
        ["compress", "{F}", "--rank", "-1", "--out", "x"],
        "field 'rank' for method 'prune'",
    ),
    # a flag of another method names its owner (issue 49)
    (
        "compress-foreign-flag",
        ["compress", "{F}", "--method", "conmoe", "--rank", "8", "--ratio", "0.5", "--out", "x"],
        "--rank (recipe field 'rank') applies to --method prune, not conmoe",
    ),
    ("compress-seq-len-zero", ["compress", "{F}", "--seq-len", "0", "--out", "x"], "--seq-len must be"),
    (
        "compress-calib-mode-unknown",
        [
            "compress",
            "{F}",
            "--method",
            "quant",
            "--calib",
            "fixture-calib:2",
            "--calib-mode",
            "layerwise",
            "--out",
            "x",
        ],
        "--calib-mode 'layerwise' is not known",
    ),
    (
        "compress-calib-mode-prune",
        [
            "compress",
            "{F}",
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--calib",
            "fixture-calib:2",
            "--calib-mode",
            "sequential",
            "--out",
            "x",
        ],
        "--calib-mode sequential works with --method quant",
    ),
    ("compress-param-no-eq", ["compress", "{F}", "--param", "rank8", "--out", "x"], "is not key=value"),
    ("compress-param-bad-yaml", ["compress", "{F}", "--param", "rank=[", "--out", "x"], "not a YAML"),
    # recipes: one schema (item 5) and safe names (item 6)
    ("compress-recipe-list", ["compress", "{F}", "--recipe", "{R}/list.yaml", "--out", "x"], "YAML mapping"),
    (
        "compress-recipe-scalar",
        ["compress", "{F}", "--recipe", "{R}/notmap.yaml", "--out", "x"],
        "YAML mapping",
    ),
    ("compress-recipe-typo", ["compress", "{F}", "--recipe", "{R}/typo.yaml", "--out", "x"], "parms"),
    (
        "compress-recipe-escape",
        ["compress", "{F}", "--recipe", "{R}/escape.yaml", "--out", "x"],
        "name' is invalid",
    ),
    ("compress-recipe-missing", ["compress", "{F}", "--recipe", "{R}/nope.yaml", "--out", "x"], "No recipe"),
    # stats stores are not trusted blindly (item 7)
    (
        "compress-foreign-store",
        ["compress", "{Q}", "--ratio", "0.5", "--criterion", "frequency", "--calib", "{R}/s", "--out", "x"],
        "another model",
    ),
    (
        "compress-calib-empty-dir",
        ["compress", "{F}", "--ratio", "0.5", "--calib", "{R}/empty", "--out", "x"],
        "not a stats store",
    ),
    # loader errors (item 4)
    (
        "compress-corrupt-model",
        ["compress", "{R}/corrupt", "--ratio", "0.5", "--criterion", "frequency", *CAL, "--out", "x"],
        "corrupt",
    ),
    (
        "compress-missing-model",
        ["compress", "{R}/nope", "--ratio", "0.5", "--out", "x"],
        "No model directory",
    ),
    (
        "compress-unknown-fixture",
        ["compress", "fixture:nope", "--ratio", "0.5", "--out", "x"],
        "Unknown fixture",
    ),
    ("inspect-unknown-fixture", ["inspect", "fixture:nope"], "Unknown fixture"),
    ("inspect-file", ["inspect", "{R}/afile.txt"], "is a file"),
    # calibrate
    (
        "calibrate-seq-len-zero",
        ["calibrate", "{F}", "--data", "fixture-calib:4", "--seq-len", "0", "--out", "c"],
        "--seq-len must be",
    ),
    (
        "calibrate-batch-zero",
        ["calibrate", "{F}", "--data", "fixture-calib:4", "--batch-size", "0", "--out", "c"],
        "--batch-size must be",
    ),
    (
        "calibrate-moments-json",
        ["calibrate", "{F}", "--data", "fixture-calib:4", "--moment-experts", '{"0":"x"}', "--out", "c"],
        "--moment-experts",
    ),
    (
        "calibrate-moments-list",
        ["calibrate", "{F}", "--data", "fixture-calib:4", "--moment-experts", "a,b", "--out", "c"],
        "--moment-experts",
    ),
    (
        "calibrate-store-batch-differs",
        [
            "calibrate",
            "{F}",
            "--data",
            "fixture-calib:4",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--out",
            "{R}/s",
        ],
        "batch size 8, not 4",
    ),
    (
        "calibrate-store-moments-differ",
        [
            "calibrate",
            "{F}",
            "--data",
            "fixture-calib:4",
            "--seq-len",
            "32",
            "--moment-experts",
            "0,1",
            "--out",
            "{R}/s",
        ],
        "collector parameters",
    ),
    (
        "calibrate-store-dtype-differs",
        [
            "calibrate",
            "{F}",
            "--data",
            "fixture-calib:4",
            "--seq-len",
            "32",
            "--dtype",
            "bfloat16",
            "--out",
            "{R}/s",
        ],
        "dtype",
    ),
    (
        "calibrate-store-other-model",
        ["calibrate", "{Q}", "--data", "fixture-calib:4", "--seq-len", "32", "--out", "{R}/s"],
        "another model",
    ),
    (
        "calibrate-out-unmarked",
        ["calibrate", "{F}", "--data", "fixture-calib:4", "--out", "{R}/other", "--overwrite"],
        "not written by moecompress",
    ),
    (
        "calibrate-corrupt-model",
        ["calibrate", "{R}/corrupt", "--data", "fixture-calib:4", "--seq-len", "32", "--out", "c"],
        "corrupt",
    ),
    # eval
    ("eval-limit-zero", ["eval", "{F}", "--ppl", "fixture-heldout", "--limit", "0"], "--limit must be"),
    ("eval-limit-neg", ["eval", "{F}", "--ppl", "fixture-heldout", "--limit", "-1"], "--limit must be"),
    (
        "eval-batch-zero",
        ["eval", "{F}", "--ppl", "fixture-heldout", "--batch-size", "0"],
        "--batch-size must be",
    ),
    (
        "eval-out-exists",
        ["eval", "{F}", "--ppl", "fixture-heldout", "--out", "{R}/other.json"],
        "already exists",
    ),
    (
        "eval-out-not-ours",
        ["eval", "{F}", "--ppl", "fixture-heldout", "--out", "{R}/other.json", "--overwrite"],
        "not a results file",
    ),
    (
        "eval-report-unmarked",
        ["eval", "{F}", "--ppl", "fixture-heldout", "--report", "{R}/other", "--overwrite"],
        "not written by moecompress",
    ),
    (
        "eval-corrupt-model",
        ["eval", "{R}/corrupt", "--ppl", "fixture-heldout", "--max-tokens", "64"],
        "corrupt",
    ),
    # grid, compare, demo
    ("grid-ratios-text", ["grid", "fixture:olmoe-tiny", "--ratios", "abc"], "not a number"),
    ("grid-ratios-nan", ["grid", "fixture:olmoe-tiny", "--ratios", "nan"], "--ratios must be"),
    ("grid-ratios-one", ["grid", "fixture:olmoe-tiny", "--ratios", "0.5,1"], "--ratios must be"),
    ("grid-rank-zero", ["grid", "fixture:olmoe-tiny", "--rank", "0"], "--rank must be"),
    (
        "grid-out-unmarked",
        ["grid", "fixture:olmoe-tiny", "--out", "{R}/other", "--overwrite"],
        "not written by moecompress",
    ),
    ("compare-escape-name", ["compare", "{R}/escape.yaml", "--out", "c"], "name' is invalid"),
    ("compare-recipe-list", ["compare", "{R}/list.yaml", "--out", "c"], "YAML mapping"),
    (
        "compare-out-unmarked",
        ["compare", "{R}/corrupt.yaml", "--out", "{R}/other", "--overwrite"],
        "not written by moecompress",
    ),
    (
        "compare-failure-keeps-previous",
        ["compare", "{R}/corrupt.yaml", "--out", "{R}/prev", "--overwrite"],
        "corrupt",
    ),
    ("demo-out-unmarked", ["demo", "--out", "{R}/other"], "not written by moecompress"),
    # analyze, dense, dense-sweep, distill
    ("analyze-scope-zero", ["analyze", "{F}", "--scope", "0", "--out", "a"], "--scope must be"),
    ("analyze-out-cwd", ["analyze", "{F}", "--out", ".", "--overwrite"], "current directory"),
    ("analyze-corrupt-model", ["analyze", "{R}/corrupt", "--out", "a"], "corrupt"),
    (
        "analyze-drift-one-draw",
        ["analyze", "{F}", "--mask-drift", "--draws", "1", "--out", "a"],
        "--draws must be",
    ),
    (
        "analyze-drift-bad-ratio",
        [
            "analyze",
            "{F}",
            "--mask-drift",
            "--ratio",
            "1.5",
            "--data",
            "fixture-calib/scripture",
            "--data",
            "fixture-calib/aphorisms",
            "--out",
            "a",
        ],
        "ratio",
    ),
    ("dense-k-zero", ["dense", "{F}", "--K", "0", "--out", "d"], "--K must be"),
    (
        "dense-out-is-model",
        ["dense", "{R}/corrupt", "--out", "{R}/corrupt", "--overwrite"],
        "which this run reads",
    ),
    ("dense-corrupt-model", ["dense", "{R}/corrupt", "--out", "d"], "corrupt"),
    ("dense-sweep-k-text", ["dense-sweep", "{F}", "--K", "a"], "--K"),
    ("dense-sweep-window", ["dense-sweep", "{F}", "--window", "1"], "--window must be"),
    (
        "distill-tokens-zero",
        [
            "distill",
            "--teacher",
            "{F}",
            "--student",
            "{F}",
            "--data",
            "fixture-calib",
            "--tokens",
            "0",
            "--out",
            "r",
        ],
        "--tokens",
    ),
    (
        "distill-overwrite-unmarked",
        [
            "distill",
            "--teacher",
            "{F}",
            "--student",
            "{F}",
            "--data",
            "fixture-calib",
            "--tokens",
            "64",
            "--out",
            "{R}/other",
            "--overwrite",
        ],
        "not written by moecompress",
    ),
]


def test_matrix_is_large():
    assert len(CASES) >= 40
    verbs = {argv[0] for _, argv, _ in CASES}
    assert verbs >= {
        "inspect",
        "compress",
        "calibrate",
        "eval",
        "grid",
        "compare",
        "demo",
        "analyze",
        "dense",
        "dense-sweep",
        "distill",
    }


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(ws, capsys, monkeypatch, argv, fragment):
    monkeypatch.chdir(ws / "w")
    argv = [a.replace("{R}", str(ws)).replace("{F}", str(F)).replace("{Q}", str(Q)) for a in argv]
    assert_refused(argv, capsys, fragment, (ws, F.parent))


def test_a_checkpoint_without_tokenizer_files_is_refused_not_encoded_to_nothing(tmp_path, capsys):
    src = fixture_dir("olmoe-tiny")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src.iterdir():  # weights and config, no tokenizer files
        if f.suffix in (".json", ".safetensors") and not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, bare / f.name)
    out = tmp_path / "stats"
    code, _, err = run_cli(
        [
            "calibrate",
            str(bare),
            "--data",
            "fixture-calib:2",
            "--seq-len",
            "16",
            "--for-method",
            "reap",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 2 and not out.exists() and "Traceback" not in err
    assert "No tokenizer could be loaded from" in err and "pass --tokenizer" in err
