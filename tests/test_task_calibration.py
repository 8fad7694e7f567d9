"""`task:NAME:COUNT` calibration terms: lm-eval's own prompts of seeded documents, unlabeled, recorded."""

import pytest
import torch

from moecompress.data import char_tokenizer, load_calibration, parse_spec, token_stream
from moecompress.data.tasks import load_task, task_prompts
from moecompress.errors import MoECompressError

TASK = "fixture_cloze"  # shipped local task: 400 documents, test split only


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def lm_eval_contexts():
    """doc_id -> the context lm-eval itself builds for that document when it evaluates the task (0-shot)."""
    task = load_task(TASK)
    task.build_all_requests(rank=0, world_size=1)
    return {inst.doc_id: inst.arguments[0] for inst in task.instances}


def test_spec_grammar_for_task_terms():
    (t,) = parse_spec("task:hellaswag:128")
    assert (t.kind, t.name, t.count, t.split) == ("task", "hellaswag", 128, None)
    (t,) = parse_spec("task:fixture_cloze@test:16")
    assert (t.kind, t.name, t.count, t.split) == ("task", "fixture_cloze", 16, "test")
    with pytest.raises(MoECompressError, match="names no task"):
        parse_spec("task::4")


def test_prompts_are_lm_evals_rendering_of_the_seeded_documents(lm_eval_contexts):
    tp = task_prompts(TASK, 24, seed=42)
    task = load_task(TASK)
    docs = list(task.test_docs())
    pick = torch.randperm(len(docs), generator=torch.Generator().manual_seed(42))[:24].tolist()
    assert tp.prompts == [lm_eval_contexts[i] for i in pick]
    assert (tp.split, tp.documents, tp.available, tp.overlaps_evaluation) == ("test", 24, len(docs), True)
    # unlabeled: no prompt carries its gold continuation
    for i, prompt in zip(pick, tp.prompts):
        assert not prompt.endswith(docs[i]["choices"][docs[i]["gold"]])
    assert task_prompts(TASK, 24, seed=42).prompts == tp.prompts
    assert task_prompts(TASK, 24, seed=7).prompts != tp.prompts


def test_calibration_rows_are_the_prompts_tokens_one_per_row(tok):
    data = load_calibration(f"task:{TASK}:8", tok, seq_len=4096, seed=3)
    prompts = task_prompts(TASK, 8, seed=3).prompts
    ids = tok(prompts, add_special_tokens=True)["input_ids"]
    assert data.num_sequences == 8
    for row, mask, want in zip(data.input_ids, data.attention_mask, ids):
        assert row[mask.bool()].tolist() == want
    assert data.num_tokens == sum(map(len, ids))
    (src,) = data.to_dict()["sources"]
    assert src["kind"] == "task" and src["documents"] == 8 and src["split"] == "test"
    assert src["tokens"] == data.num_tokens and "split it is evaluated on" in src["origin"]


def test_long_prompts_continue_in_the_next_row_and_mix_with_text(tok, tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("plain calibration text " * 40)
    data = load_calibration(f"task:{TASK}:2+{txt}:1", tok, seq_len=128, seed=0)
    prompts = task_prompts(TASK, 2, seed=0).prompts
    n_rows = sum(-(-len(ids) // 128) for ids in tok(prompts, add_special_tokens=True)["input_ids"])
    assert data.num_sequences == n_rows + 1
    assert [s.kind for s in data.sources] == ["task", "file"]
    assert "documents" not in data.sources[1].to_dict()  # other terms' records are unchanged


@pytest.mark.parametrize(
    "spec, msg",
    [
        (f"task:{TASK}:100000", "fewer than the 100000 requested"),
        (f"task:{TASK}@dev:4", "unknown split"),
        (f"task:{TASK}@train:4", "no documents in split train"),
        ("task:fixture_clozee:4", "did you mean fixture_cloze"),
    ],
)
def test_bad_task_terms_give_one_sentence(tok, spec, msg, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MoECompressError, match=msg):
        load_calibration(spec, tok, seq_len=64)


def test_hub_task_offline_and_task_term_in_an_eval_spec(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MoECompressError, match="not reachable"):
        load_calibration("task:hellaswag:4", tok, seq_len=64)
    with pytest.raises(MoECompressError, match="pass it to --tasks"):
        token_stream(f"task:{TASK}:4", tok, seq_len=64)
