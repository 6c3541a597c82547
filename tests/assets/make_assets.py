"""
Rebuild tests/assets/data from ../shared/data: small excerpts (the first records of each file, whole WikiText
articles, every 200th word) in the same layout, so the tests run in any clone, with or without ../shared beside it.
Provenance and licences: tests/assets/README.md.

    python tests/assets/make_assets.py
"""

import csv
import gzip
import json
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data"
OUT = HERE / "data"


def first_lines(rel, n, newline="\n"):
    src, dst = SHARED / rel, OUT / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, encoding="utf-8", newline="") as f:
        lines = [next(f) for _ in range(n)]
    dst.write_text("".join(lines), encoding="utf-8", newline="")


def wikitext_articles(rel, max_chars):
    """Whole articles from the start of a WikiText file (an article opens with ' = Title = '), up to max_chars."""
    text = (SHARED / rel).read_text(encoding="utf-8")
    starts = [m.start() for m in re.finditer(r"(?m)^ = [^=\n][^\n]* = \n", text)] + [len(text)]
    end = max(s for s in starts if s <= max_chars) if starts[1] <= max_chars else starts[1]
    dst = OUT / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text[:end], encoding="utf-8")


def mmlu(split, rows):
    for src in sorted((SHARED / "mmlu" / split).glob("*.csv")):
        with open(src, newline="", encoding="utf-8") as f:
            records = list(csv.reader(f))[: rows + 1]  # the header and the first rows
        dst = OUT / "mmlu" / split / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "w", newline="", encoding="utf-8") as f:
            csv.writer(f, lineterminator="\n").writerows(records)


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    wikitext_articles("pretrain/wikitext-2/train.txt", 60_000)
    wikitext_articles("pretrain/wikitext-2/valid.txt", 40_000)
    wikitext_articles("pretrain/wikitext-2/test.txt", 15_000)
    stories = (SHARED / "pretrain/tinystories/tinystories_sample.txt").read_text(encoding="utf-8")
    cut = [m.end() for m in re.finditer(re.escape("<|endoftext|>"), stories)][29]  # the first 30 stories
    (OUT / "pretrain/tinystories").mkdir(parents=True)
    (OUT / "pretrain/tinystories/tinystories_sample.txt").write_text(stories[:cut] + "\n", encoding="utf-8")
    # the importer's other input formats: a JSON array, JSON lines, blank-line paragraphs, one document per line
    web = json.loads((SHARED / "pretrain/fineweb/fineweb_subset.json").read_text(encoding="utf-8"))
    (OUT / "pretrain/fineweb").mkdir(parents=True)
    (OUT / "pretrain/fineweb/fineweb_subset.json").write_text(
        json.dumps([r for r in web if len(r["text"]) < 1000][:10], indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(SHARED / "pretrain/c4_demo/c4_demo.jsonl", encoding="utf-8") as f:
        c4 = [line for line in f if len(line) < 1200][:10]
    (OUT / "pretrain/c4_demo").mkdir(parents=True)
    (OUT / "pretrain/c4_demo/c4_demo.jsonl").write_text("".join(c4), encoding="utf-8")
    plays = (SHARED / "pretrain/tinyshakespeare/input.txt").read_text(encoding="utf-8")
    (OUT / "pretrain/tinyshakespeare").mkdir(parents=True)
    (OUT / "pretrain/tinyshakespeare/input.txt").write_text(plays[: plays.index("\n\n", 4000) + 1], encoding="utf-8")
    with open(SHARED / "pretrain/wiki_demo/wiki_demo.txt", encoding="utf-8") as f:
        articles = [next(f).rstrip("\n")[:600] for _ in range(6)]  # an article a line: its first 600 characters
    (OUT / "pretrain/wiki_demo").mkdir(parents=True)
    (OUT / "pretrain/wiki_demo/wiki_demo.txt").write_text("\n".join(articles) + "\n", encoding="utf-8")
    for name in ("ARC-Easy", "ARC-Challenge"):
        first_lines(f"arc/{name}-test.jsonl", 24)
        first_lines(f"arc/{name}-train.jsonl", 24)
        # and the first question labelled 1-4 instead of A-D, the case the ARC task must keep as it is
        with open(SHARED / f"arc/{name}-test.jsonl", encoding="utf-8") as f:
            odd = next(line for line in f if json.loads(line)["choices"]["label"][0] != "A")
        with open(OUT / f"arc/{name}-test.jsonl", "a", encoding="utf-8") as f:
            f.write(odd)
    mmlu("dev", 2)
    mmlu("test", 2)
    first_lines("gsm8k/train.jsonl", 24)
    first_lines("gsm8k/test.jsonl", 24)
    first_lines("gsm8k/test_socratic.jsonl", 4)
    first_lines("sft/identity_conversations.jsonl", 8)
    with gzip.open(SHARED / "humaneval/HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        problems = [next(f) for _ in range(40)]
    (OUT / "humaneval").mkdir(parents=True)
    with gzip.GzipFile(OUT / "humaneval/HumanEval.jsonl.gz", "wb", mtime=0) as f:  # mtime=0: the same bytes each build
        f.write("".join(problems).encode("utf-8"))
    with open(SHARED / "words/words_alpha.txt", encoding="utf-8", newline="") as f:
        words = f.readlines()[::200]  # CRLF kept, as in the original
    (OUT / "words").mkdir(parents=True)
    (OUT / "words/words_alpha.txt").write_text("".join(words), encoding="utf-8", newline="")
    for rel in ("arc", "gsm8k", "humaneval", "sft", "words", "mmlu", "pretrain/wikitext-2", "pretrain/tinystories",
                "pretrain/fineweb", "pretrain/c4_demo", "pretrain/tinyshakespeare", "pretrain/wiki_demo"):
        assert (OUT / rel).is_dir(), rel
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
