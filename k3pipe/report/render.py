"""The report as a document: sections of paragraphs and tables, written out as Markdown and as one
self-contained HTML page (styles inline, figures embedded as data URIs)."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from k3pipe.bench.repeats import RepeatStats
from k3pipe.report.analysis import ALPHA, Analysis
from k3pipe.report.collect import StudyData

__all__ = ["Document", "Section", "Table", "build_document", "cell_text", "num", "to_html", "to_markdown"]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    flagged: set[int] = field(default_factory=set)
    """Row indexes to highlight (a figure above its physical ceiling, a claim that does not follow)."""


Block = str | Table


@dataclass
class Section:
    title: str
    blocks: Sequence[Block]


@dataclass
class Document:
    title: str
    sections: list[Section]
    figures: dict[str, str] = field(default_factory=dict)
    """File name -> caption."""


def num(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:,.{digits}f}"


def cell_text(s: RepeatStats | None) -> str:
    if s is None:
        return "-"
    if s.ci_low is None or s.ci_high is None:
        return num(s.mean)
    return f"{num(s.mean)} [{num(s.ci_low)}, {num(s.ci_high)}]"


def _direction(higher: bool) -> str:
    return "higher is better" if higher else "lower is better"


_HEADLINE = ("duration_s", "steady_decode_tps", "output_throughput_tps", "ttft_ms_p50", "tpot_ms_p50")


def _answer(analysis: Analysis) -> list[Block]:
    """One line per headline metric: who leads at each input length, by how much, and whether the
    difference stands after the correction (or could not be tested)."""
    lines: list[Block] = []
    for key in _HEADLINE:
        rows = sorted(
            (r for r in analysis.rows if r.metric.key == key and r.leader), key=lambda r: r.input_tokens
        )
        if not rows:
            continue
        parts = []
        for r in rows:
            pair = next((v for v in r.verdicts if v.leader == r.leader), None)
            if pair is None or not pair.tested:
                how = "one repeat: no test"
            elif pair.different:
                how = f"significant, p_adj={pair.p_adjusted:.2g}"
            else:
                how = "within noise"
            parts.append(f"{r.leader} leads at {r.input_tokens:,} tokens ({r.ratio:.2f}x, {how})")
        lines.append(f"**{rows[0].metric.label}**: " + "; ".join(parts) + ".")
    for f in analysis.flips:
        if f.metric.key in _HEADLINE:
            lines.append(
                f"**{f.metric.label}**: the lead flips from {f.before} to {f.after} at about "
                f"{f.at_tokens:,.0f} input tokens (interpolated)."
            )
    return lines


def _beside_reference(data: StudyData, analysis: Analysis) -> Section | None:
    """The experiment's published table (its 'reference') beside this study's cells: per workload and
    metric the arms' means with their intervals, then the published arms' figures, as they were given
    (nothing published is tested against these runs: other hardware, other model)."""
    reference = data.reference
    if not reference:
        return None
    figures = [f for f in reference.get("figures", []) if isinstance(f, dict)]
    published = list(dict.fromkeys(str(f.get("arm")) for f in figures))
    arms = [a.name for a in data.arms]
    table = Table(["workload", "input tokens", "metric", *arms, "leader", *published], [])
    for key in dict.fromkeys(str(f.get("metric")) for f in figures):
        rows = sorted((r for r in analysis.rows if r.metric.key == key), key=lambda r: r.input_tokens)
        for r in rows:
            given = {str(f.get("arm")): f.get("value") for f in figures
                     if f.get("metric") == key and f.get("workload") == r.workload}  # fmt: skip
            if not given:
                continue
            table.rows.append(
                [r.workload, f"{r.input_tokens:,}", f"{r.metric.label} ({r.metric.unit})",
                 *("bursty" if a in r.bursty else cell_text(r.cells.get(a)) for a in arms),
                 r.leader or "-", *(num(given[p]) if given.get(p) is not None else "-" for p in published)]
            )  # fmt: skip
    blocks: list[Block] = [
        f"Published figures from {reference.get('source', 'the reference')} (the last columns, as given), "
        "beside this study's means with their 95% intervals.",
        table,
    ]
    blocks.extend(str(n) for n in reference.get("notes", []))
    return Section("Beside the published table", blocks)


def build_document(data: StudyData, analysis: Analysis) -> Document:
    arms = [a.name for a in data.arms]
    failed = [a for a in data.arms if a.status != "FINISHED"]
    head = [
        f"Study run `{data.run_id}` of experiment **{data.name}** ({data.status}); arms: "
        + ", ".join(f"{a.name} ({a.engine}, {a.status})" for a in data.arms)
        + "."
    ]
    for a in failed:
        head.append(
            f"**Arm {a.name} did not finish ({a.status})**: {a.error or 'see its MLflow run'} "
            f"(run `{a.run_id}`); its cells below hold what it measured before it stopped, if anything."
        )
    sections = [Section("Study", head)]
    answer = _answer(analysis)
    if answer:
        sections.append(Section("The answer", answer))

    results = Table(["workload", "input tokens", "metric", *arms, "leader", "ratio", "verdict"], [])
    for r in analysis.rows:
        verdicts = "; ".join(v.text() for v in r.verdicts) or "-"
        results.rows.append(
            [
                r.workload,
                f"{r.input_tokens:,}",
                f"{r.metric.label} ({r.metric.unit}, {_direction(r.metric.higher_is_better)})",
                *("bursty" if a in r.bursty else cell_text(r.cells.get(a)) for a in arms),
                r.leader or "-",
                f"{r.ratio:.2f}x" if r.ratio is not None else "-",
                verdicts,
            ]
        )
    sections.append(
        Section(
            "Results",
            [
                "Each cell: the mean over the workload's repeats, with its 95% confidence interval in "
                "brackets when there are repeats. Ratio: the leader over the runner-up. 'bursty': the "
                "client's stream came in bursts, so its TPOT and ITL timed delivery, not decoding (the "
                "engine's own figures are in the arm's MLflow run); such a cell is not ranked.",
                results,
            ],
        )
    )

    if analysis.degradations:
        metrics = list(dict.fromkeys(d.metric.label for d in analysis.degradations))
        deg = Table(["metric", "from -> to (input tokens)", *arms], [])
        for label in metrics:
            found = {d.arm: d for d in analysis.degradations if d.metric.label == label}
            any_d = next(iter(found.values()))
            deg.rows.append(
                [label, f"{any_d.short:,} -> {any_d.long:,}",
                 *(f"{found[a].factor:.2f}x" if a in found else "-" for a in arms)]
            )  # fmt: skip
        sections.append(
            Section(
                "Degradation with input length",
                ["How many times worse each arm is at the longest input than at the shortest "
                 "(throughput: the slow-down, short / long).", deg],
            )
        )  # fmt: skip

    beside = _beside_reference(data, analysis)
    if beside is not None:
        sections.append(beside)

    flips = [
        f"{f.metric.label}: {f.before} leads up to about {f.at_tokens:,.0f} input tokens, {f.after} "
        f"beyond (interpolated between the measured {f.between[0]:,} and {f.between[1]:,})"
        for f in analysis.flips
    ]
    sections.append(
        Section(
            "Where the leader flips",
            flips or ["The leader does not change between the measured input lengths."],
        )
    )

    bounds = Table(
        ["arm", "workload", "figure", "tok/s", "ceiling tok/s", "claimed / ceiling", "check", "ceiling from"],
        [],
    )
    for i, b in enumerate(analysis.bounds):
        status = "IMPOSSIBLE: above the ceiling" if b.exceeds else ("ok" if b.ceiling_tps else "-")
        bounds.rows.append(
            [b.arm, b.workload, b.figure, num(b.claimed_tps), num(b.ceiling_tps),
             f"{b.ratio:.2f}" if b.ratio is not None else "-", status, b.basis]
        )  # fmt: skip
        if b.exceeds:
            bounds.flagged.add(i)
    sections.append(
        Section(
            "Physical-bound check",
            ["Every throughput the report shows against the most tokens per second the run could have "
             "produced (tokens / wall time).", bounds],
        )
    )  # fmt: skip

    if analysis.claims:
        claims = Table(["published figure", "published", "the inputs give", "check", "how"], [])
        for i, c in enumerate(analysis.claims):
            claims.rows.append(
                [c.what, f"{c.published:g}", num(c.computed, 2),
                 "follows" if c.follows else "DOES NOT FOLLOW from the study's own inputs", c.basis]
            )  # fmt: skip
            if not c.follows:
                claims.flagged.add(i)
        sections.append(Section("Published figures checked", [claims]))

    cold = Table(["arm", "cold start (s)", "phases (s)"], [])
    for a in data.arms:
        phases = ", ".join(f"{p} {s:.1f}" for p, s in sorted(a.phases.items(), key=lambda kv: -kv[1])) or "-"
        cold.rows.append([a.name, num(a.cold_start_s), phases])
    sections.append(Section("Cold start", [cold]))

    spec = Table(
        ["arm", "workload", "acceptance length (engine /metrics)", "acceptance rate", "engine log mean"], []
    )
    for a in data.arms:
        for cell in (c for c in data.cells if c.arm == a.name):
            length = cell.mean("engine_spec_mean_acceptance_length")
            rate = cell.mean("engine_spec_acceptance_rate")
            length = length if length is not None else cell.mean("engine_spec_accept_length_mean")
            if length is None and rate is None and a.log_spec_accept_length is None:
                continue
            spec.rows.append(
                [a.name, cell.workload, num(length, 2), num(rate, 3), num(a.log_spec_accept_length, 2)]
            )
    sections.append(
        Section(
            "Speculative decoding",
            [spec] if spec.rows else ["No arm speculated (no acceptance figures recorded)."],
        )
    )

    findings: list[Block] = []
    for a in data.arms:
        items = [
            f"[{f.get('severity')}] {f.get('rule')}: {f.get('message')}"
            for f in a.findings
            if f.get("severity") != "info"
        ]
        items += [f"[engine log] {w}" for w in a.warnings]
        findings.append(f"**{a.name}**: " + (" / ".join(items) if items else "no findings"))
    sections.append(Section("Findings per arm", findings))

    if any(a.stages for a in data.arms) or data.metrics:
        stage_names = sorted({s for a in data.arms for s in a.stages})
        stages = Table(["arm", *(f"{s} (s)" for s in stage_names)], [])
        for a in data.arms:
            stages.rows.append([a.name, *(num(a.stages.get(s)) for s in stage_names)])
        m = data.metrics
        sections.append(
            Section(
                "Where the study's time went",
                [stages, f"Wall time {num(m.get('study.wall_s'))} s; the stages one after another would "
                 f"take {num(m.get('study.sequential_s'))} s; overlap (the next arm's inputs fetched "
                 f"while one arm ran) saved {num(m.get('study.overlap_saved_s'))} s."],
            )
        )  # fmt: skip

    sections.append(
        Section(
            "How the numbers are made",
            [
                "Verdicts: Welch's t-test on the repeats of the two cells; the p-values of all "
                f"{analysis.tests} tests of this report corrected together with Holm-Bonferroni "
                f"(family-wise error rate {ALPHA:.0%}); 'no difference within noise' when the corrected "
                "p-value is not below it. Ratio intervals: the delta method on the log ratio with "
                "Welch-Satterthwaite degrees of freedom. A workload with one repeat gets no test. "
                "Flips: linear interpolation between measured input lengths, labelled as such."
            ],
        )
    )
    return Document(
        title=f"Study report: {data.name}",
        sections=sections,
        figures={
            "by_input_length.png": "Latency and decode throughput by input length, per arm (95% CI bars)",
            "distributions.png": "TTFT and ITL distributions per arm and workload",
            "cold_start.png": "Cold start by phase, per arm",
        },
    )


def _md_table(t: Table) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in t.headers) + " |", "|" + "---|" * len(t.headers)]
    for i, row in enumerate(t.rows):
        cells = [esc(c) for c in row]
        if i in t.flagged:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_markdown(doc: Document, figures: Mapping[str, bytes], figure_dir: str = "plots") -> str:
    out = [f"# {doc.title}", ""]
    for s in doc.sections:
        out += [f"## {s.title}", ""]
        for b in s.blocks:
            out += [_md_table(b) if isinstance(b, Table) else b, ""]
    if figures:
        out += ["## Figures", ""]
        for name in figures:
            out += [f"![{doc.figures.get(name, name)}]({figure_dir}/{name})", ""]
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1400px;
padding:0 1rem;color:#1b1b1b}
h1{font-size:1.6rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.85rem}
th,td{border:1px solid #ccc;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f2f4f7}tr.flag td{background:#fde2e1;font-weight:600}
figure{margin:1rem 0}figcaption{color:#555;font-size:.85rem}img{max-width:100%}
"""


def _inline(text: str) -> str:
    """The little Markdown the paragraphs use: **bold** and `code`."""
    out, bold, code = [], False, False
    i = 0
    escaped = html.escape(text)
    while i < len(escaped):
        if escaped.startswith("**", i):
            out.append("</strong>" if bold else "<strong>")
            bold = not bold
            i += 2
        elif escaped[i] == "`":
            out.append("</code>" if code else "<code>")
            code = not code
            i += 1
        else:
            out.append(escaped[i])
            i += 1
    return "".join(out)


def to_html(doc: Document, figures: Mapping[str, bytes]) -> str:
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(doc.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(doc.title)}</h1>",
    ]
    for s in doc.sections:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        for b in s.blocks:
            if isinstance(b, Table):
                out.append(
                    "<table><thead><tr>"
                    + "".join(f"<th>{html.escape(h)}</th>" for h in b.headers)
                    + "</tr></thead><tbody>"
                )
                for i, row in enumerate(b.rows):
                    cls = " class='flag'" if i in b.flagged else ""
                    out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
                out.append("</tbody></table>")
            else:
                out.append(f"<p>{_inline(b)}</p>")
    if figures:
        out.append("<h2>Figures</h2>")
        for name, png in figures.items():
            data = base64.b64encode(png).decode()
            caption = html.escape(doc.figures.get(name, name))
            out.append(
                f"<figure><img alt='{caption}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{caption}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out)
