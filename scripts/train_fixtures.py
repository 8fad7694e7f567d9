#!/usr/bin/env python3
"""Deterministically train the two tiny MoE fixture models shipped with moecompress.

Outputs (``--out``, default ``src/moecompress/fixtures``)::

    tokenizer/          shared byte-level BPE tokenizer (build artefact, copied into each model dir)
    qwen3-moe-tiny/     Qwen3MoeForCausalLM  (norm_topk_prob=True)
    olmoe-tiny/         OlmoeForCausalLM     (norm_topk_prob=False)

Each model directory holds config.json, generation_config.json, model.safetensors and the tokenizer
files. Training runs in float32; the weights are saved cast to bfloat16, as real MoE checkpoints are
(``save_bf16`` in scripts/convert_fixtures_bf16.py, which also converts existing float32 fixtures), so ``AutoModelForCausalLM.from_pretrained(d)`` and
``AutoTokenizer.from_pretrained(d)`` work offline.

Inputs: ``build/fixture_corpus/{train,heldout}.txt`` from ``scripts/build_fixture_corpus.py``.

Determinism: fixed seeds, ``torch.use_deterministic_algorithms(True)``, one intra-op and one
inter-op thread, a fixed number of optimizer steps and a seeded data order.  Re-running the
same command with the same torch / transformers / tokenizers versions on the same kind of CPU
reproduces the weights bit for bit (different CPUs / library versions may differ in the last
bits of floating point).

Rebuild everything (about 45 min on one core)::

    OMP_WAIT_POLICY=PASSIVE python scripts/build_fixture_corpus.py
    OMP_WAIT_POLICY=PASSIVE nohup python scripts/train_fixtures.py --model all \\
        > build/train_fixtures.log 2>&1 &

Other useful invocations::

    python scripts/train_fixtures.py --tokenizer-only
    python scripts/train_fixtures.py --model qwen3-moe-tiny --bench 10   # throughput, nothing saved
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
DOC_SEP = "\n\n\n"  # document separator used by build_fixture_corpus.py
EOS = "<|endoftext|>"
PAD = "<|pad|>"

SEQ_LEN = 256
VOCAB_SIZE = 4096

# ----------------------------------------------------------------------------------------
# Model / training recipes.  Step counts were sized from measured single-thread throughput
# (~4.5k tok/s for qwen3-moe-tiny, ~3.8k tok/s for olmoe-tiny) for ~20 min each.
# ----------------------------------------------------------------------------------------
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
    output_router_logits=False,  # saved default; training turns it on per call
    use_cache=True,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=1,
)

RECIPES = {
    "qwen3-moe-tiny": dict(
        arch="qwen3_moe",
        config=dict(
            COMMON,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=512,  # dense MLP size; unused (every layer is MoE)
            moe_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            attention_bias=False,
        ),
        steps=2600,
        seed=1234,
    ),
    "olmoe-tiny": dict(
        arch="olmoe",
        config=dict(
            COMMON,
            num_key_value_heads=6,
            intermediate_size=96,  # OLMoE uses intermediate_size for each expert
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            clip_qkv=None,
            attention_bias=False,
        ),
        steps=2200,
        seed=4321,
    ),
}

TRAIN = dict(batch_size=8, lr=3e-3, min_lr_ratio=0.1, warmup=100, weight_decay=0.1, betas=(0.9, 0.95),
             grad_clip=1.0, eval_every=250, eval_windows=48, log_every=25)


def setup_determinism(seed: int) -> None:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ----------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------
def read_docs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [d.strip("\n") for d in text.split(DOC_SEP) if d.strip()]


def train_tokenizer(train_txt: Path, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    docs = read_docs(train_txt)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=COMMON["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    assert fast.convert_tokens_to_ids(EOS) == COMMON["eos_token_id"]
    assert fast.convert_tokens_to_ids(PAD) == COMMON["pad_token_id"]
    assert len(fast) == VOCAB_SIZE, len(fast)
    return fast


def encode_docs(tok, path: Path) -> np.ndarray:
    """Token stream: doc0 <eos> doc1 <eos> ..."""
    ids: list[int] = []
    eos = tok.eos_token_id
    for enc in tok.backend_tokenizer.encode_batch(read_docs(path), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


# ----------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------
def build_model(name: str):
    from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    r = RECIPES[name]
    if r["arch"] == "qwen3_moe":
        cfg, cls = Qwen3MoeConfig(**r["config"]), Qwen3MoeForCausalLM
    else:
        cfg, cls = OlmoeConfig(**r["config"]), OlmoeForCausalLM
    torch.manual_seed(r["seed"])
    model = cls(cfg)
    return model.float()


def batches(stream: np.ndarray, batch_size: int, seed: int):
    """Infinite deterministic iterator over (B, SEQ_LEN) windows; each epoch uses a different
    window phase and a seeded permutation."""
    epoch = 0
    while True:
        offset = (epoch * 97) % SEQ_LEN
        n = (len(stream) - offset) // SEQ_LEN
        windows = torch.from_numpy(stream[offset : offset + n * SEQ_LEN].astype(np.int64)).view(n, SEQ_LEN)
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch_size + 1, batch_size):
            yield epoch, windows[perm[i : i + batch_size]]
        epoch += 1


def lr_at(step: int, total: int) -> float:
    t = TRAIN
    if step < t["warmup"]:
        return t["lr"] * (step + 1) / t["warmup"]
    p = (step - t["warmup"]) / max(1, total - t["warmup"])
    return t["lr"] * (t["min_lr_ratio"] + (1 - t["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def eval_ppl(model, stream: np.ndarray, n_windows: int | None) -> float:
    model.eval()
    n = len(stream) // SEQ_LEN
    if n_windows is not None:
        idx = np.linspace(0, n - 1, num=min(n, n_windows)).astype(int)
    else:
        idx = np.arange(n)
    nll, cnt = 0.0, 0
    for s in range(0, len(idx), 8):
        x = torch.stack([torch.from_numpy(stream[i * SEQ_LEN : (i + 1) * SEQ_LEN].astype(np.int64)) for i in idx[s : s + 8]])
        out = model(input_ids=x, labels=x, output_router_logits=False)
        k = x.shape[0] * (SEQ_LEN - 1)
        nll += out.loss.item() * k
        cnt += k
    model.train()
    return math.exp(nll / cnt)


def param_digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_one(name: str, tok, train_ids, held_ids, out_root: Path, tok_dir: Path, bench: int | None) -> dict:
    r = RECIPES[name]
    setup_determinism(r["seed"])
    model = build_model(name)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{name}] params={n_params:,} experts_impl={model.config._experts_implementation} "
        f"attn={model.config._attn_implementation} train_tokens={len(train_ids):,}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": TRAIN["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=TRAIN["lr"], betas=TRAIN["betas"], eps=1e-8, foreach=False,
    )
    total = bench or r["steps"]
    it = batches(train_ids, TRAIN["batch_size"], r["seed"])
    coef = model.config.router_aux_loss_coef
    t0 = time.time()
    tokens = 0
    hist = []
    lm_acc = aux_acc = 0.0
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total)
        epoch, x = next(it)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        aux = out.aux_loss.item()
        lm_acc += out.loss.item() - coef * aux
        aux_acc += aux
        if (step + 1) % TRAIN["log_every"] == 0 or step + 1 == total:
            k = (step % TRAIN["log_every"]) + 1
            el = time.time() - t0
            log(f"[{name}] step {step + 1}/{total} ep {epoch} lm {lm_acc / k:.4f} aux {aux_acc / k:.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} tok/s {tokens / el:.0f} elapsed {el:.0f}s")
            hist.append(dict(step=step + 1, lm=round(lm_acc / k, 4), aux=round(aux_acc / k, 4)))
            lm_acc = aux_acc = 0.0
        if not bench and ((step + 1) % TRAIN["eval_every"] == 0 or step + 1 == total):
            log(f"[{name}] step {step + 1} heldout ppl (subset of {TRAIN['eval_windows']} windows) "
                f"{eval_ppl(model, held_ids, TRAIN['eval_windows']):.2f}")
    wall = time.time() - t0
    if bench:
        log(f"[{name}] bench: {bench} steps, {tokens / wall:.0f} tok/s, {wall / bench:.3f} s/step -> "
            f"{r['steps']} steps would take ~{r['steps'] * wall / bench / 60:.1f} min; param digest {param_digest(model)}")
        return {}

    out_dir = out_root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.eval()
    digest = param_digest(model)  # of the float32 training result
    info = dict(model=name, steps=total, tokens_seen=tokens, train_wall_s=round(wall, 1), params=n_params,
                param_sha256_16=digest, final_subset_ppl=None, history=hist,
                torch=torch.__version__)
    import transformers, tokenizers
    info.update(transformers=transformers.__version__, tokenizers=tokenizers.__version__)
    info["final_subset_ppl"] = round(eval_ppl(model, held_ids, TRAIN["eval_windows"]), 3)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from convert_fixtures_bf16 import save_bf16

    save_bf16(model, out_dir)  # casts `model` to bf16 in place: real checkpoints are stored in bf16
    tok.save_pretrained(str(out_dir))
    verify_reload(model, out_dir)
    log(f"[{name}] saved to {out_dir} in {wall / 60:.1f} min; param digest {digest}")
    return info


def verify_reload(model, out_dir: Path) -> None:
    """Reload with from_pretrained (stored dtype) and check the state dict and logits match exactly."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    expected = set(model.state_dict().keys())
    if saved != expected:
        log(f"NOTE: safetensors keys differ from state_dict: only-saved={sorted(saved - expected)[:6]} "
            f"only-model={sorted(expected - saved)[:6]}")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype="auto")
    reloaded.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(2, VOCAB_SIZE, (2, 64), generator=g)
    with torch.no_grad():
        a = model(input_ids=x).logits
        b = reloaded(input_ids=x).logits
    diff = (a - b).abs().max().item()
    sd_a, sd_b = model.state_dict(), reloaded.state_dict()
    same = all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    log(f"reload check {out_dir.name}: max|dlogits|={diff:.3e} state_dict identical={same}")
    if diff != 0.0 or not same:
        raise SystemExit(f"reload mismatch for {out_dir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO / "build/fixture_corpus")
    ap.add_argument("--out", type=Path, default=REPO / "src/moecompress/fixtures")
    ap.add_argument("--model", choices=[*RECIPES, "all"], default="all")
    ap.add_argument("--tokenizer-only", action="store_true")
    ap.add_argument("--reuse-tokenizer", action="store_true",
                    help="load build/fixture_tokenizer instead of retraining it (it is deterministic anyway)")
    ap.add_argument("--bench", type=int, default=None, help="run N steps, report throughput, save nothing")
    args = ap.parse_args()

    setup_determinism(0)
    from transformers import PreTrainedTokenizerFast

    tok_dir = REPO / "build/fixture_tokenizer"
    t0 = time.time()
    if args.reuse_tokenizer and (tok_dir / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    else:
        tok = train_tokenizer(args.corpus / "train.txt", tok_dir)
    th = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    log(f"tokenizer: vocab={len(tok)} sha256(tokenizer.json)={th} ({time.time() - t0:.0f}s)")
    if args.tokenizer_only:
        return

    t0 = time.time()
    train_ids = encode_docs(tok, args.corpus / "train.txt")
    held_ids = encode_docs(tok, args.corpus / "heldout.txt")
    nbytes = (args.corpus / "train.txt").stat().st_size
    log(f"encoded: train {len(train_ids):,} tokens ({nbytes / len(train_ids):.2f} bytes/token), "
        f"heldout {len(held_ids):,} tokens ({time.time() - t0:.0f}s)")

    names = list(RECIPES) if args.model == "all" else [args.model]
    results = {}
    for name in names:
        results[name] = train_one(name, tok, train_ids, held_ids, args.out, tok_dir, args.bench)
    if not args.bench:
        summary = REPO / "build/train_fixtures_summary.json"
        old = json.loads(summary.read_text()) if summary.exists() else {}
        old.update(results)
        old["tokenizer_sha256_16"] = th
        summary.write_text(json.dumps(old, indent=1) + "\n")
        log(f"summary written to {summary}")


if __name__ == "__main__":
    sys.exit(main())
