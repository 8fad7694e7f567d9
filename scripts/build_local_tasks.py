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

Both tasks above sit at chance on the shipped fixtures (issue 17), so two tasks the fixtures can do
are built from the same held-out text (see docs/evaluation.md for the measured scores):

* ``fixture_cloze`` (multiple choice, loglikelihood; acc, acc_norm): the context is the ~800
  characters of the held-out document that precede one word of a prose sentence (verbatim, so the
  layout is the one the fixtures were trained on); the blank is that word, and the choices are it
  and 3 words drawn from the *same* document (frequency-weighted, distinct), each followed by the
  sentence's next 3 words, so topic alone does not give the answer away.
* ``fixture_nextword`` (generate_until, greedy; exact_match): the same kind of context; the answer
  is the word that follows it. Items sit at other places of the text than the cloze items.

Usage::

    python scripts/build_local_tasks.py                       # writes src/moecompress/fixtures/tasks/
    python scripts/build_local_tasks.py --heldout other.txt --out /tmp/tasks --n-mc 200 --n-gen 200 \
        --n-cloze 200 --n-nextword 200

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


# A whole alphabetic word (the cloze/next-word answer), followed by a space, punctuation or the end.
_CLOZE_WORD = re.compile(r"(?<![\w’'-])[A-Za-z]+(?=[\s,.;:!?)\"”’]|$)")
CLOZE_CONTEXT_CHARS = 800  # ~235 tokens at 3.4 bytes/token: inside the 256-token training windows
CLOZE_MIN_OFFSET = 200  # at least this much document text before the answer
RIGHT_WORDS = 3  # words of the sentence after the blank, in every cloze choice


def word_positions(text: str) -> tuple[list[str], list[tuple[int, int, str, str]], dict[int, list[str]]]:
    """Documents (verbatim), answer candidates (doc, char offset of the word, word) and each doc's word pool.

    A candidate is a word of a prose sentence (see `is_prose`) other than its first two words, preceded
    by a space, with the sentence text after it up to RIGHT_WORDS more words. The pool of a document is
    every such word of its prose sentences, with repetitions, so drawing from it is frequency-weighted.
    """
    docs = text.split("\n\n\n")
    cands: list[tuple[int, int, str, str]] = []
    pools: dict[int, list[str]] = {}
    for d, doc in enumerate(docs):
        pos = 0
        for para in doc.split("\n\n"):
            start = doc.index(para, pos)
            pos = start + len(para)
            if "\n" in para.strip():  # a paragraph that wraps lines is not plain prose
                continue
            spos = 0
            for sent in split_sentences(para):
                i = para.find(sent, spos)
                if i < 0:  # split_sentences glued an abbreviation across a run of spaces: skip it
                    continue
                spos = i + len(sent)
                if not is_prose(sent):
                    continue
                words = list(_CLOZE_WORD.finditer(sent))
                pools.setdefault(d, []).extend(m.group(0) for m in words)
                for m in words[2:]:
                    if sent[m.start() - 1] == " ":
                        rest = sent[m.end():].split(" ")  # the sentence after the word, its first RIGHT_WORDS words
                        right = " ".join(rest[:RIGHT_WORDS + 1])
                        cands.append((d, start + i + m.start() - 1, m.group(0), right))
    return docs, cands, pools


def context_before(doc: str, off: int, chars: int = CLOZE_CONTEXT_CHARS) -> str:
    """The document text before `off` (which points at the space before the answer), at most `chars`, cut at a space."""
    ctx = doc[max(0, off - chars):off]
    if off > chars:
        ctx = ctx[ctx.index(" ") + 1:] if " " in ctx else ctx
    return ctx.lstrip()


def build_cloze(text: str, n_cloze: int, n_next: int, seed: int) -> tuple[list[dict], list[dict]]:
    """`fixture_cloze` and `fixture_nextword` items (disjoint places of the text), deterministic in `seed`."""
    rng = random.Random(seed)
    docs, cands, pools = word_positions(text)
    rng.shuffle(cands)
    used: set[tuple[int, int]] = set()  # one item per 300-character block of a document
    per_doc: dict[tuple[str, int], int] = {}  # long books would otherwise dominate: at most 10 % per document
    cloze: list[dict] = []
    nextword: list[dict] = []
    for d, off, word, right in cands:
        if len(cloze) == n_cloze and len(nextword) == n_next:
            break
        block = (d, off // 300)
        if off < CLOZE_MIN_OFFSET or block in used:
            continue
        task = "cloze" if len(cloze) < n_cloze else "nextword"
        if per_doc.get((task, d), 0) >= max(1, (n_cloze if task == "cloze" else n_next) // 10):
            continue
        ctx = context_before(docs[d], off)
        if task == "cloze":
            seen = {word.lower()}
            others = [w for w in pools[d] if w.lower() != word.lower()]
            distractors = []
            for _ in range(200):  # frequency-weighted draws until 3 distinct words
                if len(distractors) == 3 or not others:
                    break
                w = rng.choice(others)
                if w.lower() not in seen:
                    seen.add(w.lower())
                    distractors.append(w)
            if len(distractors) < 3:
                continue
            words = distractors + [word]
            rng.shuffle(words)
            # the blank is followed by the sentence's next words in every choice, so a wrong word must also
            # fit what comes after it (a cloze with context on both sides)
            choices = [w + right for w in words]
            cloze.append({"id": len(cloze), "context": ctx, "choices": choices, "gold": words.index(word),
                          "source_doc": d})
        else:
            nextword.append({"id": len(nextword), "context": ctx, "answer": word, "source_doc": d})
        used.add(block)
        per_doc[task, d] = per_doc.get((task, d), 0) + 1
    return cloze, nextword


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


CLOZE_YAML = """\
# Same-document cloze built by scripts/build_local_tasks.py from the fixtures' held-out text.
# Fill the blank after ~800 characters of a held-out document: 4 choices, each a word followed by the
# sentence's next 3 words; the true word vs 3 words of that same document. Scored by loglikelihood
# (acc; acc_norm divides by the choice's bytes).
task: fixture_cloze
custom_dataset: !function loader.load
dataset_kwargs:
  data_file: fixture_cloze.jsonl
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

NEXTWORD_YAML = """\
# Next-word generation built by scripts/build_local_tasks.py from the fixtures' held-out text.
# Greedy generation after ~800 characters of a held-out document; the first word generated is
# compared with the word that really comes next (case-insensitive exact match).
task: fixture_nextword
custom_dataset: !function loader.load
dataset_kwargs:
  data_file: fixture_nextword.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", ".", ",", ";", ":", "?", "!"]
  do_sample: false
  max_gen_toks: 6
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


def write(out: Path, mc: list[dict], gen: list[dict], seed: int,
          cloze: list[dict] | None = None, nextword: list[dict] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tasks = [("fixture_mc", mc, MC_YAML), ("fixture_gen", gen, GEN_YAML)]
    if cloze is not None:
        tasks.append(("fixture_cloze", cloze, CLOZE_YAML))
    if nextword is not None:
        tasks.append(("fixture_nextword", nextword, NEXTWORD_YAML))
    for name, rows, _ in tasks:
        with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
    for name, _, yaml in tasks:
        (out / f"{name}.yaml").write_text(yaml.replace("{seed}", str(seed)), encoding="utf-8")
    loader = REPO / "src/moecompress/fixtures/tasks/loader.py"
    if out.resolve() != loader.parent.resolve():
        (out / "loader.py").write_text(loader.read_text(encoding="utf-8"), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", type=Path, default=DEFAULT_HELDOUT)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--n-mc", type=int, default=400)
    ap.add_argument("--n-gen", type=int, default=400)
    ap.add_argument("--n-cloze", type=int, default=400)
    ap.add_argument("--n-nextword", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    text = args.heldout.read_text(encoding="utf-8")
    mc, gen = build(text, args.n_mc, args.n_gen, args.seed)
    cloze, nextword = build_cloze(text, args.n_cloze, args.n_nextword, args.seed)
    write(args.out, mc, gen, args.seed, cloze, nextword)
    print(f"wrote {len(mc)} fixture_mc, {len(gen)} fixture_gen, {len(cloze)} fixture_cloze and "
          f"{len(nextword)} fixture_nextword items to {args.out}")


if __name__ == "__main__":
    main()
