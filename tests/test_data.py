"""Data specs, packing/padding, hub dataset wiring and the sentences for bad data."""

import json

import pytest
import torch

from moecompress.data import (
    HUB_DATASETS,
    CalibrationData,
    char_tokenizer,
    load_calibration,
    parse_spec,
    token_stream,
)
from moecompress.data import sources as sources_mod
from moecompress.errors import MoECompressError


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture
def files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first document " * 20 + "\n\n\n" + "second document " * 30 + "\n\n\n\n" + "third " * 5)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"body": f"record number {i} " * (i + 1), "id": i}) for i in range(12))
    )
    return txt, jsonl


def test_spec_grammar(files):
    txt, jsonl = files
    s = parse_spec(f"c4:128+wikitext2@test:4+{jsonl}#body:3+fixture-calib+{txt}")
    assert [(t.kind, t.name, t.split, t.count) for t in s] == [
        ("hub", "c4", None, 128),
        ("hub", "wikitext2", "test", 4),
        ("file", str(jsonl), None, 3),
        ("fixture", "fixture-calib", None, None),
        ("file", str(txt), None, None),
    ]
    assert s[2].field == "body" and s[4].field is None
    assert parse_spec(str(jsonl))[0].field == "text"  # JSON records default to the 'text' field


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("", "empty"),
        ("  ", "empty"),
        ("+", "names no dataset"),
        (":64", "names no dataset"),
        ("c4:64+", "names no dataset"),
        ("c5:10", "Unknown dataset 'c5'"),
        ("no/such/file.txt", "does not exist"),
        ("c4:0", "at least one"),
        ("wikitext2@:3", "empty split"),
    ],
)
def test_bad_specs_give_one_sentence(spec, msg):
    with pytest.raises(MoECompressError, match=msg):
        parse_spec(spec)


def test_hub_table_names_real_datasets():
    assert HUB_DATASETS["c4"].dataset_id == "allenai/c4"
    assert HUB_DATASETS["c4"].data_files["train"] == "en/c4-train.00000-of-01024.json.gz"
    assert (HUB_DATASETS["wikitext2"].dataset_id, HUB_DATASETS["wikitext2"].config) == (
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
    )
    assert (HUB_DATASETS["fineweb-edu"].dataset_id, HUB_DATASETS["fineweb-edu"].config) == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
    )
    assert (HUB_DATASETS["gsm8k"].dataset_id, HUB_DATASETS["gsm8k"].config) == ("openai/gsm8k", "main")


def test_packed_sequences_are_full_seeded_and_exact(tok, files):
    txt, _ = files
    a = load_calibration(f"{txt}:3", tok, 32, seed=0)
    b = load_calibration(f"{txt}:3", tok, 32, seed=0)
    c = load_calibration(f"{txt}:3", tok, 32, seed=5)
    assert a.input_ids.shape == (3, 32) and a.num_tokens == 96 and not a.padded
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint() == b.fingerprint()
    assert not torch.equal(a.input_ids, c.input_ids)
    full = load_calibration(str(txt), tok, 32)  # no count: every full window of the text
    n_tokens = sum(len(tok(d)["input_ids"]) + 1 for d in sources_mod.text_documents(txt.read_text()))
    assert full.num_sequences == n_tokens // 32
    # documents are joined with EOS inside the packed stream
    assert (full.input_ids == tok.eos_token_id).sum() >= 2
    assert full.sources[0].domain.startswith("local file") and full.sources[0].tokens == full.num_tokens


def test_padded_sequences_mask_padding(tok, files):
    _, jsonl = files
    d = load_calibration(f"{jsonl}#body", tok, 64, padding=True)
    lengths = [len(tok(f"record number {i} " * (i + 1))["input_ids"]) for i in range(12)]
    windows = [min(64, n - s) for n in lengths for s in range(0, n, 64)]
    assert sorted(d.attention_mask.sum(1).tolist()) == sorted(windows)
    assert d.num_tokens == sum(lengths)
    assert bool((d.input_ids[d.attention_mask == 0] == tok.pad_token_id).all())
    assert d.padded and "padded" in d.describe()


def test_mixture_and_fixture_names(tok, files):
    _, jsonl = files
    d = load_calibration(f"fixture-heldout:4+{jsonl}#body:2", tok, 48)
    assert d.num_sequences == 6 and [s.sequences for s in d.sources] == [4, 2]
    assert "fixture corpus" in d.sources[0].domain
    assert d.to_dict()["tokens"] == 6 * 48


def test_batches_split_round_robin(tok):
    d = CalibrationData.from_tokens(torch.randint(3, 96, (7, 5)))
    assert [b for b, _ in d.batches(2)] == [0, 1, 2, 3]
    assert [b for b, _ in d.batches(2, rank=1, world=2)] == [1, 3]
    assert d.batches(2)[-1][1] == slice(6, 7)


def test_too_short_and_empty_data(tok, tmp_path, files):
    txt, jsonl = files
    with pytest.raises(MoECompressError, match="fewer than the 500 sequences requested"):
        load_calibration(f"{txt}:500", tok, 32)
    with pytest.raises(MoECompressError, match="fewer than the one sequence requested"):
        load_calibration(str(txt), tok, 100_000)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(MoECompressError, match="is empty"):
        load_calibration(str(empty), tok, 8)
    with pytest.raises(MoECompressError, match="has no field 'text'"):
        load_calibration(str(jsonl), tok, 8)
    with pytest.raises(MoECompressError, match="holds no tokens"):
        CalibrationData.from_tokens(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(MoECompressError, match="only applies to hub datasets"):
        load_calibration(f"{txt}@test", tok, 8)


def test_hub_name_offline_says_to_pass_a_local_file(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MoECompressError, match="unreachable.*pass a local file"):
        load_calibration("c4:4", tok, 16)
    with pytest.raises(MoECompressError, match="pass a local file"):
        token_stream("wikitext2", tok)


def test_hub_datasets_are_called_with_their_ids_configs_and_splits(tok, monkeypatch):
    """Online path with `datasets.load_dataset` stubbed: right ids/configs/splits, shuffle, lazy reading."""
    import datasets

    calls = []

    class FakeDS:
        def __init__(self, rows):
            self.rows = rows

        def shuffle(self, seed, **kw):
            calls.append(("shuffle", seed))
            return FakeDS(self.rows[::-1])

        def __iter__(self):
            return iter(self.rows)

    def fake_load(dataset_id, **kw):
        calls.append((dataset_id, kw))
        if dataset_id == "openai/gsm8k":
            return FakeDS([{"question": f"q{i} " * 10, "answer": f"a{i} " * 10} for i in range(50)])
        return FakeDS([{"text": f"doc {i} " * 40} for i in range(500 if dataset_id == "allenai/c4" else 40)])

    monkeypatch.setattr("moecompress.models.loading.hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    d = load_calibration("c4:3+gsm8k:2+wikitext2:1", tok, 64, seed=7)
    assert d.num_sequences == 6
    c4 = next(c for c in calls if c[0] == "allenai/c4")[1]
    assert c4 == {
        "split": "train",
        "streaming": True,
        "data_files": {"train": "en/c4-train.00000-of-01024.json.gz"},
    }
    gsm = next(c for c in calls if c[0] == "openai/gsm8k")[1]
    assert gsm == {"split": "train", "streaming": False, "name": "main"}
    wiki = next(c for c in calls if c[0] == "Salesforce/wikitext")[1]
    assert wiki["name"] == "wikitext-2-raw-v1" and wiki["split"] == "train"
    assert ("shuffle", 7) in calls
    assert d.sources[0].origin == "allenai/c4 split train"
    calls.clear()
    ts = token_stream("wikitext2", tok)
    assert next(c for c in calls if c[0] == "Salesforce/wikitext")[1]["split"] == "test"  # eval split
    assert ts.num_tokens > 0 and ("shuffle", 0) not in calls


def test_token_stream_for_evaluation(tok, files):
    txt, _ = files
    s = token_stream(str(txt), tok)
    docs = sources_mod.text_documents(txt.read_text())
    assert s.num_tokens == sum(len(tok(d)["input_ids"]) + 1 for d in docs)
    assert token_stream(f"{txt}:2", tok, seq_len=16).num_tokens == 32
    wins = list(s.windows(64, stride=32))
    assert wins[0] == (0, 64, 0) and wins[1] == (32, 96, 64) and wins[-1][1] == s.num_tokens
    with pytest.raises(MoECompressError, match="no window length"):
        token_stream(f"{txt}:2", tok)


def test_chat_template(tok, files):
    _, jsonl = files
    with pytest.raises(MoECompressError, match="no chat template"):
        load_calibration(f"{jsonl}#body", tok, 16, chat_template=True)
    tok2 = char_tokenizer()
    tok2.chat_template = "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    d = load_calibration(f"{jsonl}#body:1", tok2, 16, chat_template=True, padding=True)
    text = "".join(tok2.convert_ids_to_tokens(d.input_ids[0][d.attention_mask[0].bool()].tolist()))
    assert text.startswith("<u>record")
