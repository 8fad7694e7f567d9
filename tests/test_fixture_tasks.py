"""The shipped fixture_cloze / fixture_nextword tasks: rebuilt byte for byte, built as documented, run offline."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from moecompress.eval.lmeval import FIXTURE_TASKS, run_lm_eval
from moecompress.testing import fixture_dir

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "src/moecompress/fixtures/data/heldout.txt"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_local_tasks", REPO / "scripts/build_local_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def docs():
    return HELDOUT.read_text(encoding="utf-8").split("\n\n\n")


def rows(name):
    with open(FIXTURE_TASKS / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # hub_reachable() -> False without touching the network


def test_shipped_files_are_what_the_seeded_builder_writes(builder, tmp_path):
    mc, gen = builder.build(HELDOUT.read_text(encoding="utf-8"), 400, 400, 1234)
    cloze, nextword = builder.build_cloze(HELDOUT.read_text(encoding="utf-8"), 400, 400, 1234)
    builder.write(tmp_path, mc, gen, 1234, cloze, nextword)
    for name in ("fixture_cloze", "fixture_nextword", "fixture_mc", "fixture_gen"):
        for ext in ("jsonl", "yaml"):
            assert (tmp_path / f"{name}.{ext}").read_bytes() == (
                FIXTURE_TASKS / f"{name}.{ext}"
            ).read_bytes(), name


def test_cloze_items_are_a_blank_with_same_document_distractors(builder, docs):
    items = rows("fixture_cloze")
    assert len(items) == 400 and [r["id"] for r in items] == list(range(400))
    assert {r["gold"] for r in items} == {0, 1, 2, 3}
    for r in items:
        doc = docs[r["source_doc"]]
        # the true choice is the text that really follows the context in that document
        assert r["context"] + " " + r["choices"][r["gold"]] in doc
        words = [re.match(r"[A-Za-z]+", c).group(0) for c in r["choices"]]
        tails = {c[len(w) :] for c, w in zip(r["choices"], words)}
        # the same continuation after the blank: what touches the word (punctuation or nothing), then <= 3 words
        assert len(tails) == 1 and len(tails.pop().split(" ")) <= builder.RIGHT_WORDS + 1
        assert len({w.lower() for w in words}) == 4
        for w in words:  # every distractor is a word of the same document
            assert re.search(rf"(?<![A-Za-z]){w}(?![A-Za-z])", doc)
        assert 0 < len(r["context"]) <= builder.CLOZE_CONTEXT_CHARS
    per_doc = {}
    for r in items:
        per_doc[r["source_doc"]] = per_doc.get(r["source_doc"], 0) + 1
    assert max(per_doc.values()) <= 40 and len(per_doc) >= 20


def test_nextword_items_are_the_word_that_follows(docs):
    items = rows("fixture_nextword")
    cloze_ctx = {r["context"] for r in rows("fixture_cloze")}
    assert len(items) == 400
    for r in items:
        assert re.fullmatch(r"[A-Za-z]+", r["answer"])
        assert r["context"] + " " + r["answer"] in docs[r["source_doc"]]
        assert r["context"] not in cloze_ctx  # the two tasks sit at different places of the text


def test_new_tasks_run_offline_and_score_the_choices_by_loglikelihood():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = fixture_dir("qwen3-moe-tiny")
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    res = run_lm_eval(model, tok, "fixture_cloze,fixture_nextword", limit=3, batch_size=4)
    cl, nw = res["fixture_cloze"], res["fixture_nextword"]
    assert cl["output_type"] == "multiple_choice" and nw["output_type"] == "generate_until"
    assert cl["items"]["ids"] == [0, 1, 2] and nw["items"]["ids"] == [0, 1, 2]
    assert cl["primary"] == "acc" and nw["primary"] == "exact_match"
    assert nw["aggregate"]["exact_match"] == pytest.approx(sum(nw["items"]["exact_match"]) / 3)

    # known answer: lm-eval's acc equals argmax of the summed log-probability of each choice's tokens
    expected = []
    for r in rows("fixture_cloze")[:3]:
        ctx = tok(r["context"]).input_ids
        lls = []
        for c in r["choices"]:
            full = tok(r["context"] + " " + c).input_ids
            assert full[: len(ctx)] == ctx  # the context's tokens do not merge with the choice's
            with torch.no_grad():
                logp = model(torch.tensor([full])).logits[0].log_softmax(-1)
            tgt = torch.tensor(full[len(ctx) :])
            lls.append(logp[len(ctx) - 1 : -1].gather(-1, tgt[:, None]).sum().item())
        expected.append(float(max(range(4), key=lls.__getitem__) == r["gold"]))
    assert cl["items"]["acc"] == expected

    # the generated first word is compared with the answer, case-insensitively
    answers = [r["answer"].lower() for r in rows("fixture_nextword")[:3]]
    got = [float(str(x).lower() == a) for x, a in zip(nw["items"]["response"], answers)]
    assert nw["items"]["exact_match"] == got
