"""The ``documents`` prompt set: text files cut to windows of exactly ``input_tokens`` tokens.

Windows are cut at seeded documents and offsets; a window is decoded from the document's ids and
re-encoded to verify its length. Windows form one seeded sequence keyed by ``seed`` and
``input_tokens``; repeat ``k`` sends windows ``k*n`` to ``(k+1)*n - 1``. No two windows of the
sequence start at the same (document, token) or have the same text, so neither a prompt nor any
prefix of it is sent twice, within a repeat or across repeats (see ``_DocumentSample``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.corpus_tools import (
    _CACHED,
    PromptSet,
    _Cache,
    _fewer,
    _local,
    _needs,
    _resolve,
    _token_ids,
    _where,
)
from k3pipe.prompts.datasets import _BATCH_TOKENS, Prompt, _encode_batch, _stream
from k3pipe.schema.specs import DocumentsDataset

__all__: list[str] = []

# Exact-window rounds per cut, cuts per prompt that may fail to fit, a cap on file names in a profile.
_WINDOW_ROUNDS = 6
_WINDOW_CUTS = 8
_MAX_LISTED = 100
# Random offsets a window tries in its document before it goes through all of them in turn.
_WINDOW_DRAWS = 16
_BAD = "\ufffd"
# Kinds of random stream of the documents sample (the random kinds use 0-2 in datasets.py): the
# sequence of windows, and each window's own moves. (Not a trailing index on the first key:
# SeedSequence([..., 0]) is the same stream as SeedSequence([...]).)
_DOCUMENTS, _DOCUMENT_MOVES = 3, 4
# Grades of a cut (_edge_grade), and what a window candidate prefers: cuts between words, or only
# between characters. A candidate is (document, offset, preferred grade).
_WORDS, _CHARACTERS = 2, 1
_Candidate = tuple[int, int, int]


def _documents(
    spec: DocumentsDataset,
    tokenizer: Tokenizer,
    n: int,
    input_tokens: int,
    seed: int,
    home: Path,
    repeat: int,
) -> PromptSet:
    folder = _resolve(spec.path, home)
    where = _where(spec.path, folder)
    files = _document_files(spec, folder)
    stamps = tuple(_stamp(path) for path in files)
    texts = [_read_document(spec, path) for path in files]
    ids = _token_ids(tokenizer, texts)
    del texts
    lengths = [d.size for d in ids]
    candidates = [k for k, length in enumerate(lengths) if length >= input_tokens]
    if not candidates:
        longest = int(np.argmax(lengths))
        raise BenchmarkError(
            f"{where}: no document matching {spec.glob!r} has {input_tokens} "
            f"tokens (the workload's input_tokens); the longest, {files[longest].name}, has "
            f"{lengths[longest]}: lower input_tokens or add longer documents"
        )
    windows = sum(lengths[k] - input_tokens + 1 for k in candidates)
    first, last = repeat * n, (repeat + 1) * n
    if windows < last:
        raise BenchmarkError(
            f"{where}: the documents of {input_tokens}+ tokens give only {windows} distinct windows "
            f"of {input_tokens} tokens, and {_needs(n, repeat)}: lower {_fewer(repeat)} or "
            "input_tokens, or add documents"
        )
    # The windows of earlier repeats are this sample's first ones: kept per process, so repeat k
    # cuts only its own (a new process cuts those of repeats 0..k-1 again, to the same windows).
    key = (str(folder), spec.glob, stamps, id(tokenizer), seed, input_tokens)
    sample = _SAMPLES.pop(key, tokenizer)
    if sample is None or sample.lengths != lengths:
        sample = _DocumentSample(seed, input_tokens, lengths, candidates)
    names = [p.name for p in files]
    made = _Cutter(tokenizer, ids, names, where, n, repeat).extend(sample, last, keep_from=first)
    _SAMPLES.put(key, tokenizer, sample)
    cuts = sample.windows[first:last]
    texts = [
        made.get(first + k) or tokenizer.decode(ids[doc][start:end].tolist(), skip_special_tokens=False)
        for k, (doc, start, end) in enumerate(cuts)
    ]
    prompts = [Prompt(text=text, tokens=input_tokens) for text in texts]
    used = sorted({names[doc] for doc, _, _ in cuts})
    extra = {
        "folder": folder.name,
        "glob": spec.glob,
        "files": len(files),
        "files_long_enough": len(candidates),
        "files_used": used[:_MAX_LISTED],
        "files_used_count": len(used),
        "slice": [first, last],
    }
    return _local(f"documents:{folder.name}", folder, "documents", prompts, seed, repeat, extra)


def _document_files(spec: DocumentsDataset, folder: Path) -> list[Path]:
    where = _where(spec.path, folder)
    if folder.is_file():
        raise BenchmarkError(
            f"{where} is a file: a documents dataset is a folder of text files (for one ShareGPT "
            "JSON file use kind 'sharegpt')"
        )
    if not folder.is_dir():
        raise BenchmarkError(
            f"{where} does not exist: give a folder of text files ('{{home}}' expands to "
            f"K3PIPE_HOME, relative paths are taken from the working directory, {Path.cwd()})"
        )
    files = sorted(p for p in folder.glob(spec.glob) if p.is_file())
    if not files:
        held = sorted(p.name for p in folder.iterdir())
        listing = ", ".join(held[:10]) + (f" and {len(held) - 10} more" if len(held) > 10 else "")
        raise BenchmarkError(
            f"{where}: no file matches workloads[].dataset.glob {spec.glob!r}; the folder holds "
            f"{listing or 'nothing'}: set glob to match the documents"
        )
    return files


def _stamp(path: Path) -> tuple[str, int, int]:
    try:
        stat = path.stat()
    except OSError as exc:
        raise BenchmarkError(f"cannot read document {path}: {exc}") from exc
    return path.name, stat.st_mtime_ns, stat.st_size


def _read_document(spec: DocumentsDataset, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BenchmarkError(
            f"{path} is not UTF-8 text (byte {exc.start}): convert it, or narrow "
            f"workloads[].dataset.glob ({spec.glob!r}) to the text files"
        ) from exc
    except OSError as exc:
        raise BenchmarkError(f"cannot read document {path}: {exc}") from exc


class _DocumentSample:
    """The windows of one (documents, tokenizer, seed, size): one seeded sequence, extended on demand.

    Window ``i`` is the first of its candidates that fits and is free. Its first candidate is the
    ``i``-th draw of the sample's stream (documents in successive seeded permutations, each used as
    evenly as possible; an offset never drawn twice in a document); the others come from a stream
    of its own: more offsets of that document, then all of them in turn, then all those of the
    other documents, and at last all offsets again placed without the preference for word starts.
    A candidate offset is placed by sliding it forward to a cut between words (or only between
    characters) and fitted to exactly ``size`` tokens (``_Cutter``); it is free when neither that
    first placement nor the fitted window starts where an earlier window starts, and its text is no
    earlier window's text.

    So no two windows share a start (no prompt, nor any prefix of one, is sent twice) and window
    ``i`` depends only on the windows before it: the first ``m`` windows of a longer sequence are
    the same, however the fitting batched its encodes, and repeat ``k`` can take windows ``k*n``
    onwards knowing that repeats ``0..k-1`` sent the ones before.
    """

    def __init__(self, seed: int, size: int, lengths: list[int], candidates: list[int]) -> None:
        self.seed, self.size, self.lengths, self.candidates = seed, size, lengths, candidates
        self._rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, _DOCUMENTS, size]))
        self._order: list[int] = []
        self._drawn: dict[int, set[int]] = {k: set() for k in candidates}
        self.windows: list[tuple[int, int, int]] = []  # (document, start, end) of each window
        self.taken: set[tuple[int, int]] = set()  # (document, start) of each window
        self._texts: set[bytes] = set()  # a digest of each window's text

    def first_candidate(self) -> tuple[int, int]:
        """The next (document, offset) of the sample's stream."""
        while True:
            if not self._order:
                if all(len(self._drawn[k]) > self.lengths[k] - self.size for k in self.candidates):
                    raise AssertionError("every offset of the documents was drawn")  # checked before
                self._order = [self.candidates[j] for j in self._rng.permutation(len(self.candidates))]
            doc = self._order.pop(0)
            windows = self.lengths[doc] - self.size + 1
            if len(self._drawn[doc]) < windows:  # else this document has no undrawn offset left
                return doc, _free_offset(self._rng, windows, self._drawn[doc])

    def candidates_of(self, index: int, doc: int, offset: int) -> Iterator[_Candidate]:
        """Window ``index``'s candidates, from its first: (``doc``, ``offset``)."""
        yield doc, offset, _WORDS
        rng = _stream(self.seed, _DOCUMENT_MOVES, self.size, index)
        windows = self.lengths[doc] - self.size + 1
        given = {offset}
        for _ in range(_WINDOW_DRAWS):
            drawn = int(rng.integers(0, windows))
            if drawn not in given:
                given.add(drawn)
                yield doc, drawn, _WORDS
        others = [k for k in self.candidates if k != doc]
        docs = [doc] + [others[j] for j in rng.permutation(len(others)).tolist()]
        for want in (_WORDS, _CHARACTERS):
            for k in docs:
                for drawn in rng.permutation(self.lengths[k] - self.size + 1).tolist():
                    if not (k == doc and want == _WORDS and drawn in given):
                        yield k, drawn, want

    def clashes(self, w: _Window) -> bool:
        return (w.doc, w.first) in self.taken or (w.doc, w.start) in self.taken or w.digest in self._texts

    def accept(self, w: _Window) -> None:
        self.windows.append((w.doc, w.start, w.end))
        self.taken.add((w.doc, w.start))
        self._texts.add(w.digest)


_SAMPLES: _Cache[tuple[Any, ...], _DocumentSample] = _Cache(_CACHED)


def _free_offset(rng: np.random.Generator, windows: int, used: set[int]) -> int:
    for _ in range(16):
        offset = int(rng.integers(0, windows))
        if offset not in used:
            used.add(offset)
            return offset
    free = np.setdiff1d(np.arange(windows), np.fromiter(used, dtype=np.int64))
    offset = int(free[rng.integers(0, free.size)])
    used.add(offset)
    return offset


@dataclass
class _Window:
    """One window of a sample being fitted: its candidates, and the span of ids it now covers."""

    index: int
    candidates: Iterator[_Candidate]
    doc: int = 0
    want: int = _WORDS  # the current candidate's preferred cuts
    first: int = 0  # where the current candidate was placed first
    start: int = 0
    span: int = 0
    end: int = 0
    text: str = ""
    digest: bytes = b""
    rounds: int = 0
    count: int = 0  # the last count that was not exact
    fitted: bool = False
    stalled: bool = False  # too many candidates did not fit: wait to be the first window unsettled
    placed: set[_Candidate] = field(default_factory=set)  # (document, first, want) of its candidates
    failed: list[_Candidate] = field(default_factory=list)  # those that could not be fitted
    tried: set[tuple[int, int]] = field(default_factory=set)  # edges tried for the current one


class _Cutter:
    """Fits a sample's windows to exactly ``size`` tokens: decode a span of ids, re-encode to verify.

    A boundary can change the count: a token merged with what the cut removed, or a character that
    the tokenizer split into several tokens (byte-level BPE on accented or CJK text), which an edge
    must not split. So a window is a span of ids slid forward from its offset to the first place
    where neither edge splits a character, between words when it can (``_Edges.slide``); when the
    re-encoded count is off, the span changes by the difference and slides again (never to edges it
    tried); after a few rounds the window goes to its next candidate offset.

    The windows are fitted ``_BATCH_TOKENS // size`` at a time (each round one ``encode_batch`` of
    them: an Encoding holds ~150 bytes a token until it is dropped), and accepted in index order,
    so the outcome is that of fitting them one by one.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        ids: list[NDArray[np.int64]],
        names: list[str],
        where: str,
        n: int,
        repeat: int,
    ) -> None:
        self._tokenizer, self._ids, self._names = tokenizer, ids, names
        self._where, self._n, self._repeat = where, n, repeat
        self._edges = _Edges(tokenizer, ids)
        self._keep_from, self._kept = 0, dict[int, str]()

    def extend(self, sample: _DocumentSample, total: int, keep_from: int) -> dict[int, str]:
        """Fit windows until ``sample`` holds ``total``; the texts of those it fitted from window
        ``keep_from`` on, by index (the others are dropped as soon as they are verified)."""
        self._keep_from, self._kept = keep_from, {}
        per_batch = max(1, _BATCH_TOKENS // sample.size)
        while len(sample.windows) < total:
            lo = len(sample.windows)
            chunk = []
            for index in range(lo, min(total, lo + per_batch)):
                doc, offset = sample.first_candidate()
                w = _Window(index, sample.candidates_of(index, doc, offset))
                self._advance(sample, w)
                chunk.append(w)
            self._settle(sample, chunk)
        return self._kept

    def _settle(self, sample: _DocumentSample, chunk: list[_Window]) -> None:
        """Fit the chunk's windows and accept them in index order.

        A window whose fitted candidate clashes with an accepted window goes to its next candidate;
        the windows after it keep theirs (a candidate's fit depends on nothing else) but are
        accepted only once it is, and those that already clash with an accepted window move too.
        """
        pending = chunk
        accepted = 0
        while True:
            self._fit(sample, pending)
            pending = []
            while accepted < len(chunk):
                w = chunk[accepted]
                if w.stalled:
                    # Fitted one by one, it would have skipped the candidates whose placement an
                    # earlier window took: only the others count as failures.
                    w.failed = [c for c in w.failed if c[:2] not in sample.taken]
                    if len(w.failed) > _WINDOW_CUTS:
                        raise self._unstable(sample, w)
                    w.stalled = False
                elif not sample.clashes(w):
                    sample.accept(w)
                    if w.index >= self._keep_from:
                        self._kept[w.index] = w.text
                    w.text = ""
                    accepted += 1
                    continue
                self._advance(sample, w)
                pending.append(w)
                break
            else:
                return
            for w in chunk[accepted + 1 :]:
                if w.fitted and sample.clashes(w):
                    self._advance(sample, w)
                    pending.append(w)

    def _fit(self, sample: _DocumentSample, windows: list[_Window]) -> None:
        """Fit each window (placed, not fitted) to exactly ``size`` tokens, moving it to its next
        candidates when one cannot be, until it fits or too many candidates failed (stalled)."""
        size = sample.size
        per_batch = max(1, _BATCH_TOKENS // size)
        pending = [w for w in windows if not (w.fitted or w.stalled)]
        while pending:
            counts: list[int] = []
            for lo in range(0, len(pending), per_batch):
                batch = [w.text for w in pending[lo : lo + per_batch]]
                counts.extend(len(e) for e in _encode_batch(self._tokenizer, batch))
            still: list[_Window] = []
            for w, count in zip(pending, counts, strict=True):
                if count == size:
                    w.fitted = True
                    w.digest = hashlib.blake2b(w.text.encode("utf-8"), digest_size=16).digest()
                    if w.index < self._keep_from:
                        w.text = ""
                    continue
                w.rounds += 1
                w.span += size - count
                w.count = count
                if w.rounds < _WINDOW_ROUNDS and w.span > 0 and w.start + w.span <= self._ids[w.doc].size:
                    w.start = self._edges.slide(w.doc, w.start, w.span, w.want, w.tried)
                    self._cut(w)
                    still.append(w)
                    continue
                w.failed.append((w.doc, w.first, w.want))
                if len(w.failed) > _WINDOW_CUTS:
                    w.stalled, w.text = True, ""
                    continue
                self._advance(sample, w)
                still.append(w)
            pending = still

    def _advance(self, sample: _DocumentSample, w: _Window) -> None:
        """Place ``w`` at its next candidate whose first placement is new to it and not taken."""
        for doc, offset, want in w.candidates:
            first = self._edges.slide(doc, offset, sample.size, want)
            if (doc, first, want) in w.placed or (doc, first) in sample.taken:
                continue
            w.placed.add((doc, first, want))
            w.doc, w.want, w.first, w.start, w.span = doc, want, first, first, sample.size
            w.rounds, w.fitted = 0, False
            w.tried = set()
            self._cut(w)
            return
        raise BenchmarkError(
            f"{self._where}: no free window of {sample.size} tokens is left for prompt {w.index} of "
            f"the sample, and {_needs(self._n, self._repeat)}: every prompt starts at a (document, "
            "token) of its own, never inside a character, and all such starts of the documents of "
            f"{sample.size}+ tokens are taken or do not re-encode to exactly {sample.size} tokens; "
            f"lower {_fewer(self._repeat)} or input_tokens, or add documents"
        )

    def _cut(self, w: _Window) -> None:
        doc = self._ids[w.doc]
        w.end = min(doc.size, w.start + w.span)
        w.tried.add((w.start, w.end))
        w.text = self._tokenizer.decode(doc[w.start : w.end].tolist(), skip_special_tokens=False)

    def _unstable(self, sample: _DocumentSample, w: _Window) -> BenchmarkError:
        where = f"{self._where}: could not cut a window of exactly {sample.size} tokens for prompt {w.index}"
        if w.want == _CHARACTERS:  # the starts between words were all taken or failed already
            return BenchmarkError(
                f"{where} at a start of its own: the starts between words are all taken or do not "
                f"re-encode exactly, nor did the {len(w.failed)} other starts it tried; "
                f"{_needs(self._n, self._repeat)}: lower {_fewer(self._repeat)} or input_tokens, or "
                "add documents"
            )
        return BenchmarkError(
            f"{where} at {len(w.failed)} offsets (the last in document {self._names[w.doc]}, "
            f"last count: {w.count}): its text does not re-encode stably at these boundaries; try "
            "another seed or input_tokens"
        )


class _Edges:
    """Where a document's windows may be cut: each cut graded once (``_edge_grade``), then kept."""

    def __init__(self, tokenizer: Tokenizer, ids: list[NDArray[np.int64]]) -> None:
        self._tokenizer, self._ids = tokenizer, ids
        self._grades: dict[int, dict[int, int]] = {}

    def grade(self, doc: int, k: int) -> int:
        grades = self._grades.setdefault(doc, {})
        if k not in grades:
            grades[k] = _edge_grade(self._tokenizer, self._ids[doc], k)
        return grades[k]

    def slide(
        self, doc: int, start: int, span: int, want: int, tried: Collection[tuple[int, int]] = ()
    ) -> int:
        """Where a window of ``span`` ids at ``start`` moves: forward to untried edges, between words
        if ``want`` is _WORDS and there are such edges near, never inside a character; ``start``
        itself when there are none.

        Edges between words also keep the count: a word cut in two may re-encode into other pieces.
        """
        length = self._ids[doc].size
        tiers = ((_WORDS, 32), (_CHARACTERS, 16)) if want == _WORDS else ((_CHARACTERS, 16),)
        for grade, shifts in tiers:
            for shift in range(shifts):
                at = start + shift
                if at + span > length:
                    break
                if (at, at + span) not in tried and min(
                    self.grade(doc, at), self.grade(doc, at + span)
                ) >= grade:
                    return at
        return start


def _edge_grade(tokenizer: Tokenizer, doc: NDArray[np.int64], k: int) -> int:
    """A cut before token ``k``: 2 before a space (token ``k`` starts a word: text on either side
    re-encodes alone as it did in the document), 1 between characters, 0 inside a character (a
    byte-level tokenizer splits some characters)."""
    if k <= 0 or k >= doc.size:
        return 2
    left = tokenizer.decode(doc[max(0, k - 8) : k].tolist(), skip_special_tokens=False)
    both = tokenizer.decode(doc[max(0, k - 8) : k + 8].tolist(), skip_special_tokens=False)
    if not both.startswith(left) or left.endswith(_BAD):
        return 0
    right = both[len(left) :]
    if right.startswith(_BAD):
        return 0
    return 2 if right[:1] == " " else 1
