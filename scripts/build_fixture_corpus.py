#!/usr/bin/env python3
"""Build the English text corpus used to train the moecompress fixture models.

The text comes only from Debian packages (fetched with ``apt-get download``,
unpacked with ``dpkg-deb -x``; no web, no model hub):

* ``python3.11-doc``  - the CPython 3.11 documentation (HTML), PSF License.
* ``sword-text-web``  - the World English Bible (SWORD zText module), public domain.
* ``dict-devil``      - Ambrose Bierce, "The Devil's Dictionary" (1911), public domain.

Markup is removed (HTML -> plain text, OSIS -> plain text, dictd -> plain text).
Every source is cut into *documents* (one HTML page, one Bible book, one
dictionary letter).  Documents are assigned to train / calib / heldout by a
keyed SHA-256 of their id, so the split is deterministic and heldout/calib
documents never appear in train.

Output (the training text is NOT shipped; ``build/`` is meant to be gitignored)::

    build/fixture_corpus/train.txt        ~14 MB
    build/fixture_corpus/calib.txt        ~0.9 MB
    build/fixture_corpus/heldout.txt      ~0.9 MB
    build/fixture_corpus/manifest.json    doc id -> split, bytes, sha256 of inputs
    src/moecompress/fixtures/data/{calib,heldout}.txt   (copies that ship)

File format: UTF-8 plain text; documents are separated by two empty lines
("\\n\\n\\n"); inside a document there is never more than one empty line.

Usage (re-runnable; downloads go to build/fixture_corpus/debs and are reused)::

    python scripts/build_fixture_corpus.py
    python scripts/build_fixture_corpus.py --deb-dir /path/with/predownloaded/debs
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unicodedata
import zlib
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Pinned Debian 12 (bookworm) versions used to build the shipped fixtures.  If a
# pinned version is no longer served, the current candidate is used and the
# difference is recorded in the manifest (the sha256 of each .deb is recorded).
PACKAGES = {
    "python3.11-doc": "3.11.2-6+deb12u9",
    "sword-text-web": "426.0-1",
    "dict-devil": "1.0-13.1",
}

DOC_SEP = "\n\n\n"
SPLIT_KEY = "moecompress-fixture-split-v1"


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def normalise(text: str) -> str:
    """NFC, unify whitespace, strip trailing spaces, collapse >1 empty lines."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "")
    text = text.replace("\t", "    ")
    text = text.replace("\u00b6", "")  # sphinx permalink pilcrow
    lines = [ln.rstrip() for ln in text.split("\n")]
    out: list[str] = []
    blank = 0
    for ln in lines:
        if ln.strip() == "":
            blank += 1
            if blank == 1 and out:
                out.append("")
            continue
        blank = 0
        out.append(ln)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out)


def fetch_debs(deb_dir: Path) -> dict[str, Path]:
    deb_dir.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    for name, version in PACKAGES.items():
        cands = sorted(deb_dir.glob(f"{name}_*.deb"))
        if version is not None:
            pinned = [c for c in cands if c.name.split("_")[1] == version.replace(":", "%3a")]
            cands = pinned or cands
        if not cands:
            spec = f"{name}={version}" if version else name
            print(f"[corpus] apt-get download {spec}", file=sys.stderr)
            r = subprocess.run(["apt-get", "download", spec], cwd=deb_dir, capture_output=True, text=True)
            if r.returncode != 0 and version:
                print(f"[corpus] pinned {spec} unavailable ({r.stderr.strip()}); using candidate", file=sys.stderr)
                r = subprocess.run(["apt-get", "download", name], cwd=deb_dir, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"apt-get download {name} failed:\n{r.stderr}\n(run 'apt-get update' first?)")
            cands = sorted(deb_dir.glob(f"{name}_*.deb"))
        found[name] = cands[-1]
    return found


def unpack(deb: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return dest


# --------------------------------------------------------------------------------------
# CPython documentation (Sphinx HTML)
# --------------------------------------------------------------------------------------
BLOCK_TAGS = {
    "p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt",
    "dd", "table", "tr", "blockquote", "figure", "figcaption", "caption", "br", "hr", "aside",
}
SKIP_TAGS = {"script", "style", "nav", "footer", "head", "form", "button", "svg"}
SKIP_CLASSES = {"headerlink", "sphinxsidebar", "related", "footer", "linenos", "copybutton", "clearer"}


class SphinxText(HTMLParser):
    """Extract readable text from the <div role="main"> body of a Sphinx page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, in_main_start, skipping_start)
        self.in_main = 0
        self.skip = 0
        self.pre = 0
        self.cell = 0
        self.row_cells = 0

    VOID = {"br", "hr", "img", "meta", "link", "input", "wbr", "col", "area", "base", "source"}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        starts_main = a.get("role") == "main"
        starts_skip = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        if tag in self.VOID:
            if self.in_main and not self.skip and tag in ("br", "hr"):
                self.parts.append("\n")
            return
        self.stack.append((tag, starts_main, starts_skip))
        if starts_main:
            self.in_main += 1
        if starts_skip:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in ("td", "th"):
            self.cell += 1
        if self.in_main and not self.skip:
            if tag == "tr":
                self.row_cells = 0
            if tag in ("td", "th"):
                # table rows become one line: "cell | cell | cell"
                if self.row_cells:
                    self.parts.append(" | ")
                self.row_cells += 1
            elif self.cell and tag in BLOCK_TAGS and tag not in ("tr", "table"):
                self.parts.append(" ")
            elif tag in BLOCK_TAGS or tag == "pre":
                self.parts.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "dl", "table", "section") else "\n")
            if tag == "li":
                self.parts.append("- ")

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        # pop until matching tag (HTML may be slightly unbalanced)
        while self.stack:
            t, m, s = self.stack.pop()
            if t in ("td", "th"):
                self.cell -= 1
            elif self.in_main and not self.skip and (t in BLOCK_TAGS or t == "pre"):
                self.parts.append(" " if self.cell and t not in ("tr", "table") else "\n")
            if m:
                self.in_main -= 1
            if s:
                self.skip -= 1
            if t == "pre":
                self.pre -= 1
            if t == tag:
                break

    def handle_data(self, data):
        if not self.in_main or self.skip:
            return
        if self.pre:
            self.parts.append(data)
        else:
            self.parts.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        return "".join(self.parts)


PYDOC_EXCLUDE = re.compile(
    r"^(genindex.*|py-modindex|search|contents|index|download|copyright|license|bugs|about"
    r"|whatsnew/changelog|distutils/.*|install/.*)\.html$"
)


def pydoc_documents(root: Path) -> list[tuple[str, str]]:
    html_root = root / "usr/share/doc/python3.11/html"
    docs = []
    for p in sorted(html_root.rglob("*.html")):
        rel = p.relative_to(html_root).as_posix()
        if rel.startswith("_") or PYDOC_EXCLUDE.match(rel):
            continue
        parser = SphinxText()
        parser.feed(p.read_text(encoding="utf-8"))
        parser.close()
        lines = []
        for ln in parser.text().split("\n"):
            # left-strip prose lines but keep code indentation: only strip lines that are not
            # inside code (heuristic: indentation produced by HTML is a single space)
            ln = ln[1:] if ln.startswith(" ") and not ln.startswith("  ") else ln
            if " | " in ln:  # table row produced above
                ln = re.sub(r" +\| +", " | ", ln).strip()
            lines.append(ln)
        text = normalise("\n".join(lines))
        if len(text) < 500:
            continue
        docs.append((f"pydoc/{rel[:-5]}", text))
    return docs


# --------------------------------------------------------------------------------------
# World English Bible (SWORD zText, OSIS markup)
# --------------------------------------------------------------------------------------
def _osis_to_text(s: str) -> str:
    s = re.sub(r"<note\b[^>]*?/>", "\x00", s)
    s = re.sub(r"<note\b.*?</note>", "\x00", s, flags=re.S)  # footnotes / cross references
    s = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", s, flags=re.S)
    s = re.sub(r"<div\b[^>]*type=\"(?:x-p|paragraph|x-m|x-pi|x-li|introduction|book)\"[^>]*/>", "\n\n", s)
    s = re.sub(r"<lg\b[^>]*/?>|</lg>", "\n\n", s)
    s = re.sub(r"<l\b[^>]*\beID=[^>]*/>|<lb\b[^>]*/>|</l>|<chapter\b[^>]*/>", "\n", s)
    s = re.sub(r"<item\b[^>]*>", "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = html.unescape(s)
    s = re.sub(r"(?<=\w)\x00+(?=\w)", " ", s)  # a removed note between two words
    s = s.replace("\x00", "")
    s = re.sub(r"[ \t]+", " ", s)
    s = re.sub(r" *\n *", "\n", s)
    s = re.sub(r"\n\n+", "\n\n", s)
    return s


def web_documents(root: Path) -> list[tuple[str, str]]:
    mod = root / "usr/share/sword/modules/texts/ztext/engWEB2015eb"
    docs = []
    for testament in ("ot", "nt"):
        bzs = (mod / f"{testament}.bzs").read_bytes()
        bzz = (mod / f"{testament}.bzz").read_bytes()
        bzv = (mod / f"{testament}.bzv").read_bytes()
        blocks: list[bytes] = []
        for i in range(len(bzs) // 12):
            off, size, _usize = struct.unpack("<III", bzs[12 * i : 12 * i + 12])
            blocks.append(zlib.decompress(bzz[off : off + size]))
        # verse index: (block u32, offset u32, size u16) per verse, in canonical order
        per_block: dict[int, list[str]] = {}
        for j in range(len(bzv) // 10):
            b, off, size = struct.unpack("<IIH", bzv[10 * j : 10 * j + 10])
            if size == 0:
                continue
            per_block.setdefault(b, []).append(blocks[b][off : off + size].decode("utf-8"))
        for b in sorted(per_block):
            raw = " ".join(per_block[b])
            text = normalise(_osis_to_text(raw))
            if len(text) < 500:
                continue
            m = re.search(r'<milestone n="([^"]+)" type="x-usfm-toc2"', raw) or re.search(
                r'<title[^>]*type="main"[^>]*>(.*?)</title>', raw, flags=re.S)
            title = re.sub(r"<[^>]+>", "", m.group(1)) if m else text.split("\n", 1)[0][:40]
            slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
            docs.append((f"web/{testament}/{b:03d}-{slug}", text))
    return docs


# --------------------------------------------------------------------------------------
# The Devil's Dictionary (dictd format)
# --------------------------------------------------------------------------------------
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    v = 0
    for ch in s:
        v = v * 64 + _B64.index(ch)
    return v


def devil_documents(root: Path) -> list[tuple[str, str]]:
    d = root / "usr/share/dictd"
    data = gzip.open(d / "devil.dict.dz").read()
    entries = []
    for line in (d / "devil.index").read_text(encoding="latin-1").splitlines():
        head, off, size = line.split("\t")[:3]
        if head.startswith("00"):
            continue
        entries.append((_b64(off), _b64(size), head))
    entries = sorted(set(entries))
    by_letter: dict[str, list[str]] = {}
    for off, size, head in entries:
        body = data[off : off + size].decode("latin-1")
        letter = head[:1].upper() if head[:1].isalpha() else "misc"
        by_letter.setdefault(letter, []).append(body.strip("\n"))
    docs = []
    for letter in sorted(by_letter):
        text = normalise("\n\n".join(by_letter[letter]))
        text = text.replace("_", "")  # italics markers
        docs.append((f"devil/{letter}", text))
    return docs


# --------------------------------------------------------------------------------------
# split
# --------------------------------------------------------------------------------------
def split_docs(docs, heldout_bytes: int, calib_bytes: int, max_doc_bytes: int):
    """Deterministic per-source split: heldout and calib each take ~equal fractions of every
    source (so they match the training distribution), choosing documents in keyed-hash order,
    skipping documents larger than ``max_doc_bytes`` (they stay in train)."""
    total = sum(len(t.encode()) for _, t in docs)
    sources: dict[str, list[tuple[str, str]]] = {}
    for doc_id, text in docs:
        sources.setdefault(doc_id.split("/", 1)[0], []).append((doc_id, text))
    assign: dict[str, str] = {}
    for src, sdocs in sorted(sources.items()):
        sbytes = sum(len(t.encode()) for _, t in sdocs)
        want = {"heldout": heldout_bytes * sbytes / total, "calib": calib_bytes * sbytes / total}
        have = {"heldout": 0, "calib": 0}
        order = sorted(sdocs, key=lambda d: hashlib.sha256(f"{SPLIT_KEY}/{d[0]}".encode()).hexdigest())
        turn = 0
        for doc_id, text in order:
            n = len(text.encode())
            split = "train"
            if n <= max_doc_bytes:
                for k in (("heldout", "calib") if turn % 2 == 0 else ("calib", "heldout")):
                    if have[k] + n <= want[k] * 1.15 and have[k] < want[k]:
                        split = k
                        have[k] += n
                        turn += 1
                        break
            assign[doc_id] = split
    return assign


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "build/fixture_corpus")
    ap.add_argument("--deb-dir", type=Path, default=None, help="directory with (or for) the .deb files")
    ap.add_argument("--data-dir", type=Path, default=REPO / "src/moecompress/fixtures/data",
                    help="where the shipped calib.txt / heldout.txt copies go")
    ap.add_argument("--heldout-bytes", type=int, default=900_000)
    ap.add_argument("--calib-bytes", type=int, default=900_000)
    ap.add_argument("--max-doc-bytes", type=int, default=120_000)
    args = ap.parse_args()

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    deb_dir = args.deb_dir or out / "debs"
    debs = fetch_debs(deb_dir)

    with tempfile.TemporaryDirectory(prefix="fixture_corpus_") as tmp:
        tmp = Path(tmp)
        roots = {name: unpack(deb, tmp / name) for name, deb in debs.items()}
        docs = []
        docs += pydoc_documents(roots["python3.11-doc"])
        docs += web_documents(roots["sword-text-web"])
        docs += devil_documents(roots["dict-devil"])

    ids = [d for d, _ in docs]
    assert len(ids) == len(set(ids)), "duplicate document ids"
    assign = split_docs(docs, args.heldout_bytes, args.calib_bytes, args.max_doc_bytes)

    splits: dict[str, list[str]] = {"train": [], "calib": [], "heldout": []}
    for doc_id, text in docs:  # keep the natural (sorted) document order within each split
        splits[assign[doc_id]].append(text)
    sizes = {}
    for name, texts in splits.items():
        payload = DOC_SEP.join(texts) + "\n"
        (out / f"{name}.txt").write_text(payload, encoding="utf-8")
        sizes[name] = {"documents": len(texts), "bytes": len(payload.encode())}

    manifest = {
        "packages": {n: {"file": p.name, "sha256": sha256_file(p)} for n, p in debs.items()},
        "split_key": SPLIT_KEY,
        "sizes": sizes,
        "documents": {d: {"split": assign[d], "bytes": len(t.encode())} for d, t in docs},
        "sha256": {n: sha256_file(out / f"{n}.txt") for n in splits},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    args.data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("calib", "heldout"):
        shutil.copyfile(out / f"{name}.txt", args.data_dir / f"{name}.txt")
    print(json.dumps({"sizes": sizes, "packages": manifest["packages"], "sha256": manifest["sha256"]}, indent=1))


if __name__ == "__main__":
    main()
