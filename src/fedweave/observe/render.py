"""Draw a :class:`~fedweave.observe.figures.Figure` as PNG bytes with matplotlib's Agg canvas
(no pyplot: no global state, no display). matplotlib is imported here only, when drawing."""

from __future__ import annotations

import io

from fedweave.observe.figures import Figure, Series

WIDTH, HEIGHT, DPI = 7.5, 3.6, 100
STYLES = ("-", "--", ":", "-.")
MAX_TICKS = 40
OUTSIDE = 3  # more series than this: the legend goes below the plot


def _run_and_name(label: str) -> tuple[str, str]:
    run, sep, name = label.partition(": ")
    return (run, name) if sep else ("", label)


def _draw_lines(ax, fig: Figure) -> None:  # type: ignore[no-untyped-def]
    """One colour per run and one line style per series name when several runs overlay."""
    runs = list(dict.fromkeys(_run_and_name(s.label)[0] for s in fig.series))
    names = list(dict.fromkeys(_run_and_name(s.label)[1] for s in fig.series))
    from matplotlib import rcParams

    cycle = rcParams["axes.prop_cycle"].by_key().get("color", [])
    for k, s in enumerate(fig.series):
        run, name = _run_and_name(s.label)
        style = {"marker": "." if len(s.x) <= 60 else None}
        if len(runs) > 1 and cycle:
            style |= {"color": cycle[runs.index(run) % len(cycle)], "linestyle": STYLES[names.index(name) % len(STYLES)]}
        ax.plot(s.x, s.y, label=s.label, **style)
    if len(fig.series) > OUTSIDE:  # below the plot, where it covers no data
        ax.figure.legend(loc="outside lower center", fontsize="small", ncol=2, frameon=False)
    elif fig.series:
        ax.legend(loc="best", fontsize="small")


def _draw_timeline(ax, series: list[Series]) -> None:  # type: ignore[no-untyped-def]
    """Compute bars dark, idle bars light, one row per client."""
    rows: list[str] = []
    for s in series:
        client, _, part = s.label.rpartition(" ")
        if client not in rows:
            rows.append(client)
        y = rows.index(client)
        colour = ("tab:blue", 1.0) if part == "compute" else ("tab:orange", 0.45)
        ax.broken_barh(list(zip(s.x, s.y)), (y - 0.4, 0.8), facecolor=colour[0], alpha=colour[1],
                       edgecolor="white", linewidth=0.5)
    ticks = range(0, len(rows), max(1, len(rows) // MAX_TICKS + 1))
    ax.set_yticks(list(ticks), [rows[i] for i in ticks], fontsize="small")
    ax.invert_yaxis()


def _draw_heatmap(fig_, ax, fig: Figure) -> None:  # type: ignore[no-untyped-def]
    image = ax.imshow(fig.matrix, aspect="auto", cmap="viridis", interpolation="nearest")
    fig_.colorbar(image, ax=ax, label="samples")
    ticks = range(0, len(fig.series), max(1, len(fig.series) // MAX_TICKS + 1))
    ax.set_yticks(list(ticks), [fig.series[i].label for i in ticks], fontsize="small")
    ax.set_xticks(fig.series[0].x if len(fig.series[0].x) <= MAX_TICKS else [])


def png(fig: Figure) -> bytes:
    """The figure drawn as a PNG. Its text is drawn as written: a run named ``a$x$`` is no mathtext."""
    from matplotlib import rc_context

    with rc_context({"text.parse_math": False}):
        return _png(fig)


def _png(fig: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    rows = len(fig.series) if fig.kind == "heatmap" else len({s.label.rpartition(" ")[0] for s in fig.series})
    if fig.kind == "line":
        legend_rows = -(-len(fig.series) // 2) if len(fig.series) > OUTSIDE else 0
        height = HEIGHT + 0.2 * legend_rows
    else:
        height = max(HEIGHT, 1.2 + 0.22 * min(rows, 60))
    out = MplFigure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(out)
    ax = out.add_subplot()
    if fig.kind == "timeline":
        _draw_timeline(ax, fig.series)
    elif fig.kind == "heatmap":
        _draw_heatmap(out, ax, fig)
    else:
        _draw_lines(ax, fig)
        ax.grid(alpha=0.3)
    for k, (x, what) in enumerate(fig.marks):
        ax.axvline(x, color="tab:red", linestyle="--", linewidth=1)
        ax.annotate(what, (x, 1 - 0.08 * (k % 4)), xycoords=("data", "axes fraction"), fontsize="x-small",
                    color="tab:red", ha="left", va="top", xytext=(3, -2), textcoords="offset points")
    ax.set_title(fig.title, fontsize="medium")
    ax.set_xlabel(fig.xlabel)
    if fig.xlabel in ("round", "step"):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(fig.ylabel)
    buffer = io.BytesIO()
    out.savefig(buffer, format="png")
    return buffer.getvalue()
