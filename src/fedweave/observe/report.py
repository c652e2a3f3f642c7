"""``fedweave report RUN_DIR|SWEEP_DIR [...]``: one self-contained HTML page of one run or a
comparison of several (a sweep folder stands for its runs).

The page needs no network: each figure is an inline ``data:`` PNG, styles and the small
scripts are inline; the PNGs are also written to a folder only when asked (``figures_dir``,
``--figures DIR``). Runs of one config but their seeds are drawn as one mean line with a
band (:mod:`fedweave.observe.overlay`) and summarized as mean ± std. A menu above the
figures shows one figure, or all of them. The plotted series are embedded as JSON
(``<script type="application/json" id="fedweave-data">``), a single run's exactly as read
from its ``metrics.jsonl``. The script marks the page once it has loaded (``data-figures-ok``
on ``<body>``: how many figures decoded to a non-empty image) so a headless browser can check
it. Works on a run still going on or interrupted: what is written so far is drawn.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from fedweave import __version__
from fedweave.observe.compare import GroupSummary, Summary, group_summaries, group_table, summaries
from fedweave.observe.figures import Figure
from fedweave.observe.overlay import combine
from fedweave.observe.render import png
from fedweave.observe.rundata import CONFIG_FILE, RunData, load_run

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"
DATA_ID = "fedweave-data"

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.figures{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0;flex:1 1 520px}
figure img{width:100%;height:auto;border:1px solid #eee}
pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.8em;max-height:30em}
.note{color:#a60}.fw-hidden{display:none}
"""

CHECK_SCRIPT = """
window.addEventListener("load", function () {
  var images = document.querySelectorAll("figure.fw-figure img"), ok = 0, broken = [];
  images.forEach(function (img) { if (img.complete && img.naturalWidth > 0) { ok++; } else { broken.push(img.alt); } });
  document.body.setAttribute("data-figures-total", String(images.length));
  document.body.setAttribute("data-figures-ok", String(ok));
  document.body.setAttribute("data-figures-broken", broken.join("|"));
  JSON.parse(document.getElementById("__DATA_ID__").textContent);
  document.body.setAttribute("data-json-ok", "1");
  var menu = document.getElementById("fw-show");
  menu.addEventListener("change", function () {
    document.querySelectorAll("figure.fw-figure").forEach(function (f) {
      f.classList.toggle("fw-hidden", menu.value !== "" && f.dataset.figure !== menu.value);
    });
  });
});
""".replace("__DATA_ID__", DATA_ID)
PLAN_FILE = "sweep.json"  # :mod:`fedweave.sweeps`' plan of a sweep folder


def default_output(run_dirs: Sequence[str | Path]) -> Path:
    """One run or sweep folder: ``DIR/report.html``; several: ``report.html`` in the working directory."""
    return Path(run_dirs[0]) / REPORT_FILE if len(run_dirs) == 1 else Path(REPORT_FILE)


def run_folders(path: str | Path) -> list[Path]:
    """The run directories ``path`` stands for: itself (a run), or a sweep folder's runs (in the
    order of its plan, those begun), or else the run directories directly under it."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file() or not path.is_dir():
        return [path]
    plan = path / PLAN_FILE
    if plan.is_file():
        try:
            names = [entry["dir"] for entry in json.loads(plan.read_text())["runs"]]
        except (ValueError, KeyError, TypeError):
            names = []
        listed = [path / n for n in names if isinstance(n, str) and (path / n / CONFIG_FILE).is_file()]
        if listed:
            return listed
    found = sorted(p for p in path.iterdir() if (p / CONFIG_FILE).is_file())
    return found or [path]


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None, target: float | None = None,
                 figures_dir: str | Path | None = None, band: str = "range") -> Path:
    """Write the report of ``run_dirs`` (runs, or sweep folders) to ``out`` (default
    :func:`default_output`), and each figure as ``<figures_dir>/<figure>.png`` when given; the path
    of the HTML file. ``band``: ``range`` or ``std`` around the mean of a group's runs."""
    runs = [load_run(d) for path in run_dirs for d in run_folders(path)]
    out = Path(out) if out is not None else default_output(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = combine(runs, band)
    images = {fig.id: png(fig) for fig in figures}
    if figures_dir is not None:
        folder = Path(figures_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for fig in figures:
            _write_bytes(images[fig.id], folder / f"{fig.id}.png")
    used, rows = summaries(runs, target)
    groups = group_summaries(runs, None if used is None else ("test_accuracy", used))
    _write_bytes(page(runs, figures, images, used, rows, groups).encode(), out)
    log.info("report of %d run(s) written to %s with %d figures", len(runs), out, len(figures))
    return out


def clean(value: Any) -> Any:
    """``value`` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def embedded_data(runs: Sequence[RunData], figures: Sequence[Figure], target: float | None,
                  rows: Sequence[Summary], groups: Sequence[GroupSummary] = ()) -> str:
    data = {
        "fedweave": __version__,
        "runs": [{"name": r.name, "path": str(r.path), "mode": "data_parallel" if r.data_parallel else "federated",
                  "records": len(r.records)} for r in runs],
        "target_accuracy": target,
        "summary": [asdict(s) for s in rows],
        "groups": [asdict(g) for g in groups],
        "figures": [asdict(f) for f in figures],
    }
    return json.dumps(clean(data), separators=(",", ":")).replace("</", "<\\/")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s" if value >= 10 else f"{value:.2f} s"


def summary_table(target: float | None, rows: Sequence[Summary]) -> str:
    head = ["run", "mode", "progress", "final acc.", "best acc.", f"time to {_num(target, '.2f')} acc.",
            "reached at", "MB moved", "wall time"]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in (
            s.run, s.mode, s.progress, _num(s.final_accuracy, ".4f"), _num(s.best_accuracy, ".4f"),
            _seconds(s.time_to_target), _num(s.reached_at, "d"),
            "-" if s.bytes is None else f"{s.bytes / 1e6:.2f}", _seconds(s.wall_time),
        )) + "</tr>"
        for s in rows
    )
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{body}</table>"


def figure_html(fig: Figure, image: bytes) -> str:
    source = "data:image/png;base64," + base64.b64encode(image).decode()
    title = html.escape(fig.title)
    return (f'<figure class="fw-figure" id="figure-{html.escape(fig.id)}" data-figure="{html.escape(fig.id)}">'
            f'<img src="{source}" alt="{title}"></figure>')


def group_html(groups: Sequence[GroupSummary]) -> str:
    """The summary per group (mean ± std over seeds), where some group has several runs."""
    if all(len(g.runs) == 1 for g in groups):
        return ""
    table = group_table(groups)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table[1:])
    return f"<h3>Per config, over its seeds (mean ± sample std)</h3><table><tr>{head}</tr>{body}</table>"


def menu_html(figures: Sequence[Figure]) -> str:
    options = "".join(f'<option value="{html.escape(f.id)}">{html.escape(f.title)}</option>' for f in figures)
    return (f'<p><label for="fw-show">show: </label><select id="fw-show"><option value="">every figure</option>'
            f"{options}</select></p>")


def page(runs: Sequence[RunData], figures: Sequence[Figure], images: dict[str, bytes], target: float | None,
         rows: Sequence[Summary], groups: Sequence[GroupSummary] = ()) -> str:
    names = ", ".join(r.name for r in runs)
    title = f"fedweave report: {names}" if len(runs) == 1 else f"fedweave comparison of {len(runs)} runs"
    notes = "".join(f'<p class="note">{html.escape(r.name)}: {html.escape(n)}</p>' for r in runs for n in r.notes)
    configs = "".join(
        f"<details{' open' if len(runs) == 1 else ''}><summary>{html.escape(r.name)} ({html.escape(str(r.path))})"
        f"</summary><pre>{html.escape(r.config_text)}</pre></details>"
        for r in runs
    )
    shown = "".join(figure_html(f, images[f.id]) for f in figures) or "<p>No records yet.</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Written {datetime.now():%Y-%m-%d %H:%M:%S} by fedweave {__version__}.</p>
{notes}
<h2>Summary</h2>
{group_html(groups)}
{summary_table(target, rows)}
<h2>Figures</h2>
{menu_html(figures)}
<div class="figures">{shown}</div>
<h2>Resolved config</h2>
{configs}
<script type="application/json" id="{DATA_ID}">{embedded_data(runs, figures, target, rows, groups)}</script>
<script>{CHECK_SCRIPT}</script>
</body></html>
"""


def _write_bytes(data: bytes, path: Path) -> None:
    """Write through a temporary file beside ``path`` and a rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's permissions
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
