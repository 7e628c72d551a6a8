"""PNG plots of the main training curves, from the logged metric records.

One figure per group, for the groups that have data (a series of another scale than the
figure's first, dashed on a right-hand axis): `reward.png` (reward and accuracy),
`loss.png`, `kl.png`, `entropy.png`, and `timing.png` (the step-time breakdown: the
top-level `timing/<phase>` keys stacked); and `<prefix>.png` for each prefix on a step axis of
its own (the warm-up SFT's loss, `warmup_sft.png`). A curve of 500 steps or more is drawn
faint, with its running mean over it. Metrics are matched by whole words of their leaf
name (`reward`, `val/accuracy`, `kl_penalty`, `gen_kl_error`, ...). Uses matplotlib's Agg
canvas directly, so pyplot's global state is never touched. `plot_pass_at_k` draws an
evaluation's pass@k / cons@k curve.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from posttrain.logging.console import word_match

_GROUPS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "rewards", "accuracy"),
    "loss": ("loss",),
    "kl": ("kl",),
    "entropy": ("entropy",),
    "tools": ("tool",),  # tool_calls_mean, with env.<name>.tools
}
_MAX_SERIES = 8
# From this many steps on, a curve is drawn with its running mean over 1/50 of them.
_SMOOTH_FROM = 500
# Up to this many steps the step-time breakdown is a stacked bar a step, beyond it a stacked area.
_BARS_UP_TO = 30
_META = ("step", "prefix", "time")


def series_from_records(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """`{"<prefix>/<metric>": {step: value}}`; a step logged twice (a resumed run) keeps the last value.
    A step its prefix logged without the metric is NaN, a gap in the drawn line (else the line ran
    straight across the steps that lacked it, as if they had been measured). The `data/...`
    records, counts of the run's data logged once at step 0, are no curves: left out (their
    `no_loss` row count was drawn in loss.png)."""
    series: dict[str, dict[int, float]] = {}
    prefix_steps: dict[str, set[int]] = {}
    series_prefix: dict[str, str] = {}
    for rec in records:
        step, prefix = rec.get("step"), rec.get("prefix", "")
        if not isinstance(step, int) or prefix.split("/")[0] == "data":
            continue
        prefix_steps.setdefault(prefix, set()).add(step)
        for key, value in rec.items():
            if key in _META or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = f"{prefix}/{key}" if prefix else key
            series.setdefault(name, {})[step] = float(value)
            series_prefix[name] = prefix
    for name, values in series.items():
        for step in prefix_steps[series_prefix[name]] - values.keys():
            values[step] = math.nan
    return series


def plot_history(records: list[dict[str, Any]], out_dir: Path, own_step_axes: tuple[str, ...] = ()) -> list[Path]:
    """Write the PNGs for whichever groups have data; return their paths. The metrics of the
    `own_step_axes` prefixes (the warm-up SFT's) count other steps than the run's: each prefix
    gets a figure of its own, `<prefix>.png` (on the run's axis, the warm-up's 1500 steps
    squeezed the run's 100 into the left edge of loss.png, under a loss of another scale)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = series_from_records(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, keys, xlabel in figure_series(series, own_step_axes):
        if not keys:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        _, right = split_by_scale(series, keys[:_MAX_SERIES])
        twin = ax.twinx() if right else None
        colors = iter(f"C{i}" for i in range(_MAX_SERIES))
        for key in keys[:_MAX_SERIES]:
            on, style = (twin, "--") if key in right else (ax, "-")
            steps = sorted(series[key])
            values = [series[key][s] for s in steps]
            if not any(map(math.isfinite, values)):  # it draws nothing: the legend says why
                on.plot([], [], style, color=next(colors), label=f"{key} (no finite values)")
                continue
            if len(steps) < _SMOOTH_FROM:
                on.plot(steps, values, style, color=next(colors), marker="." if len(steps) < 50 else None, label=key)
                continue
            # Thousands of noisy steps drew a solid band that hid the trend: the steps faint, and
            # over them their running mean.
            (raw,) = on.plot(steps, values, style, color=next(colors), alpha=0.25, linewidth=0.5)
            on.plot(steps, running_mean(values, len(steps) // 50), style, color=raw.get_color(), label=f"{key} (mean)")
        more = len(keys) - _MAX_SERIES
        _finish(ax, name + (f" ({more} more series in metrics.jsonl)" if more > 0 else ""), "value", xlabel=xlabel,
                twin=twin)
        written.append(_save(FigureCanvasAgg(fig), fig, out_dir / f"{name}.png"))

    timing = sorted(k for k in series if k.split("/").count("timing") == 1 and k.split("timing/", 1)[1].count("/") == 0)
    if timing:
        steps = sorted(set().union(*(series[k] for k in timing)))
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        # A phase a step did not run (validation, checkpoint) took no time in it.
        phases = [[_or_zero(series[k].get(s, 0.0)) for s in steps] for k in timing]
        labels = [k.split("timing/", 1)[1] for k in timing]
        if len(steps) <= _BARS_UP_TO:  # a stacked area over one step has no width: a short run's was blank
            bottom = [0.0] * len(steps)
            for values, label in zip(phases, labels):
                ax.bar(steps, values, bottom=bottom, label=label, width=0.8)
                bottom = [b + v for b, v in zip(bottom, values)]
        else:
            ax.stackplot(steps, phases, labels=labels)
        _finish(ax, "step time breakdown", "seconds")
        written.append(_save(FigureCanvasAgg(fig), fig, out_dir / "timing.png"))
    return written


def figure_series(series: dict[str, Any], own_step_axes: tuple[str, ...] = ()) -> list[tuple[str, list[str], str]]:
    """(figure name, its series, x label) of each figure but timing.png; the first `_MAX_SERIES`
    series of a figure are drawn. The run's own curves (`train/reward`, `val/accuracy`) come
    before the breakdowns under them (`train/reward/<function>`, `train/env/<name>`): by name
    alone, 7 reward functions' curves left no room for val/accuracy, without a word."""
    own_axis = {k for k in series if k.split("/", 1)[0] in own_step_axes}

    def order(keys: Any) -> list[str]:
        return sorted(keys, key=lambda k: (k.count("/"), k))

    figures = [(group, order(k for k in series if "timing/" not in k and k not in own_axis
                             and any(word_match(k, w) for w in words)), "step")
               for group, words in _GROUPS.items()]
    figures += [(prefix, order(k for k in own_axis if k.startswith(f"{prefix}/")), f"{prefix} step")
                for prefix in own_step_axes]
    return figures


# A series whose largest |value| is this many times that of a figure's first series (or as many
# times smaller) goes on a right-hand axis.
_SCALE_RATIO = 10.0


def split_by_scale(series: dict[str, dict[int, float]], keys: list[str]) -> tuple[list[str], list[str]]:
    """The `keys` drawn on the left axis and those on a right-hand one (dashed): a series of
    another scale than the figure's first. On one axis DPO's sft_loss (a sum over tokens, ~1000)
    drew its loss (0-3) as a flat line at 0, and rewards of +-20 did the same to accuracy."""
    def scale(key: str) -> float:
        return max((abs(v) for v in series[key].values() if math.isfinite(v)), default=0.0)

    first = scale(keys[0]) if keys else 0.0
    if first == 0.0:
        return keys, []
    right = [k for k in keys[1:] if scale(k) > first * _SCALE_RATIO or 0.0 < scale(k) < first / _SCALE_RATIO]
    return [k for k in keys if k not in right], right


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value with the `window - 1` before it (fewer at the start), NaN and inf
    left out (one inf would make every later mean inf or NaN); NaN where none is finite (a gap
    stays a gap)."""
    out: list[float] = []
    total, count = 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            total, count = total + v, count + 1
        if i >= window and math.isfinite(values[i - window]):
            total, count = total - values[i - window], count - 1
        out.append(total / count if count else math.nan)
    return out


def plot_pass_at_k(results: dict[str, Any], path: Path) -> Path:
    """An evaluation's pass@k and cons@k against k (1..n), from its results (`posttrain eval`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = list(range(1, int(results["num_tests_per_prompt"]) + 1))
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    for name in ("pass", "cons"):
        # None: no prompt had k judged samples (posttrain.evals), a gap in the curve.
        ax.plot(ks, [math.nan if results[f"{name}@{k}"] is None else results[f"{name}@{k}"] for k in ks],
                marker="o", label=f"{name}@k")
    ax.set_ylim(0, 1.02)
    sampled = "greedy" if results.get("greedy") else f"{len(ks)} samples per prompt"
    _finish(ax, f"{results.get('model')} on {results.get('dataset')} ({results.get('num_prompts')} prompts, "
                f"{sampled})", "share of prompts", xlabel="k")
    ax.set_xticks(ks)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(FigureCanvasAgg(fig), fig, path)


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def _finish(ax: Any, title: str, ylabel: str, xlabel: str = "step", twin: Any = None) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize="medium")
    ax.set_xlabel(xlabel)
    # Steps and k count: a short run's axis read 0, 0.25, ..., 2 (steps that do not exist). Over
    # less than two steps' width the locator has too few integers and falls back to fractions
    # (one step: 0.945, 0.96, ...): widened to the step's neighbours.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lo, hi = ax.get_xlim()
    if hi - lo < 2:
        middle = round((lo + hi) / 2)
        ax.set_xlim(middle - 1, middle + 1)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        twin.set_ylabel(f"{ylabel} (dashed)")
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize="small")


def _save(canvas: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    try:
        canvas.print_png(str(tmp))
        tmp.replace(path)  # a viewer never sees a half-written file
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk kept the part written, or an empty file, on it
        raise
    return path
