"""lm-eval bridge: offline local tasks on an in-memory model, per-document items, refusals in one sentence."""

import shutil

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.eval.lmeval import FIXTURE_TASKS, resolve_tasks, run_lm_eval
from moecompress.testing import tiny_model


def char_tokenizer():
    """A real HF fast tokenizer over printable ASCII (ids 3..94; 0 pad, 1 bos, 2 eos, 95 unk) for vocab-96 models."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 124)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"] + chars + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(Regex(r"\s"), " ")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return fast


class WrappedBlock(torch.nn.Module):
    """A replacement MoE block installed through the adapter (what the runtime does), delegating to the original."""

    def __init__(self, block):
        super().__init__()
        self.inner = block
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # hub_reachable() -> False without touching the network


def test_local_tasks_run_offline_on_an_in_memory_model():
    from moecompress.models import MoEAdapter

    model = tiny_model("qwen3_moe", seed=0, max_position_embeddings=2048)
    ad = MoEAdapter(model)
    blocks = {}
    for i in ad.moe_layers:
        blocks[i] = WrappedBlock(ad.layer(i).block)
        ad.set_block(i, blocks[i])
    res = run_lm_eval(model, char_tokenizer(), "fixture_mc,fixture_gen", limit=3, batch_size=2)
    assert set(res) == {"fixture_mc", "fixture_gen"}
    mc, gen = res["fixture_mc"], res["fixture_gen"]
    assert mc["output_type"] == "multiple_choice" and gen["output_type"] == "generate_until"
    assert mc["items"]["ids"] == [0, 1, 2] and gen["items"]["ids"] == [0, 1, 2]
    assert set(mc["items"]["acc"]) <= {0.0, 1.0} and len(mc["items"]["acc_norm"]) == 3
    assert mc["aggregate"]["acc"] == pytest.approx(sum(mc["items"]["acc"]) / 3)
    assert mc["primary"] == "acc" and mc["higher_is_better"]["acc"] is True
    assert gen["primary"] == "exact_match" and len(gen["items"]["response"]) == 3
    assert gen["aggregate"]["exact_match"] == pytest.approx(sum(gen["items"]["exact_match"]) / 3)
    assert all(b.calls > 0 for b in blocks.values())  # the installed blocks really ran


def test_user_task_via_include_path(tmp_path):
    d = tmp_path / "mytasks"
    d.mkdir()
    shutil.copy(FIXTURE_TASKS / "loader.py", d / "loader.py")
    (d / "tiny.jsonl").write_text(
        '{"q": "A b c", "choices": ["d", "e"], "gold": 0}\n{"q": "X y", "choices": ["z", "w"], "gold": 1}\n'
    )
    (d / "tiny.yaml").write_text(
        "task: my_tiny\ncustom_dataset: !function loader.load\ndataset_kwargs:\n  data_file: tiny.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n"
    )
    model = tiny_model("olmoe", seed=0, max_position_embeddings=256)
    res = run_lm_eval(model, char_tokenizer(), ["my_tiny"], include_path=str(d))
    assert res["my_tiny"]["items"]["ids"] == [0, 1] and res["my_tiny"]["n"] == 2


def test_unknown_task_lists_close_matches():
    with pytest.raises(
        MoECompressError, match=r"Unknown lm-eval task 'fixture_mcq': did you mean fixture_mc"
    ):
        resolve_tasks("fixture_mc,fixture_mcq")


def test_hub_task_offline_is_refused():
    with pytest.raises(
        MoECompressError, match=r"'arc_easy' downloads its data from the HuggingFace hub.*reachable"
    ):
        resolve_tasks("arc_easy")


def test_missing_include_path_and_empty_tasks(tmp_path):
    with pytest.raises(MoECompressError, match="does not exist"):
        resolve_tasks("fixture_mc", include_path=tmp_path / "nope")
    with pytest.raises(MoECompressError, match="No lm-eval task"):
        resolve_tasks(" , ")


def test_eval_command_end_to_end(tmp_path, capsys):
    import json

    from moecompress.cli import main

    ckpt = tmp_path / "tiny"
    tiny_model("qwen3_moe", seed=0, max_position_embeddings=2048).save_pretrained(ckpt)
    char_tokenizer().save_pretrained(ckpt)
    text = tmp_path / "text.txt"
    text.write_text("In the beginning the Python documentation was written in plain English. " * 6)
    out = tmp_path / "res" / "results.json"
    main(
        [
            "eval",
            str(ckpt),
            "--tasks",
            "fixture_mc",
            "--limit",
            "2",
            "--ppl",
            str(text),
            "--window",
            "64",
            "--reference",
            str(ckpt),
            "--out",
            str(out),
            "--dtype",
            "float32",
        ]
    )
    data = json.loads(out.read_text())
    arm = data["arms"][0]
    assert set(arm["metrics"]) == {"ppl:text.txt", "fixture_mc"}
    assert arm["metrics"]["ppl:text.txt"]["aggregate"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert arm["metrics"]["fixture_mc"]["items"]["ids"] == [0, 1]
    assert data["model"]["model_type"] == "qwen3_moe" and data["model"]["router_convention"]
    with pytest.raises(SystemExit) as ex:
        main(["eval", str(ckpt)])
    assert ex.value.code == 2 and "Nothing to evaluate" in capsys.readouterr().err


def test_runtime_model_with_a_plan_runs_local_tasks():
    pytest.importorskip("moecompress.runtime")
    from moecompress.api import apply_plan
    from moecompress.eval.runner import plan_arm_fields
    from moecompress.plan import CompressionPlan

    model = tiny_model("olmoe", seed=0, max_position_embeddings=2048)
    plan = CompressionPlan.prune(model, {i: [0, 2, 4, 6] for i in range(2)}, gate="keep", method="prune")
    apply_plan(model, plan)
    res = run_lm_eval(model, char_tokenizer(), "fixture_gen,fixture_mc", limit=2)
    assert res["fixture_gen"]["items"]["ids"] == [0, 1] and res["fixture_mc"]["n"] == 2
    fields = plan_arm_fields(plan)
    assert fields["gate_semantics"] == "keep" and fields["operator"] == "reroute (keep)"
    assert [(r["retained"], r["dropped"], r["experts"]) for r in fields["per_layer"]] == [
        (4, 4, 8),
        (4, 4, 8),
    ]
    other = plan_arm_fields(
        CompressionPlan.prune(tiny_model("olmoe", seed=1), {i: [0, 2, 4, 6] for i in range(2)}, gate="renorm")
    )
    assert other["mask_id"] == fields["mask_id"]  # same retained experts -> same mask
