#!/usr/bin/env python3
"""Build the two local lm-eval tasks shipped next to the fixtures, from their held-out text.

Deterministic: same held-out text + same seed -> byte-identical JSONL and YAML.

* ``fixture_mc``  (multiple choice, loglikelihood; acc, acc_norm): the context is 2-3 consecutive
  sentences of one held-out paragraph; the choices are the sentence that really follows them and
  3 sentences of similar length drawn from *other* held-out documents; the gold position is
  shuffled.
* ``fixture_gen`` (generate_until, greedy; exact_match): the context is up to two preceding
  sentences plus one sentence with its last word removed; the answer is that last word. Half of
  the items are drawn from sentences whose last word also occurs earlier in the context (a copy
  cue a small model can use, so the metric is not all zeros); the other half from those where it
  does not. Each document records which (`cue`).

Usage::

    python scripts/build_local_tasks.py                       # writes src/moecompress/fixtures/tasks/
    python scripts/build_local_tasks.py --heldout other.txt --out /tmp/tasks --n-mc 200 --n-gen 200

See docs/evaluation.md ("Local tasks") for the construction rules.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_HELDOUT = REPO / "src/moecompress/fixtures/data/heldout.txt"
DEFAULT_OUT = REPO / "src/moecompress/fixtures/tasks"

# A sentence: a non-space start, then as little as possible up to terminal punctuation (plus closing
# quotes/brackets) that is followed by whitespace and a capital (or an opening quote), or the end.
_SENTENCE = re.compile(r"\S.*?[.!?][\"”’)]*(?=\s+[\"“‘(]?[A-Z]|\s*$)", re.S)
_ABBREV = re.compile(r"(\b(e\.g|i\.e|etc|vs|Mr|Mrs|Dr|St|n|v|adj|adv|No|Fig|cf)\.)$")
_BAD = re.compile(r"[_*=<>{}\[\]|\\#@$%^~`]|\(\)|::|\.\w+\(|//")
_WORD_END = re.compile(r"^(.*\S)\s+([A-Za-z][a-z'’-]*[a-z])([.!?][\"”’)]*)$", re.S)


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(document index, paragraph with newlines folded to spaces) for every paragraph."""
    out = []
    for d, doc in enumerate(text.split("\n\n\n")):
        for para in re.split(r"\n\s*\n", doc):
            para = " ".join(para.split())
            if para:
                out.append((d, para))
    return out


def split_sentences(para: str) -> list[str]:
    sents, buf = [], ""
    for m in _SENTENCE.finditer(para):
        s = m.group(0).strip()
        buf = f"{buf} {s}".strip() if buf else s
        if _ABBREV.search(buf):  # "e.g." is not a sentence end: glue to the next piece
            continue
        sents.append(buf)
        buf = ""
    if buf:
        sents.append(buf)
    return sents


def is_prose(s: str, lo: int = 5, hi: int = 40) -> bool:
    """Plain English sentence: 5-40 words, no code-like characters, mostly letters."""
    words = s.split()
    if not (lo <= len(words) <= hi) or _BAD.search(s):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in s)
    return letters >= 0.85 * len(s) and (s[0].isupper() or s[0] in "\"“‘(")


def build(text: str, n_mc: int, n_gen: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    paras = [(d, split_sentences(p)) for d, p in paragraphs(text)]
    pool = [(d, s) for d, ss in paras for s in ss if is_prose(s)]

    # multiple choice: (doc, context sentences, true next sentence)
    mc_cands = []
    for d, ss in paras:
        for j in range(2, len(ss)):
            ctx = ss[max(0, j - 3):j]
            if all(is_prose(s, 3, 60) for s in ctx) and is_prose(ss[j]):
                mc_cands.append((d, " ".join(ctx), ss[j]))
    rng.shuffle(mc_cands)
    mc = []
    for d, ctx, true in mc_cands:
        if len(mc) == n_mc:
            break
        n = len(true)
        others = [s for dd, s in pool if dd != d and 0.67 * n <= len(s) <= 1.5 * n and s != true]
        if len(others) < 3:
            continue
        distractors = rng.sample(others, 3)
        choices = distractors + [true]
        rng.shuffle(choices)
        mc.append({"id": len(mc), "context": ctx, "choices": choices, "gold": choices.index(true), "source_doc": d})

    # generative: (doc, context, answer, cue)
    gen_cands = {True: [], False: []}
    for d, ss in paras:
        for j, s in enumerate(ss):
            m = _WORD_END.match(s)
            if not m or not is_prose(s, 6, 40):
                continue
            head, answer = m.group(1), m.group(2)
            prev = [p for p in ss[max(0, j - 2):j] if is_prose(p, 3, 60)]
            ctx = " ".join(prev + [head])
            cue = re.search(rf"\b{re.escape(answer)}\b", ctx, re.I) is not None
            gen_cands[cue].append((d, ctx, answer, cue))
    for k in (True, False):
        rng.shuffle(gen_cands[k])
    half = n_gen // 2
    picked = gen_cands[True][:half] + gen_cands[False][: n_gen - half]
    rng.shuffle(picked)
    gen = [{"id": i, "context": c, "answer": a, "cue": cue, "source_doc": d} for i, (d, c, a, cue) in enumerate(picked)]
    return mc, gen


MC_YAML = """\
# Multiple-choice continuation built by scripts/build_local_tasks.py from the fixtures' held-out text.
# Pick the sentence that really follows the context among 4 (3 come from other held-out documents).
task: fixture_mc
custom_dataset: !function loader.load
dataset_kwargs:
  data_file: fixture_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  seed: {seed}
"""

GEN_YAML = """\
# Last-word completion built by scripts/build_local_tasks.py from the fixtures' held-out text.
# Greedy generation; the first word generated is compared with the sentence's real last word.
task: fixture_gen
custom_dataset: !function loader.load
dataset_kwargs:
  data_file: fixture_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", ".", ",", ";", ":", "?", "!"]
  do_sample: false
  max_gen_toks: 8
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "([A-Za-z][A-Za-z'’-]*)"
        group_select: 0
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
  seed: {seed}
"""


def write(out: Path, mc: list[dict], gen: list[dict], seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("fixture_mc", mc), ("fixture_gen", gen)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
    (out / "fixture_mc.yaml").write_text(MC_YAML.replace("{seed}", str(seed)), encoding="utf-8")
    (out / "fixture_gen.yaml").write_text(GEN_YAML.replace("{seed}", str(seed)), encoding="utf-8")
    loader = REPO / "src/moecompress/fixtures/tasks/loader.py"
    if out.resolve() != loader.parent.resolve():
        (out / "loader.py").write_text(loader.read_text(encoding="utf-8"), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", type=Path, default=DEFAULT_HELDOUT)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--n-mc", type=int, default=400)
    ap.add_argument("--n-gen", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    mc, gen = build(args.heldout.read_text(encoding="utf-8"), args.n_mc, args.n_gen, args.seed)
    write(args.out, mc, gen, args.seed)
    print(f"wrote {len(mc)} fixture_mc and {len(gen)} fixture_gen items to {args.out}")


if __name__ == "__main__":
    main()
