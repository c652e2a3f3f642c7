"""The figures of a report as data: which series a run's records give, nothing drawn.

Each :class:`Figure` holds its series exactly as read from ``metrics.jsonl`` (no scaling,
no smoothing), so the report can embed them beside the pictures and a test can compare
them with the file. A key a run's records lack gives no series; a figure without series
is left out. Besides the fixed figures, every other number a record holds (a strategy's
``strategy_*``, a plugin's metrics, any ``test_*`` or ``federated_*`` metric) has a figure of
its own (``metric-<key>``), and every number of the per-client entries that varies has one
per run (``client-<key>``). Figures marked ``per_run`` (per-client and per-worker detail, the
partition) are drawn once per run; the others overlay several runs
(:mod:`fedweave.observe.overlay`).

The client timeline (compute then idle per client and round) is drawn only where the clients'
times mean something: a deployed run (gRPC, processes, Ray) or emulated unlike clients. A plain
simulation trains its clients one after the other in one process, where idle time is nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedweave.observe.rundata import RunData

Record = dict[str, Any]


@dataclass
class Series:
    """``label``: the legend's text; ``group``: the runs it stands for (several runs: its prefix);
    ``at``: the round or step of each point where ``x`` is a time; ``low``/``high``: a band around
    ``y`` (the range or ± std of ``runs`` runs whose mean ``y`` is)."""

    label: str
    x: list[float]
    y: list[float]
    at: list[float] | None = None
    group: str = ""
    low: list[float] | None = None
    high: list[float] | None = None
    runs: int = 1


@dataclass
class Figure:
    """``kind``: ``line``; ``timeline`` (each series' ``y`` are durations starting at its ``x``);
    ``heatmap`` (``matrix`` rows are series' labels, ``x`` of the first series the columns)."""

    id: str
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    kind: str = "line"
    per_run: bool = False
    marks: list[tuple[float, str]] = field(default_factory=list)  # vertical lines: (x, what happened)
    matrix: list[list[float]] | None = None


def points(records: Sequence[Record], x: Sequence[float], key: str) -> tuple[list[float], list[float]]:
    """(x, value) of the records whose ``key`` has a value; counts by reason (a round's
    ``rejected``) are plotted as their total."""
    pairs = [(xi, total(r[key])) for xi, r in zip(x, records) if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def total(value: Any) -> Any:
    """A number as it is; a mapping of counts (reasons to counts) as their sum."""
    return sum(value.values()) if isinstance(value, Mapping) else value


def elapsed(records: Sequence[Record], data_parallel: bool) -> list[float]:
    """Seconds since the run started at the end of each record (docs/metrics.md, Time). A federated
    record's ``elapsed`` is that, its start-up included; a record written before fedweave recorded it
    counts the sum of the rounds' ``wall_time`` so far. A data-parallel record's ``wall_time`` is the
    time since its workers started (a resumed run starts again from 0: stitched on to the last)."""
    out, total, offset, last = [], 0.0, 0.0, 0.0
    for r in records:
        wall = r.get("wall_time") or 0.0
        if not data_parallel and r.get("elapsed") is not None:
            total = r["elapsed"]
            out.append(total)
        elif data_parallel:
            if wall < last:
                offset += last
            last = wall
            out.append(offset + wall)
        else:
            total += wall
            out.append(total)
    return out


def _lines(fid: str, title: str, xlabel: str, ylabel: str, records: Sequence[Record], x: Sequence[float],
           keys: Sequence[tuple[str, str]], marks: list[tuple[float, str]] | None = None,
           axis: str | None = None) -> Figure:
    """A line per key; ``axis`` (round or step) names each point's ``at`` when ``x`` is a time."""
    series = []
    for key, label in keys:
        xs, ys = points(records, x, key)
        at = points(records, [r[axis] for r in records], key)[0] if axis else None
        series.append(Series(label, xs, ys, at=at))
    return Figure(fid, title, xlabel, ylabel, [s for s in series if s.x], marks=marks or [])


ACCURACY = (("test_accuracy", "test accuracy"), ("federated_accuracy", "federated accuracy"))
LOSS = (("train_loss", "train loss"), ("test_loss", "test loss"), ("federated_loss", "federated loss"))


SHOWN = {"round", "step", "epoch", "wall_time", "elapsed", "round_time", "window_time", "clock", "skipped",
         "train_loss", "test_accuracy", "test_loss", "federated_accuracy", "federated_loss", "bytes_sent",
         "bytes_received", "clients_sampled", "clients_completed", "rejected", "epsilon", "samples", "adjustments"}
"""Record keys the fixed figures show, or that count the axis: no figure of their own."""


def metric_figures(run: RunData) -> list[Figure]:
    """A figure per other number the records hold (``strategy_*``, plugin and evaluation metrics)."""
    recs = run.records
    keys = dict.fromkeys(k for r in recs for k, v in r.items()
                         if k not in SHOWN and isinstance(v, (int, float)) and not isinstance(v, bool))
    axis = [r[run.axis] for r in recs]
    return [_lines(f"metric-{key}", key.replace("_", " "), run.axis, key, recs, axis, ((key, key),))
            for key in keys]


def meaningful_timeline(config: Mapping[str, Any]) -> bool:
    """Whether the clients' compute and idle times mean something: a deployed run, or emulated unlike
    clients (a plain simulation trains them one after the other: nobody waits for anybody)."""
    def section(name: str) -> Mapping[str, Any]:
        value = config.get(name)
        return value if isinstance(value, Mapping) else {}

    het = section("heterogeneity")
    emulated = bool(het.get("speeds") or het.get("speed_range") or het.get("schedule")) or \
        het.get("slowdown", 1.0) != 1.0 or het.get("clock", "real") == "virtual"
    deployed = section("transport").get("kind", "inmemory") != "inmemory" or \
        section("launcher").get("kind", "local") != "local"
    return emulated or deployed


def federated_figures(run: RunData) -> list[Figure]:
    recs = run.records
    rounds = [r["round"] for r in recs]
    wall = elapsed(recs, False)
    timed = meaningful_timeline(run.config)
    figures = [
        _lines("accuracy-round", "accuracy by round", "round", "accuracy", recs, rounds, ACCURACY),
        _lines("loss-round", "loss by round", "round", "loss", recs, rounds, LOSS),
        _lines("accuracy-time", "accuracy by wall time", "wall time (s)", "accuracy", recs, wall, ACCURACY,
               axis="round"),
        _lines("loss-time", "loss by wall time", "wall time (s)", "loss", recs, wall, LOSS, axis="round"),
        _lines("bytes", "bytes per round (as the server counts them)", "round", "bytes", recs, rounds,
               (("bytes_received", "up (clients to server)"), ("bytes_sent", "down (server to clients)"))),
        _lines("clients", "clients per round", "round", "clients", recs, rounds,
               (("clients_sampled", "sampled"), ("clients_completed", "completed"), ("rejected", "rejected"))),
        _lines("epsilon", "privacy loss ε by round", "round", "ε", recs, rounds, (("epsilon", "ε"),)),
        *metric_figures(run),
        *([client_timeline(recs)] if timed else []),
        *client_figures(recs, skip=() if timed else ("idle",)),
    ]
    return [f for f in figures if f.series]


CLIENT_TITLES = {"compute": ("client compute time by round", "compute (s)"),
                 "idle": ("client idle time by round (waiting for the round to end)", "idle (s)"),
                 "staleness": ("client staleness by round", "staleness (server steps)"),
                 "steps": ("client local steps by round", "local steps"),
                 "batch": ("client batch size by round", "batch (samples)")}


def client_figures(records: Sequence[Record], skip: Sequence[str] = ()) -> list[Figure]:
    """A figure per number of the per-client entries that varies (a constant batch is no figure)."""
    keys = dict.fromkeys(k for r in records for e in r.get("clients") or [] for k, v in e.items()
                         if k != "id" and k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool))
    figures = []
    for key in keys:
        values = {e[key] for r in records for e in r.get("clients") or [] if e.get(key) is not None}
        if key == "staleness" or len(values) > 1:
            title, ylabel = CLIENT_TITLES.get(key, (f"client {key.replace('_', ' ')} by round", key))
            figures.append(_per_client(records, key, title, ylabel))
    return figures


def client_timeline(records: Sequence[Record]) -> Figure:
    """Each client's compute then idle time in each round, rounds laid end to end (a round
    lasts its ``round_time``, else its ``wall_time``): who waits for whom."""
    compute: dict[int, Series] = {}
    idle: dict[int, Series] = {}
    start = 0.0
    for r in records:
        for entry in r.get("clients") or []:
            cid, busy = int(entry["id"]), entry.get("compute")
            if busy is None:
                continue
            c = compute.setdefault(cid, Series(f"client {cid} compute", [], []))
            c.x.append(start)
            c.y.append(busy)
            if entry.get("idle") is not None:
                i = idle.setdefault(cid, Series(f"client {cid} idle", [], []))
                i.x.append(start + busy)
                i.y.append(entry["idle"])
        start += r.get("round_time") or r.get("wall_time") or 0.0
    series = [s for cid in sorted(compute) for s in (compute[cid], idle.get(cid)) if s is not None]
    return Figure("client-timeline", "client compute (dark) and idle (light) time, rounds end to end",
                  "time (s, rounds end to end)", "client", series, kind="timeline", per_run=True)


def _per_client(records: Sequence[Record], key: str, title: str, ylabel: str) -> Figure:
    series: dict[int, Series] = {}
    for r in records:
        for entry in r.get("clients") or []:
            if entry.get(key) is not None:
                s = series.setdefault(int(entry["id"]), Series(f"client {entry['id']}", [], []))
                s.x.append(r["round"])
                s.y.append(entry[key])
    return Figure(f"client-{key}", title, "round", ylabel, [series[c] for c in sorted(series)], per_run=True)


def world_changes(records: Sequence[Record]) -> list[tuple[float, str]]:
    """(step, what changed) where a record's workers differ from the one before: a worker
    that left (died, or was lost by the parameter server) or joined."""
    marks: list[tuple[float, str]] = []
    before: set[int] | None = None
    for r in records:
        now = {int(w) for w in r.get("workers") or []}
        lost = {int(w) for w in r.get("lost") or []}
        if before is not None:
            gone = (before - now) | (lost & before)
            marks += [(r["step"], f"worker {w} left") for w in sorted(gone)]
            marks += [(r["step"], f"worker {w} joined") for w in sorted(now - before)]
        before = now - lost
    return marks


def worker_series(records: Sequence[Record], key: str) -> list[Series]:
    """Per worker: (step, value) of the per-worker list ``key`` (aligned with ``workers``)."""
    series: dict[int, Series] = {}
    for r in records:
        for worker, value in zip(r.get("workers") or [], r.get(key) or []):
            if value is not None:
                s = series.setdefault(int(worker), Series(f"worker {worker}", [], []))
                s.x.append(r["step"])
                s.y.append(value)
    return [series[w] for w in sorted(series)]


def worker_throughput(records: Sequence[Record]) -> list[Series]:
    """Per worker: samples per second of compute, its mean batch over its mean compute time."""
    series: dict[int, Series] = {}
    for r in records:
        for worker, batch, busy in zip(r.get("workers") or [], r.get("batch") or [], r.get("compute_time") or []):
            if batch is not None and busy:
                s = series.setdefault(int(worker), Series(f"worker {worker}", [], []))
                s.x.append(r["step"])
                s.y.append(batch / busy)
    return [series[w] for w in sorted(series)]


def data_parallel_figures(run: RunData) -> list[Figure]:
    recs = run.records
    steps = [r["step"] for r in recs]
    wall = elapsed(recs, True)
    marks = world_changes(recs)
    at = dict(zip(steps, wall))
    time_marks = [(at[s], what) for s, what in marks]
    rate = [{"throughput": r["samples"] / r["window_time"]} if r.get("samples") and r.get("window_time") else {}
            for r in recs]
    figures = [
        _lines("accuracy-step", "accuracy by step", "step", "accuracy", recs, steps, ACCURACY[:1], marks),
        _lines("loss-step", "loss by step", "step", "loss", recs, steps, LOSS[:2], marks),
        _lines("accuracy-time", "accuracy by wall time", "wall time (s)", "accuracy", recs, wall, ACCURACY[:1],
               time_marks, axis="step"),
        _lines("loss-time", "loss by wall time", "wall time (s)", "loss", recs, wall, LOSS[:2], time_marks,
               axis="step"),
        _lines("throughput", "throughput (samples per second of each metrics window)", "step", "samples/s",
               rate, steps, (("throughput", "all workers"),), marks),
        *metric_figures(run),
    ]
    per_worker = (
        ("batch", "per-worker batch size", "batch (samples)", worker_series(recs, "batch")),
        ("compute", "per-worker compute time per step", "compute (s/step)", worker_series(recs, "compute_time")),
        ("idle", "per-worker idle time per step", "idle (s/step)", worker_series(recs, "idle_time")),
        ("throughput", "per-worker throughput (batch / compute time)", "samples/s", worker_throughput(recs)),
        ("updates", "asp: updates per metrics window", "updates", worker_series(recs, "updates")),
        ("staleness", "asp: mean staleness of each worker's updates", "staleness (server steps)",
         worker_series(recs, "staleness")),
    )
    figures += [Figure(f"worker-{key}", title, "step", ylabel, series, per_run=True, marks=marks)
                for key, title, ylabel, series in per_worker]
    return [f for f in figures if f.series]


def partition_figure(run: RunData) -> Figure | None:
    """Per client its label histogram (a heat map), its sample count in the row label."""
    part = run.partition or {}
    hists, counts = part.get("histograms"), part.get("counts")
    if not hists or not counts or len(hists) != len(counts):
        return None
    classes = list(range(max(len(h) for h in hists)))
    series = [Series(f"client {c} ({n})", [float(k) for k in classes], list(h)) for c, (n, h) in enumerate(zip(counts, hists))]
    return Figure("partition", "partition: samples per class and client (row: client, its count)", "class",
                  "client", series, kind="heatmap", per_run=True, matrix=[list(h) for h in hists])


def run_figures(run: RunData) -> list[Figure]:
    figures = data_parallel_figures(run) if run.data_parallel else federated_figures(run)
    part = partition_figure(run)
    return figures + ([part] if part is not None else [])
