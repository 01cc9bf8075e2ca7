"""A task score per arm: a local set of questions with known answers, asked through the arm's endpoint
(issue 47, item 5). Nothing is downloaded: the set is a JSONL file the user has on disk, one question
a line, ``{"question": ..., "answer": ...}`` (GSM8K's own files, as evalscope and lm-eval keep them,
are this shape: the answer's final number after ``####``) or ``{"prompt": ..., "target": ...}``.

Each question is one chat request (the question as the user's message, ``prompt_suffix`` after it),
greedy, at most ``max_tokens``, ``concurrency`` at a time; an answer is right when it matches:

- ``number``: the last number in the answer equals the expected one (the number after ``####`` in
  the expected text, else its last number; commas and a trailing ``.0`` ignored);
- ``exact``: the answer, stripped and lower-cased, equals the expected text;
- ``contains``: the expected text appears in the answer (case ignored).

The statistics (paired against the reference arm's answers to the same questions) are
:func:`k3pipe.verdicts.answers.judge_accuracy`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from k3pipe.core.errors import BenchmarkError
from k3pipe.verdicts.answers import question_fields

__all__ = [
    "AccuracyRecord",
    "Question",
    "is_right",
    "load_questions",
    "read_accuracy",
    "run_accuracy",
]


Match = Literal["number", "exact", "contains"]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    answer: str


def load_questions(path: Path, limit: int | None = None) -> tuple[list[Question], str]:
    """The set's questions (the first ``limit``) and the file's digest.

    Raises:
        BenchmarkError: the file is missing or a line is not a question; the message names the line.
    """
    if not path.is_file():
        raise BenchmarkError(
            f"accuracy set {path} does not exist: give a JSONL file of questions with answers"
        )
    raw = path.read_bytes()
    out: list[Question] = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise BenchmarkError(f"accuracy set {path}, line {n}: not JSON ({exc})") from exc
        fields = question_fields(item)
        if fields is None:
            raise BenchmarkError(
                f"accuracy set {path}, line {n}: needs 'question' and 'answer' (or 'prompt' and 'target'); "
                f"it has {sorted(item) if isinstance(item, dict) else type(item).__name__}"
            )
        out.append(Question(f"q{len(out):05d}", *fields))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise BenchmarkError(f"accuracy set {path} holds no question")
    return out, hashlib.sha256(raw).hexdigest()[:16]


def _number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = str(found[-1]).replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def is_right(answer: str, expected: str, match: Match) -> bool:
    """Whether ``answer`` matches ``expected`` (see the module)."""
    if match == "exact":
        return answer.strip().lower() == expected.strip().lower()
    if match == "contains":
        return expected.strip().lower() in answer.lower()
    want = _number(expected.split("####")[-1])
    return want is not None and _number(answer) == want


@dataclass
class AccuracyRecord:
    """One launch's task score: the set's digest and each question's verdict, in the set's order."""

    path: str
    digest: str
    match: str
    right: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    @property
    def score(self) -> float | None:
        return sum(self.right.values()) / len(self.right) if self.right else None

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "digest": self.digest, "match": self.match,
                "seconds": round(self.seconds, 3), "error": self.error, "right": self.right}  # fmt: skip


def read_accuracy(data: Mapping[str, Any]) -> AccuracyRecord:
    return AccuracyRecord(
        path=str(data.get("path", "")),
        digest=str(data.get("digest", "")),
        match=str(data.get("match", "number")),
        right={str(k): bool(v) for k, v in (data.get("right") or {}).items()},
        seconds=float(data.get("seconds") or 0.0),
        error=data.get("error"),
    )


def run_accuracy(
    base_url: str,
    model: str,
    questions: Sequence[Question],
    *,
    digest: str,
    path: str,
    match: Match,
    max_tokens: int,
    concurrency: int,
    prompt_suffix: str = "",
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> AccuracyRecord:
    """Every question asked (``concurrency`` at a time) and marked; never raises for what the engine
    answers: a refused request is a wrong answer of its own, a broken connection ends the run with
    ``error`` set and the questions answered until then kept."""
    record = AccuracyRecord(path, digest, match)
    url = base_url.rstrip("/") + "/chat/completions"
    t0 = time.perf_counter()

    async def ask(client: httpx.AsyncClient, q: Question, slots: asyncio.Semaphore) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": q.question + prompt_suffix}],
                "temperature": 0.0, "max_tokens": max_tokens, "stream": False}  # fmt: skip
        async with slots:
            answer = await client.post(url, json=body, headers=dict(headers or {}))
        text = ""
        if answer.status_code == 200:
            choices = answer.json().get("choices") or [{}]
            text = (choices[0].get("message") or {}).get("content") or ""
        record.right[q.qid] = answer.status_code == 200 and is_right(text, q.answer, match)

    async def go() -> None:
        slots = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            await asyncio.gather(*(ask(client, q, slots) for q in questions))

    try:
        asyncio.run(go())
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.right = {q.qid: record.right[q.qid] for q in questions if q.qid in record.right}
    record.seconds = time.perf_counter() - t0
    return record
