"""`moecompress compare`: arms from one calibration, evaluated on the same items, reported."""

import json
import shutil

import pytest
import yaml

from moecompress.errors import MoECompressError
from moecompress.recipe import load_recipe, merge_recipes, parse_recipe
from moecompress.testing import fixture_dir, run_cli, save_tiny


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A tiny random OLMoE with the shipped fixture tokenizer, so text specs and lm-eval tasks work."""
    tok_dir = fixture_dir("olmoe-tiny")
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.fail("a shipped fixture is missing: restore src/moecompress/fixtures (it is committed)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    path = save_tiny(
        "olmoe",
        tmp_path_factory.mktemp("cmp") / "model",
        seed=2,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    tok.save_pretrained(path)
    return path


def _recipe(tmp_path, model, arms, **eval_over):
    ev = dict(
        ppl="fixture-heldout",
        window=64,
        max_tokens=512,
        tasks=["fixture_mc", "fixture_gen"],
        limit=4,
        latency=False,
        quant_baselines=[4],
    )
    ev.update(eval_over)
    files = []
    for i, arm in enumerate(arms):
        p = tmp_path / f"r{i}.yaml"
        p.write_text(
            yaml.safe_dump(
                dict(model=str(model), calibration={"data": "fixture-calib:4", "seq_len": 64}, eval=ev, **arm)
            )
        )
        files.append(str(p))
    return files


def test_compare_two_recipes_writes_report_pngs_and_results(tiny_with_tokenizer, tmp_path, capsys):
    files = _recipe(
        tmp_path,
        tiny_with_tokenizer,
        [
            dict(method="prune", params=dict(criterion="reap", ratio=0.5, gate="keep")),
            dict(method="prune", params=dict(criterion="mone", ratio=0.5, operator="constant"), quant="w4c"),
        ],
    )
    out = tmp_path / "report"
    code, stdout, err = run_cli(["compare", *files, "--out", str(out)], capsys)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    names = [a["name"] for a in results["arms"]]
    assert names == ["original", "prune-reap-keep-50", "prune-mone-constant-50+w4c-gptq", "quant-w4g128-gptq"]
    assert results["arms"][2]["precision"] == "w4c"  # structure + bits: the kept experts quantized
    quant = results["arms"][3]  # the pure-quantization reference: exported and loaded back like any arm
    assert quant["kind"] == "quant_baseline" and quant["precision"] == "w4g128"
    assert 4.0 < quant["bits_per_weight"] < 5.0  # 4 bits + a bf16 scale per 128 (ragged) weights
    assert results["arms"][1]["bits_per_weight"] == 16.0  # half of the float32 experts kept
    original = results["arms"][0]
    kl = original["metrics"]["ppl:fixture-heldout"]["aggregate"]["kl"]
    assert abs(kl) < 1e-6  # the original against itself
    ids = {a["name"]: a["metrics"]["fixture_mc"]["items"]["ids"] for a in results["arms"]}
    assert len({tuple(v) for v in ids.values()}) == 1  # every arm on the same documents
    pruned = results["arms"][1]
    assert pruned["export_format"] == "compact" and pruned["bytes"]["model"] < original["bytes"]["model"]
    report = (out / "report.md").read_text()
    for item in ("router convention", "fixed mask", "generative", "calibration", "quantization"):
        assert item in report.lower()
    assert (out / "quality_vs_bytes.png").is_file()
    assert not (tmp_path / ".report.work").exists()
    # one display of our own: no library progress bar or log line reaches the terminal
    for noise in ("Loading weights", "Running loglikelihood", "Running generate_until", "it/s]"):
        assert noise not in err and noise not in stdout
    assert max(len(line) for line in stdout.splitlines()) <= 100  # the ranking table fits 100 columns
    ranking = (out / "ranking.md").read_text()  # the same table, as markdown
    assert all(f"| {n} |" in ranking for n in names)


def test_recipes_must_share_model_and_calibration(tmp_path):
    a = parse_recipe(dict(model="m1", method="prune", params={"ratio": 0.5}))
    b = parse_recipe(dict(model="m2", method="prune", params={"ratio": 0.25}))
    with pytest.raises(MoECompressError, match="disagree on 'model'"):
        merge_recipes([a, b])


@pytest.mark.parametrize(
    "data, message",
    [
        (dict(model="m", method="prune", params={"ratio": 2}), "field 'ratio'"),
        (dict(model="m", params={"ratio": 0.5}), "field 'method' is missing"),
        (dict(model="m", method="prune", eval={"window": "x"}), "field 'eval.window'"),
        (dict(model="m", method="nosuch"), "Unknown method 'nosuch'"),
    ],
)
def test_invalid_recipe_points_at_the_field(data, message):
    with pytest.raises(MoECompressError, match=message):
        parse_recipe(data)


def test_missing_recipe_file(tmp_path, capsys):
    code, _, err = run_cli(["compare", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "No recipe at" in err and not (tmp_path / "o").exists()


def test_shipped_demo_recipe_is_valid():
    from importlib import resources

    recipe = load_recipe(resources.files("moecompress") / "recipes" / "demo.yaml")
    assert recipe.model.startswith("fixture:") and len(recipe.arms) <= 10  # the short default (issue 35)
    from moecompress.methods import get_method

    families = {get_method(a.method).family for a in recipe.arms}
    assert families == {
        "prune",
        "consolidate",
        "merge",
        "elementwise",
        "dense",
        "auto",
    }  # one of each at least
    assert any(a.distill for a in recipe.arms) and any(
        a.params.get("operator") == "tilt" for a in recipe.arms
    )
    assert (
        any(a.quant is not None for a in recipe.arms) and recipe.eval.quant_baselines
    )  # structure + bits, bits
    full = load_recipe(resources.files("moecompress") / "recipes" / "demo-full.yaml")
    assert {a.display_name() for a in recipe.arms} < {a.display_name() for a in full.arms}
    assert shutil.which("moecompress") is not None


def test_grid_holds_each_mask_fixed_and_pairs_against_constant():
    from moecompress.cli.grid import grid_arms

    arms, pairs = grid_arms(["mone"], ["reroute-keep", "tilt"], [0.5], rank=8)
    assert [a.name for a in arms] == ["mone-50-constant", "mone-50-reroute-keep", "mone-50-tilt"]
    assert pairs == [("mone-50-reroute-keep", "mone-50-constant"), ("mone-50-tilt", "mone-50-constant")]
    assert {(a.params["criterion"], a.params["ratio"]) for a in arms} == {("mone", 0.5)}
    with pytest.raises(MoECompressError, match="Unknown operator cell 'tilted'"):
        grid_arms(["mone"], ["tilted"], [0.5], rank=8)


def test_dense_arm_before_and_after_distillation(tiny_with_tokenizer, tmp_path, capsys):
    dense = dict(method="dense", params=dict(criterion="frequency", grouping="rr", scaling="uniform"))
    files = _recipe(
        tmp_path,
        tiny_with_tokenizer,
        [
            dict(name="dense", **dense),
            dict(
                name="dense-kd",
                distill=dict(
                    tokens=512,
                    seq_len=64,
                    batch_size=2,
                    eval_every=2,
                    save_every=2,
                    lr=1e-3,
                    data="fixture-calib",
                ),
                **dense,
            ),
        ],
        tasks=[],
        quant_baselines=[],
    )
    out = tmp_path / "report"
    code, stdout, err = run_cli(["compare", *files, "--out", str(out)], capsys)
    assert code == 0, err
    assert "'loss'" not in stdout + err and "'eval_loss'" not in stdout + err  # no Trainer log dicts printed
    arms = {a["name"]: a for a in json.loads((out / "results.json").read_text())["arms"]}
    assert arms["dense"]["export_format"] == "dense" and arms["dense"].get("distilled") is None
    assert arms["dense-kd"]["distilled"]["tokens"] == 512
    assert arms["dense"]["bytes"]["model"] < arms["original"]["bytes"]["model"]
    assert not (out / ".distill").exists()


def test_an_arm_calibrated_on_a_task_is_scored_on_it_like_any_other(tiny_with_tokenizer, tmp_path, capsys):
    """In-domain arms (issue 18): an arm's own calibration spec, recorded per arm; same items for every arm."""
    p = tmp_path / "indomain.yaml"
    arm = dict(method="prune", params=dict(criterion="frequency", ratio=0.5, gate="renorm"))
    p.write_text(
        yaml.safe_dump(
            dict(
                model=str(tiny_with_tokenizer),
                calibration={"data": "fixture-calib:4", "seq_len": 64},
                eval=dict(
                    ppl="fixture-heldout",
                    window=64,
                    max_tokens=256,
                    tasks=["fixture_cloze"],
                    limit=6,
                    latency=False,
                    quant_baselines=[],
                ),
                arms=[
                    dict(arm, name="general"),
                    dict(arm, name="in-domain", calibration={"data": "task:fixture_cloze:8", "seq_len": 512}),
                    dict(
                        arm,
                        name="in-domain-tilt",
                        params=dict(arm["params"], operator="tilt", rank=4),
                        calibration={"data": "task:fixture_cloze:8", "seq_len": 512},
                    ),
                ],
            )
        )
    )
    out = tmp_path / "report"
    code, _, err = run_cli(["compare", str(p), "--out", str(out)], capsys)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    by = {a["name"]: a for a in results["arms"]}
    assert "calibration" not in by["general"] and results["calibration"]["source"] == "fixture-calib:4"
    own = by["in-domain"]["calibration"]
    assert own == by["in-domain-tilt"]["calibration"]  # one calibration serves both arms naming the spec
    assert own["source"] == "task:fixture_cloze:8" and "fixture_cloze prompts" in own["domain"]
    assert own["tokens"] != results["calibration"]["tokens"]
    ids = {n: tuple(a["metrics"]["fixture_cloze"]["items"]["ids"]) for n, a in by.items()}
    assert len(set(ids.values())) == 1 and len(ids["in-domain"]) == 6  # scored on the task like every arm
    report = (out / "report.md").read_text()
    assert "arm in-domain: domain fixture_cloze prompts" in report
    assert "lm-eval task fixture_cloze, 8 of 400 test documents" in own["origin"]  # task, split, documents
    assert "Arms with their own calibration" in report


def test_an_interrupted_compare_resumes_without_recomputing_finished_arms(
    tiny_with_tokenizer, tmp_path, monkeypatch
):
    """Ctrl-C after the first arm keeps it (and the calibration) in .OUT.partial; --resume computes only the
    arm left and writes the same report; a resume with another recipe is refused in one sentence."""
    import moecompress.workflows.pipeline as pipeline
    from moecompress.api import compare

    files = _recipe(
        tmp_path,
        tiny_with_tokenizer,
        [
            dict(method="prune", params=dict(criterion="frequency", ratio=0.5, gate="renorm")),
            dict(method="prune", params=dict(criterion="reap", ratio=0.5, gate="keep")),
        ],
        tasks=[],
        quant_baselines=[],
    )
    out, partial = tmp_path / "rep", tmp_path / ".rep.partial"
    built, real, interrupt = [], pipeline.make_plan, {"reap": True}

    def make_plan(model, method, params, *a, **k):
        if interrupt.pop(params["criterion"], False):  # Ctrl-C while the second arm builds, once
            raise KeyboardInterrupt
        built.append(params["criterion"])
        return real(model, method, params, *a, **k)

    monkeypatch.setattr(pipeline, "make_plan", make_plan)
    with pytest.raises(KeyboardInterrupt):
        compare(files, out, progress=False)
    assert not out.exists() and sorted(p.stem for p in (partial / "arms").iterdir()) == [
        "original",
        "prune-frequency-renorm-50",
    ]
    assert (partial / "stats").is_dir()
    first = json.loads((partial / "arms" / "prune-frequency-renorm-50.json").read_text())
    (tmp_path / "other").mkdir()
    other = _recipe(
        tmp_path / "other",
        tiny_with_tokenizer,
        [dict(method="prune", params=dict(criterion="mone", ratio=0.5, operator="constant"))],
        tasks=[],
        quant_baselines=[],
    )
    with pytest.raises(MoECompressError, match="drop --resume"):
        compare(other, out, progress=False, resume=True)
    assert built == ["frequency"]
    # a directory of the user's where the partial run would go is refused, never deleted
    mine = tmp_path / ".mine.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(MoECompressError, match="was not written by moecompress"):
        compare(files, tmp_path / "mine", progress=False)
    assert (mine / "notes.txt").read_text() == "the user's" and not (tmp_path / "mine").exists()
    results = compare(files, out, progress=False, resume=True)
    assert built == ["frequency", "reap"]  # the finished arm was not built again
    assert not partial.exists() and (out / "report.md").is_file()
    names = [a["name"] for a in results["arms"]]
    assert names == ["original", "prune-frequency-renorm-50", "prune-reap-keep-50"]
    assert results["arms"][1]["metrics"] == first["metrics"]


def test_demo_resume_reaches_compare_and_keeps_a_finished_fixture(tmp_path, monkeypatch, capsys):
    """`demo --resume` continues through compare's journal; with --full a fixture whose report finished before the
    interruption is kept, not recomputed."""
    import moecompress.cli.compare as cli_compare

    calls = []

    def compare(recipe, out, **kw):
        calls.append((out.name, kw["resume"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_compare, "compare", compare)
    code, _, err = run_cli(["demo", "--out", str(tmp_path / "d"), "--resume"], capsys)
    assert code == 130 and calls == [("d", True)] and "--resume" in err
    (tmp_path / "f" / "olmoe-tiny").mkdir(parents=True)
    (tmp_path / "f" / "olmoe-tiny" / "results.json").write_text("{}")
    calls.clear()
    code, out, _ = run_cli(["demo", "--full", "--out", str(tmp_path / "f"), "--resume"], capsys)
    assert code == 130 and calls == [("qwen3-moe-tiny", True)] and "kept" in out
