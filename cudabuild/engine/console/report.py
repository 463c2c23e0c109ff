"""`cudabuild report`: how long the last builds of a model took, stage by stage.

Reads the store's build log (every finished build's manifest: cudabuild.engine.action_cache.ActionCache.record_build) and
prints a line per build (its number, time, target and settings: the options, and the specs that are
not the same in every build shown, so that builds of other settings are told apart), then one column
per build, one row per stage: its seconds and status, each in a sub-column of its own so that they
line up. `svg()` draws the same as stacked bars, one per build. The SVG is written by hand: a few rectangles and labels need no
plotting library (matplotlib alone is tens of MB for one chart). Engine half; no torch here.
"""

from __future__ import annotations

import html
import time
from typing import Optional

# What a cell says of a stage in a build; LEGEND says it in words under the table.
STATUS_MARK = {"ran": "ran", "restored": "restored", "remote": "remote", "cached": "cached"}
LEGEND = ("ran: the stage executed, its seconds before it; restored: copied from the cache into build/; "
          "remote: from the shared cache; cached: up to date in build/, nothing done; "
          "total: the seconds shown, added up")
# One colour per stage kind, in pipeline order (a qualitative palette that stays legible in grey).
COLOURS = {"probe": "#999999", "export": "#4e79a7", "edge": "#59a14f", "compile": "#e15759",
           "blob": "#edc948", "package": "#f28e2b", "verify": "#76b7b2"}


def history(log: list[dict], model: str, target: Optional[str] = None, last: int = 5) -> list[dict]:
    """The last `last` logged builds of `model` (and `target`), oldest first."""
    builds = [b for b in log if b.get("model") == model and (target is None or b.get("target") == target)]
    return builds[-last:] if last > 0 else []


def _stage_ids(builds: list[dict]) -> list[str]:
    ids: list[str] = []
    for build in builds:
        for row in build.get("stages", []):
            sid = f"{row['stage']}.{row['method']}" if row.get("method") else row["stage"]
            if sid not in ids:
                ids.append(sid)
    return ids


def _cells(build: dict) -> dict[str, tuple[float, str]]:
    return {(f"{r['stage']}.{r['method']}" if r.get("method") else r["stage"]): (float(r.get("seconds") or 0.0), r["status"])
            for r in build.get("stages", [])}


def _when(build: dict) -> str:
    return time.strftime("%m-%d %H:%M", time.localtime(build.get("time", 0)))


def settings(builds: list[dict]) -> list[str]:
    """Per build, its settings as `layers=2 seed=0 decode.max_autotune=ON`: every option, and the
    specs whose value is not the same in all of `builds` (each build has a dozen; these tell them apart)."""
    specs = [{f"{m}.{k}": v for m, keyed in (b.get("specs") or {}).items() for k, v in keyed.items()} for b in builds]
    names = sorted({name for s in specs for name in s})
    logged = [s for b, s in zip(builds, specs) if "specs" in b]
    differing = [n for n in names if len({str(s.get(n)) for s in logged}) > 1]
    shown = []
    for build, spec in zip(builds, specs):
        if "options" not in build:  # logged before the log kept settings
            shown.append("(settings not logged)")
            continue
        words = [f"{k}={_value(v)}" for k, v in sorted(build["options"].items())]
        words += [f"{n}={spec[n]}" if n in spec else f"{n}=(default)" for n in differing]
        shown.append(" ".join(words) or "(no options)")
    return shown


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "''" if value == "" else str(value)


def table(builds: list[dict]) -> list[str]:
    """Rows of text: a line per build (number, time, target, settings), then a column per build of
    seconds and status per stage, then totals, then the legend."""
    if not builds:
        return []
    ids = _stage_ids(builds)
    cells_of = [_cells(b) for b in builds]  # once per build, not once per row
    names = [f"#{i + 1}" for i in range(len(builds))]
    widths = [len("build"), len(_when(builds[0])), max(len(b.get("target", "")) for b in builds + [{"target": "target"}])]
    lines = [_row(["build", "when", "target", "settings"], widths)]
    lines += [_row([name, _when(build), build.get("target", ""), words], widths)
              for name, build, words in zip(names, builds, settings(builds))]
    lines.append("")

    def seconds_text(seconds: float, status: str) -> str:
        return f"{seconds:.1f}s" if status in _TIMED else ""

    totals = [sum(seconds for seconds, status in c.values() if status in _TIMED) for c in cells_of]
    # Two sub-columns per build: the seconds right-aligned, the status left-aligned after them.
    seconds_width = max([len(f"{t:.1f}s") for t in totals] + [len(n) for n in names])
    status_width = max(len(STATUS_MARK.get(status, status)) for c in cells_of for _, status in c.values())
    width = max(len(i) for i in ids + ["stage", "total"]) + 2

    def row(label: str, cells: list[tuple[str, str]]) -> str:
        return (label.ljust(width) + "   ".join(f"{a:>{seconds_width}} {b:<{status_width}}" for a, b in cells)).rstrip()

    lines.append(row("stage", [(name, "") for name in names]))
    for sid in ids:
        cells = []
        for build_cells in cells_of:
            seconds, status = build_cells.get(sid, (0.0, ""))  # "" where the build had no such stage
            cells.append((seconds_text(seconds, status), STATUS_MARK.get(status, status)))
        lines.append(row(sid, cells))
    lines.append(row("total", [(f"{t:.1f}s", "") for t in totals]))
    return lines + [LEGEND]


def _row(words: list[str], widths: list[int]) -> str:
    """Words in columns of `widths`, the last one as long as it is."""
    return "  ".join(w.ljust(width) for w, width in zip(words, widths + [0])).rstrip()


# The statuses whose seconds a cell shows: the stage did something in that build (a cached one did nothing).
_TIMED = ("ran", "restored", "remote")


def svg(builds: list[dict], title: str) -> str:
    """Stacked horizontal bars, one per build, a segment per stage that took time."""
    bar, gap, left, width = 22, 10, 120, 560
    longest = max((sum(s for s, _ in _cells(b).values()) for b in builds), default=0.0) or 1.0
    height = 60 + len(builds) * (bar + gap) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<text x="10" y="20" font-size="14">{html.escape(title)}</text>']
    for i, build in enumerate(builds):
        y = 40 + i * (bar + gap)
        parts.append(f'<g class="build"><text x="10" y="{y + 15}">{html.escape(_when(build))}</text>')
        x, cells = float(left), _cells(build)
        for sid, (seconds, status) in cells.items():
            if seconds <= 0:
                continue
            w = seconds / longest * width
            colour = COLOURS.get(sid.split(".")[0], "#bab0ac")
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colour}">'
                         f'<title>{html.escape(sid)}: {seconds:.1f}s {status}</title></rect>')
            x += w
        total = sum(s for s, _ in cells.values())
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 15}">{total:.1f}s</text></g>')
    legend_y = 40 + len(builds) * (bar + gap) + 10
    for j, (kind, colour) in enumerate(COLOURS.items()):
        parts.append(f'<rect x="{left + j * 90}" y="{legend_y}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{left + j * 90 + 14}" y="{legend_y + 10}">{kind}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
