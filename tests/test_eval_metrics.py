"""Perplexity / next-token accuracy / KL over windows: known answers against direct computations."""

import math

import pytest
import torch

from moecompress.errors import MoECompressError
from moecompress.eval.metrics import evaluate_stream, token_stream, windows
from moecompress.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (70,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("n,window,stride", [(70, 16, 16), (70, 16, 5), (17, 16, 8), (2, 4, 1), (100, 7, 7)])
def test_windows_score_every_token_once(n, window, stride):
    scored = []
    for b, e, first in windows(n, window, stride):
        assert 0 <= b < first < e <= n and e - b <= window
        scored += list(range(first, e))
    assert scored == list(range(1, n))


def test_perplexity_single_window_equals_full_forward(model, ids):
    x = ids[:40]
    with torch.no_grad():
        logits = model(input_ids=x[None]).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], x[1:])
    acc = (logits[:-1].argmax(-1) == x[1:]).float().mean()
    r = evaluate_stream(model, x.tolist(), window=64, progress=False)
    assert r["n_tokens"] == 39 and r["n"] == 1
    assert r["aggregate"]["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-5)
    assert r["aggregate"]["acc"] == pytest.approx(acc.item())
    assert "kl" not in r["aggregate"]


def test_strided_perplexity_equals_hf_labels_loss(model, ids):
    """The HF perplexity-guide recipe (labels -100 on context tokens, model's own loss) gives the same number."""
    window, stride = 16, 6
    total, count = 0.0, 0
    with torch.no_grad():
        for b, e, first in windows(ids.numel(), window, stride):
            x = ids[b:e][None]
            labels = x.clone()
            labels[0, : first - b] = -100
            n = e - first
            total += model(input_ids=x, labels=labels).loss.item() * n
            count += n
    r = evaluate_stream(model, ids, window=window, stride=stride, batch_size=3, progress=False)
    assert r["n_tokens"] == count == ids.numel() - 1
    assert r["aggregate"]["nll"] == pytest.approx(total / count, rel=1e-5)
    assert r["aggregate"]["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # per-window items: ids name the stream and the window start; token-weighted means recover the aggregate
    items = r["items"]
    assert len(items["ids"]) == r["n"] == len(items["nll"]) == len(items["n_tokens"])
    assert all(i.startswith(r["fingerprint"] + ":") for i in items["ids"])
    wmean = sum(v * n for v, n in zip(items["nll"], items["n_tokens"])) / sum(items["n_tokens"])
    assert wmean == pytest.approx(r["aggregate"]["nll"], rel=1e-9)


def test_kl_is_zero_against_itself_and_positive_against_another_model(model, ids):
    same = evaluate_stream(model, ids, reference=model, window=32, stride=16, progress=False)
    assert same["aggregate"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert max(same["items"]["kl"]) < 1e-6
    other = tiny_model("qwen3_moe", seed=1)
    r = evaluate_stream(other, ids[:20], reference=model, window=32, progress=False)
    with torch.no_grad():
        logq = torch.log_softmax(model(input_ids=ids[None, :20]).logits[0, :-1], -1)
        logp = torch.log_softmax(other(input_ids=ids[None, :20]).logits[0, :-1], -1)
    direct = torch.nn.functional.kl_div(logp, logq, log_target=True, reduction="batchmean")
    assert r["aggregate"]["kl"] == pytest.approx(direct.item(), rel=1e-5) and r["aggregate"]["kl"] > 0


def char_tokenizer():
    """Printable ASCII -> ids 3..97 mod 96 vocabulary (0 pad, 1 bos, 2 eos), a real HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        t: i for i, t in enumerate(["<pad>", "<s>", "</s>"] + [chr(c) for c in range(32, 124)] + ["<unk>"])
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_text_file_with_a_tokenizer(model, tmp_path):
    tok = char_tokenizer()
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    ids, info = token_stream(str(f), tok)
    assert ids.numel() >= 100 and info["source"] == str(f)
    r = evaluate_stream(model, str(f), tok, window=32, progress=False)
    assert r["source"] == str(f) and r["n_tokens"] == ids.numel() - 1


def test_bad_inputs_give_sentences(model, ids):
    with pytest.raises(MoECompressError, match="at least 2"):
        evaluate_stream(model, [5], window=8, progress=False)
    with pytest.raises(MoECompressError, match="tokenizer"):
        evaluate_stream(model, "some_file.txt", None, window=8, progress=False)
    with pytest.raises(MoECompressError, match="stride"):
        windows(10, 8, 9)
    bigger = tiny_model("qwen3_moe", seed=0, vocab_size=100)
    with pytest.raises(MoECompressError, match="vocabulary"):
        evaluate_stream(model, ids[:10], reference=bigger, window=8, progress=False)


def test_memory_and_latency(model, tmp_path):
    import time

    from moecompress.eval.bench import benchmark, disk_bytes, peak_memory, resident_bytes

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    bufs = sum(b.numel() * b.element_size() for b in model.buffers())
    assert params <= resident_bytes(model) <= params + bufs

    def spike():
        x = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        time.sleep(0.05)
        return float(x[-1])

    out, mem = peak_memory(spike)
    assert out == 1.0 and mem["kind"] == "cpu_rss" and mem["peak_delta_bytes"] >= 48 * 1024 * 1024
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    r = benchmark(model, tmp_path, prompt_len=8, new_tokens=4, warmup=1, repeats=1)
    assert r["bytes"]["disk"] == disk_bytes(tmp_path) == 1000
    lat = r["latency"]
    assert lat["prefill_tok_s"] > 0 and lat["decode_tok_s"] > 0 and lat["new_tokens"] == 4
