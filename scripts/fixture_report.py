#!/usr/bin/env python3
"""Measure the shipped MoE fixture models: held-out perplexity, expert usage, sizes.

For each fixture directory (default: every ``src/moecompress/fixtures/*/config.json``):

* parameter counts (total / routed experts / routers / attention / embeddings+head / norms)
  and bytes on disk (model.safetensors and whole directory);
* held-out perplexity: ``heldout.txt`` is tokenized document by document, documents are
  joined with ``<|endoftext|>`` (as in training) and cut into non-overlapping windows of
  ``--seq-len`` tokens (the incomplete tail is dropped); perplexity = exp(mean NLL) over all
  predicted positions (``seq_len - 1`` per window);
* a unigram baseline perplexity on exactly the same predicted tokens, with add-one smoothed
  token frequencies estimated on the training text (``build/fixture_corpus/train.txt`` if
  present, else the shipped ``calib.txt``, which is training-distribution text);
* expert usage per layer, from forward hooks on ``model.model.layers[i].mlp.gate`` (the
  router returns ``(router_logits, top_k_weights, top_k_index)``): the share of top-k slots
  routed to each expert over all held-out tokens, its entropy normalised by log(num_experts)
  (1.0 = perfectly uniform), the number of experts with < 1 % of the slots, and the largest share.

Usage::

    OMP_WAIT_POLICY=PASSIVE python scripts/fixture_report.py            # markdown to stdout
    python scripts/fixture_report.py --json build/fixture_report.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "src/moecompress/fixtures"
DOC_SEP = "\n\n\n"


def stored_dtypes(st: Path) -> set[str]:
    """dtypes of the tensors in a safetensors file, from its header (the model is evaluated upcast to float32)."""
    from safetensors import safe_open

    with safe_open(str(st), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def read_docs(path: Path) -> list[str]:
    return [d.strip("\n") for d in path.read_text(encoding="utf-8").split(DOC_SEP) if d.strip()]


def token_stream(tok, path: Path) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(read_docs(path), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int64)


def param_breakdown(model) -> dict[str, int]:
    groups = {"total": 0, "experts": 0, "routers": 0, "attention": 0, "embeddings_and_head": 0, "norms": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        groups["total"] += n
        if ".mlp.experts." in name:
            groups["experts"] += n
        elif ".mlp.gate." in name or name.endswith(".mlp.gate.weight"):
            groups["routers"] += n
        elif ".self_attn." in name and "norm" not in name:
            groups["attention"] += n
        elif "embed_tokens" in name or name.startswith("lm_head"):
            groups["embeddings_and_head"] += n
        else:
            groups["norms"] += n
    return groups


def unigram_ppl(vocab_size: int, train_stream: np.ndarray, targets: np.ndarray) -> float:
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[targets].mean()))


@torch.no_grad()
def measure(fixture: Path, heldout: Path, unigram_src: Path, seq_len: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(fixture))
    model = AutoModelForCausalLM.from_pretrained(str(fixture), dtype=torch.float32)
    model.eval()
    cfg = model.config
    n_exp, top_k = cfg.num_experts, cfg.num_experts_per_tok

    stream = token_stream(tok, heldout)
    n_win = len(stream) // seq_len
    windows = torch.from_numpy(stream[: n_win * seq_len]).view(n_win, seq_len)

    layers = model.model.layers
    counts = torch.zeros(len(layers), n_exp, dtype=torch.float64)
    hooks = []
    for i, layer in enumerate(layers):
        def hook(_mod, _inp, out, i=i):
            _logits, _weights, index = out
            counts[i] += torch.bincount(index.reshape(-1), minlength=n_exp).double()
        hooks.append(layer.mlp.gate.register_forward_hook(hook))

    nll_sum, n_pred = 0.0, 0
    for s in range(0, n_win, batch):
        x = windows[s : s + batch]
        logits = model(input_ids=x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, x[:, 1:, None]).squeeze(-1)
        nll_sum += nll.double().sum().item()
        n_pred += nll.numel()
    for h in hooks:
        h.remove()

    targets = windows[:, 1:].reshape(-1).numpy()
    uni_stream = token_stream(tok, unigram_src)

    layer_stats = []
    for i in range(len(layers)):
        share = counts[i] / counts[i].sum()
        nz = share[share > 0]
        ent = float(-(nz * nz.log()).sum() / math.log(n_exp))
        layer_stats.append(dict(
            layer=i,
            usage_entropy_norm=round(ent, 4),
            experts_below_1pct=int((share < 0.01).sum()),
            max_share=round(float(share.max()), 4),
            min_share=round(float(share.min()), 4),
            share=[round(float(v), 4) for v in share],
        ))

    st = fixture / "model.safetensors"
    return dict(
        fixture=fixture.name,
        model_type=cfg.model_type,
        architecture=type(model).__name__,
        config=dict(
            num_hidden_layers=cfg.num_hidden_layers,
            num_experts=n_exp,
            num_experts_per_tok=top_k,
            norm_topk_prob=cfg.norm_topk_prob,
            hidden_size=cfg.hidden_size,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        ),
        params=param_breakdown(model),
        bytes_model_safetensors=st.stat().st_size,
        bytes_dir=sum(p.stat().st_size for p in fixture.iterdir() if p.is_file()),
        safetensors_dtype=",".join(sorted(stored_dtypes(st))),
        heldout_tokens=int(len(stream)),
        heldout_windows=int(n_win),
        seq_len=seq_len,
        predicted_tokens=int(n_pred),
        heldout_ppl=round(math.exp(nll_sum / n_pred), 3),
        heldout_nll=round(nll_sum / n_pred, 4),
        unigram_ppl=round(unigram_ppl(cfg.vocab_size, uni_stream, targets), 2),
        unigram_source=str(unigram_src.relative_to(REPO) if unigram_src.is_relative_to(REPO) else unigram_src),
        layers=layer_stats,
        mean_usage_entropy_norm=round(float(np.mean([l["usage_entropy_norm"] for l in layer_stats])), 4),
        seconds=round(time.time() - t0, 1),
    )


def markdown(results: list[dict]) -> str:
    out = ["| fixture | layers | experts | top-k | norm_topk_prob | hidden | expert intermediate | vocab | params (total) | params (experts) | model.safetensors bytes | dir bytes | held-out ppl | unigram ppl |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["config"]
        out.append(f"| {r['fixture']} | {c['num_hidden_layers']} | {c['num_experts']} | {c['num_experts_per_tok']} | "
                   f"{c['norm_topk_prob']} | {c['hidden_size']} | {c['moe_intermediate_size']} | {c['vocab_size']} | "
                   f"{r['params']['total']:,} | {r['params']['experts']:,} | {r['bytes_model_safetensors']:,} | "
                   f"{r['bytes_dir']:,} | {r['heldout_ppl']:.2f} | {r['unigram_ppl']:.1f} |")
    out.append("")
    out.append("| fixture | layer | usage entropy (normalised) | experts < 1 % | max share | min share |")
    out.append("|---|---|---|---|---|---|")
    for r in results:
        for l in r["layers"]:
            out.append(f"| {r['fixture']} | {l['layer']} | {l['usage_entropy_norm']:.4f} | {l['experts_below_1pct']} | "
                       f"{l['max_share']:.4f} | {l['min_share']:.4f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", nargs="*", type=Path, help="fixture dirs (default: all under src/moecompress/fixtures)")
    ap.add_argument("--heldout", type=Path, default=FIXTURES / "data/heldout.txt")
    ap.add_argument("--unigram-text", type=Path, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    fixtures = args.fixtures or sorted(p.parent for p in FIXTURES.glob("*/config.json"))
    uni = args.unigram_text
    if uni is None:
        train = REPO / "build/fixture_corpus/train.txt"
        uni = train if train.exists() else FIXTURES / "data/calib.txt"
    results = [measure(f, args.heldout, uni, args.seq_len, args.batch) for f in fixtures]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    for r in results:
        print(f"\n{r['fixture']}: {r['heldout_windows']} windows x {r['seq_len']} tokens, {r['predicted_tokens']:,} "
              f"predicted tokens; mean normalised usage entropy {r['mean_usage_entropy_norm']:.4f}; "
              f"unigram from {r['unigram_source']}; params {r['params']}; {r['seconds']} s")


if __name__ == "__main__":
    main()
