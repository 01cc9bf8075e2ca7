"""Engine-side metrics: scrape an engine's Prometheus ``/metrics`` during a workload, summarize the
window from the engine's own counters and histograms, and reconcile them with the client's figures.

- :func:`parse_exposition` reads the Prometheus text format (0.0.4; OpenMetrics comments, ``# EOF``
  and exemplars are tolerated) into ``{(sample name, frozenset of label pairs): value}``.
- :class:`MetricsScraper` is an asyncio task that runs beside the client workload (the benchmark
  step's ``asyncio.run``), scraping every ``interval_s`` and once more when told to stop. It keeps
  only the samples of the metrics named in the engine's ``metric_names`` (so the series stays small)
  and records a failed scrape (HTTP error, transport error, timeout, unparseable body) instead of
  raising.
- :func:`engine_side_summary` turns the scrapes of one window into unit-suffixed numbers
  (``engine_generation_tps``, ``engine_ttft_ms_mean``, ...); :func:`reconcile` flags where the
  client and the engine disagree by more than a tolerance.

Samples of a metric are summed over label sets (data-parallel engines, SGLang's ``is_streaming``);
gauges take the maximum over label sets.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import pandas as pd

from k3pipe.core.secrets import scrub
from k3pipe.engines.base import Engine

__all__ = [
    "Discrepancy",
    "Labels",
    "MetricsScraper",
    "SampleKey",
    "Samples",
    "Scrape",
    "bracketing_scrapes",
    "engine_side_summary",
    "histogram_quantile",
    "parse_exposition",
    "reconcile",
    "series_frame",
]

Labels = frozenset[tuple[str, str]]
SampleKey = tuple[str, Labels]
Samples = dict[SampleKey, float]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"'}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), value)


def parse_exposition(text: str, keep: Iterable[str] | None = None) -> Samples:
    """Samples of a Prometheus text exposition: ``{(name, frozenset(labels.items())): value}``.

    Histograms appear as their ``_bucket`` (with ``le``), ``_sum`` and ``_count`` samples, counters
    under their ``_total`` sample name. Comment lines (``# HELP``, ``# TYPE``, ``# EOF``, anything
    else after ``#``) and blank lines are skipped; timestamps and exemplars are dropped. With
    ``keep``, only samples whose name is in it are returned. A repeated series keeps its last value.

    Raises:
        ValueError: a line is not a valid sample (the message gives its line number).
    """
    wanted = None if keep is None else set(keep)
    out: Samples = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _NAME.match(line)
        if match is None:
            raise ValueError(f"line {number}: no metric name: {raw[:120]!r}")
        name, pos = match.group(0), match.end()
        if wanted is not None and name not in wanted:
            continue
        labels: list[tuple[str, str]] = []
        if pos < len(line) and line[pos] == "{":
            pos += 1
            while True:
                label = _LABEL.match(line, pos)
                if label is None:
                    break
                labels.append((label.group(1), _unescape(label.group(2))))
                pos = label.end()
                if pos < len(line) and line[pos] == ",":
                    pos += 1
                    continue
                break
            while pos < len(line) and line[pos] == " ":
                pos += 1
            if pos >= len(line) or line[pos] != "}":
                raise ValueError(f"line {number}: malformed labels: {raw[:120]!r}")
            pos += 1
        rest = line[pos:].split(" # ", 1)[0].split()  # drop an OpenMetrics exemplar
        if not rest or len(rest) > 2 or (pos < len(line) and not line[pos].isspace()):
            raise ValueError(f"line {number}: expected 'name{{labels}} value [timestamp]': {raw[:120]!r}")
        try:
            value = float(rest[0])
        except ValueError:
            raise ValueError(f"line {number}: value {rest[0]!r} is not a number") from None
        out[(name, frozenset(labels))] = value
    return out


def _sample_names(metric_names: Iterable[str]) -> set[str]:
    """The sample names of the given metric names (a histogram family brings its three suffixes)."""
    names: set[str] = set()
    for name in metric_names:
        names.add(name)
        names.update(name + suffix for suffix in _HISTOGRAM_SUFFIXES)
    return names


@dataclass(frozen=True)
class Scrape:
    """One GET of ``/metrics``: when, how long, the kept samples, or why it failed."""

    t_perf: float
    """``time.perf_counter()`` just before the request (the client's clock)."""
    t_unix: float
    """``time.time()`` at the same moment."""
    elapsed_s: float
    """Time the request (and parsing) took."""
    samples: Samples = field(default_factory=dict)
    """The samples kept (empty for a failed scrape)."""
    error: str | None = None
    """Why the scrape failed; None if it succeeded."""

    @property
    def ok(self) -> bool:
        return self.error is None


class MetricsScraper:
    """Scrapes an engine's ``/metrics`` at a fixed interval as an asyncio task.

    Usage beside a workload (one event loop; the scraper's own ``httpx.AsyncClient`` never shares a
    connection with the workload's requests, whose waits would count as server time)::

        stop = asyncio.Event()
        scraper = MetricsScraper(engine)
        task = asyncio.create_task(scraper.run(metrics_client, f"{root}/metrics", 1.0, stop))
        try:
            result = await run_workload(...)
        finally:
            stop.set()
            scrapes = await task

    ``engine`` (or ``metric_names``, the engine's Prometheus names) selects what is kept; with
    neither, every sample is kept.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        metric_names: Iterable[str] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        names = list(metric_names or [])
        if engine is not None:
            names += list(engine.metric_names.values())
        self.keep: set[str] | None = _sample_names(names) if names else None
        self.timeout_s = timeout_s
        self.scrapes: list[Scrape] = []

    async def scrape_once(self, client: httpx.AsyncClient, url: str) -> Scrape:
        """GET ``url`` once and append the result to :attr:`scrapes` (failures included)."""
        t_unix, t_perf = time.time(), time.perf_counter()
        error: str | None = None
        samples: Samples = {}
        try:
            response = await client.get(url, timeout=self.timeout_s)
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {scrub(response.text)[:200]}"
            else:
                samples = parse_exposition(response.text, self.keep)
        except ValueError as exc:  # parse_exposition
            error = f"unparseable exposition: {exc}"
        except Exception as exc:  # transport errors, timeouts, a bad URL: recorded, never raised
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        scrape = Scrape(
            t_perf=t_perf,
            t_unix=t_unix,
            elapsed_s=time.perf_counter() - t_perf,
            samples=samples,
            error=error,
        )
        # a scrape taken on demand (e.g. at the start of a measured phase) can overlap a periodic one
        bisect.insort(self.scrapes, scrape, key=lambda sc: sc.t_perf)
        return scrape

    async def run(
        self,
        client: httpx.AsyncClient,
        url: str,
        interval_s: float,
        stop: asyncio.Event,
        final_scrape: bool = True,
    ) -> list[Scrape]:
        """Scrape at once, then at ``start + k * interval_s`` (ticks missed by a slow scrape are
        skipped, not bunched), until ``stop`` is set; then scrape once more (``final_scrape``) so the
        series ends after the workload did. Returns :attr:`scrapes`. Never raises for a failed scrape.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        start = time.perf_counter()
        tick = 0
        while not stop.is_set():
            await self.scrape_once(client, url)
            now = time.perf_counter()
            tick = max(tick + 1, math.floor((now - start) / interval_s) + 1)
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, start + tick * interval_s - now))
            except TimeoutError:
                continue
        if final_scrape:
            await self.scrape_once(client, url)
        return self.scrapes


def series_frame(scrapes: Sequence[Scrape], t0: float | None = None) -> pd.DataFrame:
    """The scrapes in long format, one row per sample, for an artifact.

    Columns: ``t_s`` (perf_counter seconds after ``t0``, default the first scrape), ``t_unix_s``,
    ``metric`` (sample name), ``labels`` (JSON object, keys sorted), ``value``, ``error``. A failed
    scrape is one row with no metric, NaN value and its error.
    """
    if t0 is None:
        t0 = scrapes[0].t_perf if scrapes else 0.0
    rows: list[dict[str, object]] = []
    for scrape in scrapes:
        base = {"t_s": scrape.t_perf - t0, "t_unix_s": scrape.t_unix}
        if not scrape.ok:
            rows.append({**base, "metric": None, "labels": None, "value": math.nan, "error": scrape.error})
            continue
        for (name, labels), value in sorted(
            scrape.samples.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))
        ):
            rows.append(
                {
                    **base,
                    "metric": name,
                    "labels": json.dumps(dict(sorted(labels)), separators=(",", ":")),
                    "value": value,
                    "error": None,
                }
            )
    frame = pd.DataFrame(rows, columns=["t_s", "t_unix_s", "metric", "labels", "value", "error"])
    frame["value"] = frame["value"].astype("float64")
    return frame


def bracketing_scrapes(scrapes: Sequence[Scrape], t_start: float, t_end: float) -> list[Scrape]:
    """The successful scrapes from the last one at or before ``t_start`` to the first one at or
    after ``t_end`` (perf_counter stamps, e.g. a ``WorkloadResult``'s window): the engine window then
    covers the client window, and is at most about one interval wider at each end. When no scrape
    precedes ``t_start`` (or follows ``t_end``) the series' first (last) successful scrape is used.
    """
    ok = [s for s in scrapes if s.ok]
    if not ok:
        return []
    before = [i for i, s in enumerate(ok) if s.t_perf <= t_start]
    after = [i for i, s in enumerate(ok) if s.t_perf >= t_end]
    first = before[-1] if before else 0
    last = after[0] if after else len(ok) - 1
    return ok[first : last + 1]


# -- summaries ------------------------------------------------------------------------------------


def _total(samples: Samples, name: str) -> float | None:
    """A counter's value summed over its label sets; None when the scrape lacks it."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


def _gauge_max(samples: Samples, name: str) -> float | None:
    values = [v for (n, _), v in samples.items() if n == name and not math.isnan(v)]
    return max(values) if values else None


@dataclass(frozen=True)
class _Histogram:
    buckets: dict[float, float]
    """Upper bound (``le``) -> cumulative count, summed over label sets."""
    sum: float
    count: float


def _histogram(samples: Samples, family: str) -> _Histogram | None:
    buckets: dict[float, float] = {}
    total_sum = total_count = 0.0
    found = False
    for (name, labels), value in samples.items():
        if name == family + "_bucket":
            le = dict(labels).get("le")
            if le is not None:
                buckets[float(le)] = buckets.get(float(le), 0.0) + value
        elif name == family + "_sum":
            total_sum += value
            found = True
        elif name == family + "_count":
            total_count += value
            found = True
    return _Histogram(buckets, total_sum, total_count) if found else None


def _histogram_delta(first: _Histogram, last: _Histogram) -> _Histogram | None:
    """last - first; None when a counter went backwards (engine restarted in between)."""
    buckets = {le: last.buckets[le] - first.buckets[le] for le in last.buckets if le in first.buckets}
    delta = _Histogram(buckets, last.sum - first.sum, last.count - first.count)
    if delta.count < 0 or delta.sum < 0 or any(v < 0 for v in buckets.values()):
        return None
    return delta


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Approximate ``q``-quantile of cumulative ``buckets`` (upper bound -> count), the way
    Prometheus' ``histogram_quantile`` does it: find the bucket holding rank ``q x total`` and
    interpolate LINEARLY inside it (lower bound = the previous bucket's, 0 for the first); a rank in
    the ``+Inf`` bucket gives the highest finite bound. Only as good as the buckets are fine.
    None when the buckets hold no observation.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]] if math.isinf(bounds[-1]) else max(buckets.values())
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, max(below, count)
    return lower


_LATENCIES = {
    "ttft_seconds": "engine_ttft_ms",
    "itl_seconds": "engine_itl_ms",
    "tpot_seconds": "engine_tpot_ms",
    "e2e_seconds": "engine_e2e_ms",
    "queue_seconds": "engine_queue_ms",
}
_QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}


def engine_side_summary(
    scrapes: Sequence[Scrape], engine: Engine, window_s: float | None = None
) -> dict[str, float]:
    """Unit-suffixed numbers of one workload window, from the engine's own metrics.

    ``scrapes`` are the scrapes of the window (e.g. :func:`bracketing_scrapes`); counter and histogram
    figures are the difference between the first and the last successful one, gauges are taken over
    all of them. ``window_s`` defaults to the time between those two scrapes. Figures the engine does
    not export (or that need a window it does not have) are left out; a counter that went backwards
    (engine restarted) is left out and ``engine_counter_reset`` is 1.

    - ``engine_generation_tokens``, ``engine_prompt_tokens``: counter deltas; ``engine_generation_tps``
      and ``engine_prompt_tps``: those over ``window_s``.
    - ``engine_ttft_ms_mean`` (and ``itl``, ``tpot``, ``e2e``, ``queue``): histogram sum delta / count
      delta; ``..._p50/_p90/_p99``: APPROXIMATE, linear interpolation inside the bucket delta holding
      the rank (:func:`histogram_quantile`); ``engine_requests_finished``: the e2e count delta.
    - ``engine_kv_usage_ratio_max`` (0..1), ``engine_requests_running_max``,
      ``engine_requests_waiting_max``: gauge maxima over all scrapes.
    - ``engine_preemptions``: counter delta (SGLang: retracted requests).
    - ``engine_prefix_cache_hit_pct``: prompt tokens the prefix cache held over those looked up, in
      the window (vLLM: its prefix-cache hit and query counters; SGLang: cached over prompt tokens of
      the requests that finished).
    - Speculative decoding: whatever the engine derives from the window
      (:meth:`~k3pipe.engines.base.Engine.speculation_figures`; each engine exports it differently).
    """
    names = engine.metric_names
    ok = [s for s in scrapes if s.ok]
    out: dict[str, float] = {
        "engine_scrapes": float(len(ok)),
        "engine_scrapes_failed": float(len(scrapes) - len(ok)),
    }
    if not ok:
        return out
    first, last = ok[0], ok[-1]
    if window_s is None:
        window_s = last.t_perf - first.t_perf
    out["engine_window_s"] = window_s
    reset = False

    def delta(key: str) -> float | None:
        nonlocal reset
        name = names.get(key)
        if name is None or len(ok) < 2:
            return None
        a, b = _total(first.samples, name), _total(last.samples, name)
        if a is None or b is None:
            return None
        if b < a:
            reset = True
            return None
        return b - a

    for key, label in (("generation_tokens_total", "generation"), ("prompt_tokens_total", "prompt")):
        tokens = delta(key)
        if tokens is not None:
            out[f"engine_{label}_tokens"] = tokens
            if window_s > 0:
                out[f"engine_{label}_tps"] = tokens / window_s

    for key, prefix in _LATENCIES.items():
        family = names.get(key)
        if family is None or len(ok) < 2:
            continue
        a, b = _histogram(first.samples, family), _histogram(last.samples, family)
        if a is None or b is None:
            continue
        hist = _histogram_delta(a, b)
        if hist is None:
            reset = True
            continue
        if key == "e2e_seconds":
            out["engine_requests_finished"] = hist.count
        if hist.count <= 0:
            continue
        out[f"{prefix}_mean"] = hist.sum / hist.count * 1000.0
        for suffix, q in _QUANTILES.items():
            value = histogram_quantile(q, hist.buckets)
            if value is not None:
                out[f"{prefix}_{suffix}"] = value * 1000.0

    for key, metric in (
        ("kv_usage_ratio", "engine_kv_usage_ratio_max"),
        ("requests_running", "engine_requests_running_max"),
        ("requests_waiting", "engine_requests_waiting_max"),
    ):
        name = names.get(key)
        if name is None:
            continue
        values = [v for s in ok if (v := _gauge_max(s.samples, name)) is not None]
        if values:
            out[metric] = max(values)

    preemptions = delta("preemptions_total")
    if preemptions is not None:
        out["engine_preemptions"] = preemptions

    queries = delta("prefix_cache_queries_total")
    hits_name = names.get("prefix_cache_hits_total")
    if queries and hits_name is not None:
        # a hits counter appears only once something hit (SGLang's): absent is none yet
        hits0 = _total(first.samples, hits_name) or 0.0
        hits1 = _total(last.samples, hits_name) or 0.0
        if hits1 >= hits0:
            out["engine_prefix_cache_hit_pct"] = 100.0 * (hits1 - hits0) / queries

    out.update(engine.speculation_figures(_Window(ok, delta)))

    if reset:
        out["engine_counter_reset"] = 1.0
    return out


@dataclass(frozen=True)
class _Window:
    """One workload window's successful scrapes, as an engine reads them (a MetricWindow)."""

    scrapes: Sequence[Scrape]
    _delta: Callable[[str], float | None]

    def delta(self, key: str) -> float | None:
        return self._delta(key)

    def gauge_mean(self, name: str) -> float | None:
        values = [v for s in self.scrapes if (v := _gauge_max(s.samples, name)) is not None]
        return sum(values) / len(values) if values else None

    def delta_by_label(self, name: str, label: str) -> dict[str, float]:
        if len(self.scrapes) < 2:
            return {}

        def by_label(samples: Samples) -> dict[str, float]:
            out: dict[str, float] = {}
            for (n, labels), value in samples.items():
                key = dict(labels).get(label)
                if n == name and key is not None:
                    out[key] = out.get(key, 0.0) + value
            return out

        a, b = by_label(self.scrapes[0].samples), by_label(self.scrapes[-1].samples)
        return {k: b[k] - a[k] for k in b if k in a and b[k] >= a[k]}


# -- reconciliation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Discrepancy:
    """A figure on which the client and the engine disagree by more than the tolerance."""

    quantity: str
    client_metric: str
    engine_metric: str
    client_value: float
    engine_value: float
    relative_diff: float
    """(engine - client) / client: positive when the engine reports more."""
    message: str


_RECONCILED = (
    # quantity, client metric (WorkloadSummary.metrics()), engine metric, unit, why they may differ
    (
        "output tokens",
        "output_tokens_total",
        "engine_generation_tokens",
        "tokens",
        "the engine window also counts warm-up, failed or other clients' requests inside it",
    ),
    (
        "mean TTFT",
        "ttft_ms_mean",
        "engine_ttft_ms_mean",
        "ms",
        "client TTFT adds network, HTTP and detokenization time to the engine's",
    ),
    (
        "output throughput",
        "output_throughput_tps",
        "engine_generation_tps",
        "tok/s",
        "the windows differ: the engine's spans the scrapes around the client's",
    ),
)


def reconcile(
    client_metrics: Mapping[str, float],
    engine_metrics: Mapping[str, float],
    tolerance: float = 0.10,
) -> list[Discrepancy]:
    """Compare the client's figures (``WorkloadSummary.metrics()``) with the engine's
    (:func:`engine_side_summary`): output tokens, mean TTFT and output throughput. A figure is flagged
    when ``|engine - client| / |client|`` exceeds ``tolerance`` (a zero client figure is flagged when
    the engine's is not zero); figures missing on either side are skipped.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    found: list[Discrepancy] = []
    for quantity, client_key, engine_key, unit, why in _RECONCILED:
        client, engine = client_metrics.get(client_key), engine_metrics.get(engine_key)
        if client is None or engine is None or math.isnan(client) or math.isnan(engine):
            continue
        if client == 0:
            relative = 0.0 if engine == 0 else math.copysign(math.inf, engine)
        else:
            relative = (engine - client) / abs(client)
        if abs(relative) <= tolerance:
            continue
        direction = "above" if relative > 0 else "below"
        found.append(
            Discrepancy(
                quantity=quantity,
                client_metric=client_key,
                engine_metric=engine_key,
                client_value=client,
                engine_value=engine,
                relative_diff=relative,
                message=(
                    f"{quantity}: engine {engine_key}={engine:.6g} {unit} is {abs(relative):.1%} {direction} "
                    f"client {client_key}={client:.6g} {unit} (tolerance {tolerance:.0%}); "
                    f"possible cause: {why}"
                ),
            )
        )
    return found
