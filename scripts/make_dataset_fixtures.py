"""Write the dataset test fixtures: a small ShareGPT-format file and a folder of long documents.

    .venv/bin/python scripts/make_dataset_fixtures.py [OUT_DIR]   # default tests/fixtures/datasets

Everything is made up here from a word list (no downloaded or copyrighted text) with a fixed seed,
so running it again writes the same bytes:

- ``sharegpt_small.json``: 200 conversations in ShareGPT format whose first human turns range from
  one word to a few hundred, plus the shapes real files have: a system or gpt turn before the first
  human one, 'user'/'assistant' roles, conversations with no human turn, empty ones, an empty turn.
- ``documents/``: four ``.txt`` documents of different lengths (one with accented and CJK words, so
  byte-level tokenizers split characters across tokens), and one ``.md`` file that the default glob
  ``*.txt`` leaves out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20240611
CONVERSATIONS = 200
# (file name, paragraphs, with non-ASCII words)
DOCUMENTS = [
    ("brief-note.txt", 4, False),
    ("field-report.txt", 18, False),
    ("harbour-survey.txt", 40, True),
    ("long-manual.txt", 70, False),
]

WORDS = """
the a an and or but of to in on at by for with from into over under after before between through
during without about against among around behind beyond near above below across along toward upon
river valley mountain harbour garden market bridge tower station library kitchen window village
engine signal lantern compass ladder barrel basket candle hammer needle pocket ribbon saddle
shadow thunder meadow orchard island forest desert canyon glacier lagoon prairie summit coast
morning evening winter summer autumn spring weather season moment century decade minute hour
farmer sailor painter teacher doctor builder gardener traveller merchant captain student writer
quick quiet bright narrow gentle steady hollow golden silver frozen heavy careful distant curious
ancient modern simple patient honest clever humble eager loyal rapid sudden tidy vivid warm
walk carry build follow gather measure notice open repair share study travel wander watch write
answer balance borrow collect deliver explain imagine improve listen mention observe prepare
remember return select suggest visit wonder arrange compare describe discover examine forget
is was are were has had will would can could should may might must does did
it he she they we you this that these those each every some many few several most other
very also often never always again almost already perhaps rather quite still soon together
number pattern question reason record result section surface system theory value version
water stone paper metal glass cloth timber copper marble cotton wool clay sand salt honey bread
"""

ACCENTED = ["café", "naïve", "façade", "über", "jalapeño", "crème", "brûlée", "smörgåsbord", "résumé"]
CJK = ["東京", "数据", "港口", "河流", "花园", "市场", "桥梁", "图书馆", "灯塔", "山谷"]

QUESTIONS = [
    "Can you explain how {a} and {b} are related?",
    "Write a short story about a {a} who finds a {b}.",
    "What is the best way to {v} a {a}?",
    "Summarize the following notes about the {a}:",
    "Why would a {a} ever need a {b}?",
    "Please compare the {a} with the {b} in a few sentences.",
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "tests/fixtures/datasets"
    rng = random.Random(SEED)
    words = WORDS.split()
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharegpt_small.json").write_text(_sharegpt(rng, words), encoding="utf-8")
    docs = out / "documents"
    docs.mkdir(exist_ok=True)
    for name, paragraphs, foreign in DOCUMENTS:
        extra = ACCENTED + CJK if foreign else []
        title = " ".join(rng.choice(words) for _ in range(4)).title()
        body = "\n\n".join(_paragraph(rng, words, extra) for _ in range(paragraphs))
        (docs / name).write_text(f"{title}\n\n{body}\n", encoding="utf-8")
    (docs / "README.md").write_text(
        "# Test documents\n\nMade-up text written by scripts/make_dataset_fixtures.py.\n", encoding="utf-8"
    )
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total // 1024} KiB)")


def _sentence(rng: random.Random, words: list[str], extra: list[str], n: int | None = None) -> str:
    n = n if n is not None else rng.randint(5, 16)
    picked = [rng.choice(extra) if extra and rng.random() < 0.12 else rng.choice(words) for _ in range(n)]
    if n > 8 and rng.random() < 0.4:
        picked[rng.randint(2, n - 3)] += ","
    return " ".join(picked).capitalize() + rng.choice([".", ".", ".", "?", "!"])


def _paragraph(rng: random.Random, words: list[str], extra: list[str]) -> str:
    return " ".join(_sentence(rng, words, extra) for _ in range(rng.randint(3, 8)))


def _text(rng: random.Random, words: list[str], n_words: int) -> str:
    """About ``n_words`` words: a question, then sentences."""
    question = rng.choice(QUESTIONS).format(a=rng.choice(words), b=rng.choice(words), v=rng.choice(words))
    if n_words <= 3:
        return " ".join(rng.choice(words) for _ in range(n_words)).capitalize() + "?"
    parts = [question]
    left = n_words - len(question.split())
    while left > 0:
        k = min(left, rng.randint(5, 16))
        parts.append(_sentence(rng, words, [], k))
        left -= k
    return " ".join(parts)


def _sharegpt(rng: random.Random, words: list[str]) -> str:
    items = []
    for i in range(CONVERSATIONS):
        # first-turn lengths spread log-uniformly from 1 to ~400 words
        n_words = max(1, round(400 ** rng.random()))
        human, gpt = ("user", "assistant") if i % 11 == 5 else ("human", "gpt")
        turns = [
            {"from": human, "value": _text(rng, words, n_words)},
            {"from": gpt, "value": _text(rng, words, rng.randint(8, 30))},
        ]
        if rng.random() < 0.3:
            turns += [
                {"from": human, "value": _text(rng, words, rng.randint(4, 20))},
                {"from": gpt, "value": _text(rng, words, rng.randint(8, 20))},
            ]
        if i % 17 == 3:
            turns.insert(0, {"from": "system", "value": "You are a helpful assistant."})
        elif i % 19 == 7:
            turns.insert(0, {"from": "gpt", "value": "Hello! How can I help you today?"})
        elif i % 23 == 11:
            turns = [t for t in turns if t["from"] == gpt]  # no human turn at all
        elif i % 29 == 13:
            turns = []
        elif i % 31 == 17:
            turns[0]["value"] = ""
        items.append({"id": f"fx{i:04d}", "conversations": turns})
    # one conversation per line: readable diffs
    return "[\n" + ",\n".join(json.dumps(item, ensure_ascii=False) for item in items) + "\n]\n"


if __name__ == "__main__":
    main()
