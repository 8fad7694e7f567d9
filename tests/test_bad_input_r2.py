"""Bad input, round 2 (issue 33, items 4-7, 9, 10): every numbered case, plus a fresh probe.

Policy (docs/architecture.md, "Bad input"): bad input exits 2 with one `error:` sentence and no traceback, before
any compute where the input can be checked then; NaN / infinite metrics exit 1 with one sentence naming the arm
unless `--allow-nan`; Ctrl-C / SIGTERM exit 130 / 143 with one `interrupted:` line, even while the command is
still importing. Cases run in-process (`run_cli`) on the shipped fixtures, with tiny calibrations.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moecompress.testing import fixture_dir, run_cli

F = fixture_dir("olmoe-tiny")
Q = fixture_dir("qwen3-moe-tiny")
CAL = ["--calib", "fixture-calib:2", "--seq-len", "16"]
PPL = ["--ppl", "fixture-heldout", "--max-tokens", "48", "--window", "24"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(file: Path, pick, change) -> None:
    tensors = load_file(str(file))
    key = next(k for k in sorted(tensors) if pick(k))
    change(tensors[key])
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: stores, exports and damaged copies of the fixtures (built once, ~20 s)."""
    import moecompress
    from moecompress.checkpoint import checkpoint_fingerprint

    root = tmp_path_factory.mktemp("bad2")
    (root / "w").mkdir()
    with warnings.catch_warnings():  # 2 short sequences leave some experts unreached; expected here
        warnings.simplefilter("ignore")
        for model, name in ((F, "s"), (Q, "q")):
            moecompress.calibrate(
                str(model),
                "fixture-calib:2",
                seq_len=16,
                out=root / name,
                for_method="frequency",
                batch_size=8,
                progress=False,
            )
        moecompress.compress(
            str(F),
            "prune",
            {"criterion": "frequency", "ratio": 0.5},
            calib=root / "s",
            out=root / "exp",
            format="compact",
            progress=False,
        )
        moecompress.compress(
            str(F),
            "quant",
            {"quant": "w4g128", "algo": "rtn"},
            out=root / "qexp",
            format="compact",
            progress=False,
        )
    # a store of the other fixture (same layers, experts and hidden size) with its identity edited to pass as F's
    meta_file = _copy(root / "q", root / "foreign") / "stats.json"
    meta = json.loads(meta_file.read_text())
    meta["model"].update(fingerprint=checkpoint_fingerprint(F), source=str(F))
    meta_file.write_text(json.dumps(meta))
    _edit_tensor(
        _copy(root / "s", root / "s_nan") / "layer_0001.safetensors",
        lambda k: k == "out_norm_sq_mean",
        lambda t: t.__setitem__(3, float("nan")),
    )
    _edit_tensor(
        _copy(F, root / "nanw") / "model.safetensors",
        lambda k: ".experts." in k,
        lambda t: t.__setitem__((0, 0), float("nan")),
    )
    _edit_tensor(
        _copy(F, root / "infrouter") / "model.safetensors",
        lambda k: k.endswith("mlp.gate.weight"),
        lambda t: t[0].fill_(float("inf")),
    )
    _edit_tensor(
        _copy(root / "qexp", root / "qexp_scale") / "model.safetensors",
        lambda k: k.endswith("weight_scale"),
        lambda t: t.fill_(float("nan")),
    )
    _edit_tensor(
        _copy(root / "qexp", root / "qexp_shape") / "model.safetensors",
        lambda k: k.endswith("weight_shape"),
        lambda t: t.copy_(torch.tensor([7, 5])),
    )
    cfg_file = _copy(F, root / "topk") / "config.json"
    cfg_file.write_text(json.dumps(dict(json.loads(cfg_file.read_text()), num_experts_per_tok=100)))
    for name, shard in (("escape", "../nanw/model.safetensors"), ("absolute", str(F / "model.safetensors"))):
        d = root / name
        d.mkdir()
        for f in F.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        keys = load_file(str(F / "model.safetensors")).keys()
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": dict.fromkeys(keys, shard)})
        )
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "datadir").mkdir()
    os.mkfifo(root / "fifo")
    (root / "dangling").symlink_to(root / "nowhere")
    recipe = f"model: {F}\nmethod: dense\nparams: {{K: 1}}\n"
    laughs = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh"))
    recipes = {
        "distill_typo.yaml": recipe + "distill: {tokns: 64}\n",
        "distill_bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + laughs
        + recipe
        + "distill: {tokens: 64, scheduler: *h}\n",
        "seed.yaml": f"model: {F}\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\nseed: 1.0e+26\n",
        "empty.yaml": "",
        "arms_scalar.yaml": f"model: {F}\narms: 5\n",
        "format.yaml": f"model: {F}\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\nformat: nope\n",
        "window.yaml": f"model: {F}\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\neval: {{window: 1}}\n",
        "unicode_name.yaml": f"model: {F}\nname: arm✓\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\n",
        "deep.yaml": "model: x\nmethod: prune\nparams: " + "[" * 5000 + "]" * 5000 + "\n",
        "cycle.yaml": f"model: {F}\nmethod: prune\nparams: {{criterion: frequency, ratio: 0.5}}\nx: &x [*x]\n",
    }
    for name, text in recipes.items():
        (root / name).write_text(text)
    (root / "empty.txt").write_text("")
    (root / "latin1.jsonl").write_bytes(b'\xff\xfe{"text": 1}\n')
    _copy(F, root / "emptyindex")
    (root / "emptyindex" / "model.safetensors.index.json").write_text("")
    meta_file = _copy(root / "s", root / "s_badmeta") / "stats.json"
    meta_file.write_text(json.dumps(dict(json.loads(meta_file.read_text()), layers="abc")))
    (root / "tasks").mkdir()
    return root


def _expand(argv, root: Path) -> list[str]:
    return [a.replace("{R}", str(root)).replace("{F}", str(F)).replace("{Q}", str(Q)) for a in argv]


def _one_sentence(err: str) -> str:
    """The single `error:` line, which must be the last thing printed (progress bars may come before it)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


# (id, argv, expected exit code, fragment of the one sentence); {R} = workspace, {F}/{Q} = fixtures
CASES = [
    # item 4: recipes validated before any compute (distill: included)
    ("distill-typo", ["compare", "{R}/distill_typo.yaml", "--out", "c"], 2, "distill.tokns"),
    ("distill-alias-bomb", ["compare", "{R}/distill_bomb.yaml", "--out", "c"], 2, "nested YAML aliases"),
    # item 5: stored inputs are not trusted
    (
        "store-nan",
        [
            "compress",
            "{F}",
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--calib",
            "{R}/s_nan",
            "--out",
            "c",
        ],
        2,
        "NaN or infinite values in 'out_norm_sq_mean' of layer 1",
    ),
    (
        "store-identity-edited",
        [
            "compress",
            "{F}",
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--calib",
            "{R}/foreign",
            "--out",
            "c",
        ],
        2,
        "made for another model",
    ),
    (
        "index-dotdot",
        ["calibrate", "{R}/escape", "--data", "fixture-calib:2", "--out", "c"],
        2,
        "outside the checkpoint directory",
    ),
    (
        "index-absolute",
        ["calibrate", "{R}/absolute", "--data", "fixture-calib:2", "--out", "c"],
        2,
        "outside the checkpoint directory",
    ),
    ("index-dotdot-eval", ["eval", "{R}/escape", *PPL], 2, "outside the checkpoint directory"),
    ("packed-weight-shape", ["eval", "{R}/qexp_shape", *PPL], 2, "declares weight_shape (7, 5)"),
    # item 6: NaN is not success
    ("eval-nan-weights", ["eval", "{R}/nanw", *PPL], 1, "Arm 'nanw' evaluated to non-finite metrics"),
    ("eval-inf-router-kl", ["eval", "{R}/infrouter", *PPL, "--reference", "{F}"], 1, "kl=nan"),
    ("eval-tampered-scales", ["eval", "{R}/qexp_scale", *PPL], 1, "Arm 'qexp_scale' evaluated to non-finite"),
    (
        "compress-nan-weights",
        ["compress", "{R}/nanw", "--criterion", "frequency", "--ratio", "0.5", *CAL, "--out", "c"],
        2,
        "holds NaN or infinite weights",
    ),
    # item 7: one sentence instead of a traceback
    ("top-k-above-experts", ["inspect", "{R}/topk"], 2, "routes each token to 100 experts but has only 16"),
    (
        "top-k-above-experts-compress",
        ["compress", "{R}/topk", "--criterion", "frequency", "--ratio", "0.5", *CAL, "--out", "c"],
        2,
        "num_experts_per_tok exceeds the expert count",
    ),
    (
        "seed-huge",
        ["compress", "{F}", "--ratio", "0.5", "--seed", "100000000000000000000000000", *CAL, "--out", "c"],
        2,
        "--seed must be an integer between 0 and",
    ),
    ("seed-huge-recipe", ["compare", "{R}/seed.yaml", "--out", "c"], 2, "field 'seed' is invalid"),
    (
        "deep-json-data",
        ["calibrate", "{F}", "--data", "{R}/deep.json", "--out", "c"],
        2,
        "nests its JSON too deeply",
    ),
    # item 9: task code runs only when trusted
    (
        "include-path-untrusted",
        ["eval", "{F}", "--tasks", "fixture_cloze", "--include-path", "{R}/tasks"],
        2,
        "--trust-task-code",
    ),
    # item 10: messages that say what is wrong
    ("data-dev-zero", ["calibrate", "{F}", "--data", "/dev/zero", "--out", "c"], 2, "not a regular file"),
    ("data-fifo", ["calibrate", "{F}", "--data", "{R}/fifo", "--out", "c"], 2, "not a regular file"),
    ("data-directory", ["calibrate", "{F}", "--data", "{R}/datadir", "--out", "c"], 2, "is a directory"),
    ("eval-ppl-missing", ["eval", "{F}", "--ppl", "{R}/nope.txt"], 2, "The data file"),
    (
        "tilt-rank-huge",
        ["compress", "{F}", "--operator", "tilt", "--param", "rank=1.0e+35", *CAL, "--out", "c"],
        2,
        "'rank'",
    ),
    (
        "tilt-rank-above-hidden",
        [
            "compress",
            "{F}",
            "--criterion",
            "frequency",
            "--operator",
            "tilt",
            "--rank",
            "1000",
            "--ratio",
            "0.5",
            *CAL,
            "--out",
            "c",
        ],
        2,
        "exceeds the model's hidden size 192",
    ),
]

# a fresh probe of further bad input (issue 33, "Done when"): flags, recipe fields, empty files, unicode, huge values
PROBE = [
    (
        "format-unknown",
        ["compress", "{F}", "--format", "nope", *CAL, "--out", "c"],
        2,
        "Unknown export format",
    ),
    ("format-unknown-recipe", ["compare", "{R}/format.yaml", "--out", "c"], 2, "Unknown export format"),
    ("quant-spec", ["compress", "{F}", "--quant", "w99g128", *CAL, "--out", "c"], 2, "Quantization spec"),
    (
        "quant-algo",
        ["compress", "{F}", "--quant", "w4g128", "--quant-algo", "nope", *CAL, "--out", "c"],
        2,
        "'algo'",
    ),
    (
        "budget-text",
        ["compress", "{F}", "--method", "auto", "--budget", "abc", *CAL, "--out", "c"],
        2,
        "Budget 'abc'",
    ),
    (
        "max-memory-negative",
        ["compress", "{F}", "--dry-run", "--max-memory", "-5GB", *CAL, "--out", "c"],
        2,
        "not a positive size",
    ),
    ("method-unknown", ["compress", "{F}", "--method", "nope", *CAL, "--out", "c"], 2, "Unknown method"),
    (
        "ridge-inf",
        ["compress", "{F}", "--operator", "tilt", "--param", "ridge=.inf", *CAL, "--out", "c"],
        2,
        "'ridge'",
    ),
    ("data-spec-empty", ["calibrate", "{F}", "--data", "", "--out", "c"], 2, "data spec is empty"),
    (
        "data-count-zero",
        ["calibrate", "{F}", "--data", "fixture-calib:0", "--out", "c"],
        2,
        "asks for 0 sequences",
    ),
    (
        "stats-unknown",
        ["calibrate", "{F}", "--data", "fixture-calib:2", "--stats", "nope", "--out", "c"],
        2,
        "nope",
    ),
    (
        "for-method-unknown",
        ["calibrate", "{F}", "--data", "fixture-calib:2", "--for-method", "nope", "--out", "c"],
        2,
        "Unknown method 'nope'",
    ),
    ("data-empty-file", ["calibrate", "{F}", "--data", "{R}/empty.txt", "--out", "c"], 2, "is empty"),
    ("data-not-utf8", ["calibrate", "{F}", "--data", "{R}/latin1.jsonl", "--out", "c"], 2, "not UTF-8"),
    (
        "index-empty",
        ["calibrate", "{R}/emptyindex", "--data", "fixture-calib:2", "--out", "c"],
        2,
        "not a valid safetensors index",
    ),
    (
        "store-meta-malformed",
        ["compress", "{F}", "--criterion", "frequency", "--calib", "{R}/s_badmeta", "--out", "c"],
        2,
        "is not a stats store's metadata ('layers' must be",
    ),
    ("unicode-missing-model", ["inspect", "{R}/nöpe✓"], 2, "No model directory"),
    ("eval-dtype", ["eval", "{F}", *PPL, "--dtype", "float8"], 2, "Unknown dtype 'float8'"),
    ("eval-limit-nan", ["eval", "{F}", *PPL, "--limit", "nan"], 2, "--limit must be"),
    ("eval-seed-negative", ["eval", "{F}", *PPL, "--seed", "-1"], 2, "--seed must be"),
    ("recipe-empty-file", ["compare", "{R}/empty.yaml", "--out", "c"], 2, "YAML mapping"),
    ("recipe-arms-scalar", ["compare", "{R}/arms_scalar.yaml", "--out", "c"], 2, "field 'arms' is invalid"),
    ("recipe-eval-window", ["compare", "{R}/window.yaml", "--out", "c"], 2, "field 'eval.window' is invalid"),
    ("recipe-unicode-name", ["compare", "{R}/unicode_name.yaml", "--out", "c"], 2, "may hold only"),
    ("recipe-deeply-nested", ["compare", "{R}/deep.yaml", "--out", "c"], 2, "nests too deeply"),
    ("recipe-self-alias", ["compare", "{R}/cycle.yaml", "--out", "c"], 2, "nested YAML aliases"),
    ("dense-k-huge", ["dense", "{F}", "--K", "100000", "--out", "d"], 2, "exceeds the 16 experts"),
    (
        "analyze-seed-huge",
        ["analyze", "{F}", "--mask-drift", "--seed", "4294967296", "--out", "a"],
        2,
        "--seed must be",
    ),
]


def test_every_issue_item_has_a_case():
    ids = {c[0] for c in CASES}
    assert len(PROBE) >= 20 and not ids & {c[0] for c in PROBE}


@pytest.mark.parametrize(
    "argv,code,fragment", [c[1:] for c in CASES + PROBE], ids=[c[0] for c in CASES + PROBE]
)
def test_bad_input_r2(ws, tmp_path, capsys, monkeypatch, argv, code, fragment):
    monkeypatch.chdir(tmp_path)
    got, _, err = run_cli(_expand(argv, ws), capsys)
    assert got == code, err
    assert fragment in _one_sentence(err)
    assert not (tmp_path / "c").exists() and not any(p.name.startswith(".c.tmp") for p in tmp_path.iterdir())


def test_plan_json_tampering_is_one_sentence(ws, tmp_path, capsys):
    """Negative byte fields, `hidden_size: -192` and `dtype: "load"` in an export's plan.json (item 5)."""
    for field, value, fragment in (
        ("expert_bytes", -1, "model.expert_bytes"),
        ("hidden_size", -192, "model.hidden_size"),
        ("dtype", "load", "'load' is not a floating torch dtype"),
    ):
        d = _copy(ws / "exp", tmp_path / field)
        plan = json.loads((d / "plan.json").read_text())
        plan["model"][field] = value
        (d / "plan.json").write_text(json.dumps(plan))
        code, _, err = run_cli(["eval", str(d), *PPL], capsys)
        assert code == 2, err
        line = _one_sentence(err)
        assert "plan.json is invalid at" in line and fragment in line


def test_allow_nan_keeps_the_results(ws, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, _, err = run_cli(["eval", str(ws / "nanw"), *PPL, "--allow-nan", "--out", str(out)], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert (
        json.loads(out.read_text())["arms"][0]["metrics"]["ppl:fixture-heldout"]["aggregate"]["ppl"] is None
    )


def test_compare_refuses_nan_metrics_naming_the_arm(ws, monkeypatch):
    import importlib

    from moecompress.errors import NonFiniteMetrics

    arm_mod = importlib.import_module("moecompress.compare.arm")  # the package binds the function
    monkeypatch.setattr(
        "moecompress.eval.runner.evaluate_model",
        lambda *a, **k: {"ppl:x": {"aggregate": {"ppl": float("nan"), "kl": float("inf")}}},
    )
    with pytest.raises(NonFiniteMetrics, match="Arm 'reap-50' evaluated to non-finite metrics.*ppl=nan"):
        arm_mod.evaluate_arm(None, None, _recipe(), None, False, "reap-50")
    assert arm_mod.evaluate_arm(None, None, _recipe(), None, False, "reap-50", allow_nan=True)["ppl:x"]


def _recipe():
    from moecompress.recipe import parse_recipe

    return parse_recipe({"model": str(F), "method": "prune", "params": {"criterion": "reap", "ratio": 0.5}})


def test_dangling_symlink_out_is_refused_before_compute(ws, capsys, monkeypatch):
    """Item 7: `atomic.check_output` refuses it with the other output checks (it used to fail with
    NotADirectoryError at the rename, after all the compute); the link is left as it was."""
    import moecompress.workflows.pipeline as pipeline

    monkeypatch.chdir(ws / "w")
    monkeypatch.setattr(pipeline, "make_plan", lambda *a, **k: pytest.fail("computed before refusing"))
    argv = [
        "compress",
        str(F),
        "--criterion",
        "frequency",
        "--ratio",
        "0.5",
        "--calib",
        str(ws / "s"),
        "--out",
        str(ws / "dangling"),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "dangling" in _one_sentence(err)
    assert (ws / "dangling").is_symlink() and not (ws / "dangling").exists()


def test_compress_prints_its_summary_once(ws, tmp_path, capsys):
    code, out, err = run_cli(
        [
            "compress",
            str(F),
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--calib",
            str(ws / "s"),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 0, err
    assert out.count("checkpoint at") == 1 and "checkpoint at" not in err


@pytest.mark.parametrize(
    "verb,resume", [("compare", True), ("demo", True), ("calibrate", True), ("eval", False)]
)
def test_interrupt_advertises_resume_only_where_it_exists(ws, capsys, monkeypatch, verb, resume):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    module = {"compare": "compare", "demo": "compare", "calibrate": "calibrate", "eval": "eval"}[verb]
    function = {"calibrate": "calibrate", "eval": "evaluate"}.get(verb, "compare")
    monkeypatch.setattr(f"moecompress.cli.{module}.{function}", interrupted)
    argv = {
        "compare": ["compare", str(ws / "seed.yaml"), "--out", str(ws / "w" / "c")],
        "demo": ["demo", "--out", str(ws / "w" / "c")],
        "calibrate": ["calibrate", str(F), "--data", "fixture-calib:2", "--out", str(ws / "w" / "c")],
        "eval": ["eval", str(F), "--ppl", "fixture-heldout"],
    }[verb]
    code, _, err = run_cli(argv, capsys)
    assert code == 130 and "Traceback" not in err and err.strip().startswith("interrupted:"), err
    assert ("--resume" in err) == resume


def test_include_path_runs_only_with_trust_task_code_and_help_says_so(capsys):
    code, out, _ = run_cli(["eval", "--help"], capsys)
    assert code == 0 and "--trust-task-code" in out
    from moecompress.api import evaluate

    with pytest.raises(Exception, match="--trust-task-code"):
        evaluate(str(F), tasks="fixture_cloze", include_path=[str(F)])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_import_window_is_one_line(sig):
    """The command's handlers are installed before torch is imported (`moecompress/_signals.py`): the signal is
    sent as soon as this process catches SIGTERM, i.e. while `import moecompress` is still importing torch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.Popen(
        [sys.executable, "-m", "moecompress", "inspect", "fixture:olmoe-tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except FileNotFoundError:
            break
        caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.002)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    text = err.decode()
    assert "Traceback" not in text and next(x for x in text.splitlines() if x.strip()).startswith(
        "interrupted:"
    )
