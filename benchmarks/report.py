"""What a run prints and writes: the table lines, the grid table (the one docs/benchmarks/README.md
shows), the summary against targets.json, results.csv and gflops.png."""

import csv
import json
import statistics
from pathlib import Path

from .cases import DTYPES, IMPLS

TARGETS = json.loads(Path(__file__).with_name("targets.json").read_text())
SKIPPED = "skipped (memory)"
TABLE_COLUMNS = (("case", 30), ("dtype", 9), ("impl", 10), ("time ms", 16), ("x sdpa", 7),
                 ("GFLOP/s", 8), ("% limit", 7))
CSV_FIELDS = ("section", "mode", "case", "B", "H", "Lq", "Lk", "D", "dtype", "impl", "threads",
              "status", "time_ms", "ratio_vs_sdpa", "gflops", "pct_limit", "kv_gbps")


def result_row(case, impl, samples, limit, sdpa_seconds, threads):
    """One implementation on one case; `samples` are its per-round medians in seconds (None:
    skipped for memory)."""
    row = {
        "section": case.section, "mode": case.mode, "case": case.label, "B": case.batch,
        "H": case.heads, "Lq": case.lq, "Lk": case.lk, "D": case.dim, "dtype": case.dtype,
        "impl": impl, "threads": threads, "status": "ok", "time_ms": None, "samples_ms": None,
        "ratio_vs_sdpa": None, "gflops": None, "pct_limit": None, "kv_gbps": None,
    }
    if samples is None:
        row["status"] = SKIPPED
        return row
    seconds = statistics.median(samples)
    row["time_ms"] = seconds * 1e3
    row["samples_ms"] = [s * 1e3 for s in samples]
    row["gflops"] = case.flops / seconds / 1e9
    row["pct_limit"] = 100 * row["gflops"] / limit[case.dtype]
    if sdpa_seconds is not None:
        row["ratio_vs_sdpa"] = sdpa_seconds / seconds
    if case.section == "decode":
        row["kv_gbps"] = case.kv_bytes / seconds / 1e9
    return row


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def table_header():
    cells = [f"{name:<{w}}" if i < 3 else f"{name:>{w}}"
             for i, (name, w) in enumerate(TABLE_COLUMNS)]
    line = " ".join(cells) + "  note"
    return line + "\n" + "-" * len(line)


def table_line(row, copy_gbps=None):
    note = ""
    if row["kv_gbps"] is not None:
        note = f"K/V {row['kv_gbps']:.1f} GB/s"
        if copy_gbps:
            note += f" ({100 * row['kv_gbps'] / copy_gbps:.0f}% of copy)"
    time_cell = row["status"] if row["status"] != "ok" else _num(row["time_ms"], ".2f")
    return (f"{row['case']:<30} {row['dtype']:<9} {row['impl']:<10} {time_cell:>16} "
            f"{_num(row['ratio_vs_sdpa'], '.2f'):>7} {_num(row['gflops'], '.1f'):>8} "
            f"{_num(row['pct_limit'], '.1f'):>7}  {note}").rstrip()


def grid_table(rows):
    """The grid as docs/benchmarks/README.md shows it: one line per case, ours against SDPA."""
    by_case = {}
    for r in rows:
        if r["section"] == "grid" and r["status"] == "ok":
            key = (r["dtype"], r["mode"], r["B"], r["H"], r["D"], r["Lq"])
            by_case.setdefault(key, {})[r["impl"]] = r
    lines = ["dtype    pass  B  H     L    D |   ours ms   sdpa ms x sdpa | ours GF/s % limit "
             "| sdpa %"]
    for key in sorted(by_case, key=lambda k: (k[0] != "float32",) + k[1:]):
        dtype, mode, batch, heads, dim, length = key
        impls = by_case[key]
        if "ours" not in impls or "sdpa" not in impls:
            continue
        o, s = impls["ours"], impls["sdpa"]
        lines.append(f"{dtype:<8} {mode:<4} {batch:>2} {heads:>2} {length:>5} {dim:>4} | "
                     f"{o['time_ms']:>9.2f} {s['time_ms']:>9.2f} {o['ratio_vs_sdpa']:>6.2f} | "
                     f"{o['gflops']:>9.1f} {o['pct_limit']:>7.1f} | {s['pct_limit']:>6.1f}")
    return lines


def cell_ratios(rows):
    """Our ratio vs SDPA per cell of the grid and short sections (theirs never share an L):
    {(dtype, mode, B, H, D, L): ratio}."""
    return {(r["dtype"], r["mode"], r["B"], r["H"], r["D"], r["Lq"]): r["ratio_vs_sdpa"]
            for r in rows if r["section"] in ("grid", "short") and r["status"] == "ok"
            and r["impl"] == "ours" and r["ratio_vs_sdpa"] is not None}


def grid_comparison(rows, base_rows):
    """Each grid and short cell of both runs: its ratio vs SDPA in each, and this run's over the
    base's; then their median, lowest and highest. Ratios, not times, so that runs on a machine
    whose speed drifts between them compare (each ratio is within one run)."""
    now, base = cell_ratios(rows), cell_ratios(base_rows)
    cells = sorted(now.keys() & base.keys(), key=lambda k: (k[0] != "float32",) + k[1:])
    lines = ["dtype    pass  B  H     L    D | x sdpa base | x sdpa now | now / base"]
    changes = []
    for dtype, mode, batch, heads, dim, length in cells:
        key = (dtype, mode, batch, heads, dim, length)
        changes.append(now[key] / base[key])
        lines.append(f"{dtype:<8} {mode:<4} {batch:>2} {heads:>2} {length:>5} {dim:>4} | "
                     f"{base[key]:>11.2f} | {now[key]:>10.2f} | {changes[-1]:>10.2f}")
    if changes:
        median = statistics.median(changes)
        lines.append(f"now / base over {len(changes)} cells: median {median:.2f}, "
                     f"lowest {min(changes):.2f}, highest {max(changes):.2f}")
    return lines


def check(what, value, target=None, met=None, where=""):
    return {"what": what, "value": value, "target": target, "met": met, "where": where}


def at_least(what, value, target, where=""):
    """A check that `value` reaches `target`; a figure without a target when target is None."""
    return check(what, value, target, None if target is None else value >= target, where)


def summarize(rows, copy_gbps, scaling, memory, accuracy):
    """This run's numbers against TARGETS: a list of checks."""
    checks = []
    ok = [r for r in rows if r["impl"] == "ours" and r["status"] == "ok"
          and r["ratio_vs_sdpa"] is not None]
    grid = [r for r in ok if r["section"] == "grid"]
    if grid:
        worst = min(grid, key=lambda r: r["ratio_vs_sdpa"])
        checks.append(check("lowest ratio vs SDPA on the grid", worst["ratio_vs_sdpa"],
                            where=f"{worst['case']} {worst['dtype']}"))
    for key, target in TARGETS["grid_lowest_ratio"].items():
        group = [r for r in grid if f"{r['mode']} {r['dtype']}" == key]
        if group:
            worst = min(group, key=lambda r: r["ratio_vs_sdpa"])
            checks.append(at_least(f"grid {key}: lowest ratio vs SDPA", worst["ratio_vs_sdpa"],
                                   target, worst["case"]))
            median = statistics.median(r["ratio_vs_sdpa"] for r in group)
            checks.append(at_least(f"grid {key}: median ratio vs SDPA", median,
                                   TARGETS["grid_median_ratio"].get(key)))
    for key, target in TARGETS["grid_lowest_pct_limit_from_L2048"].items():
        group = [r for r in grid if f"{r['mode']} {r['dtype']}" == key and r["Lq"] >= 2048]
        if group:
            worst = min(group, key=lambda r: r["pct_limit"])
            median = statistics.median(r["pct_limit"] for r in group)
            checks.append(at_least(f"% of limit at L>=2048, {key}: lowest (median {median:.1f})",
                                   worst["pct_limit"], target, worst["case"]))
    for length, target in TARGETS["short_lowest_ratio"].items():
        group = [r for r in ok if r["section"] == "short" and r["Lq"] == int(length)]
        if group:
            worst = min(group, key=lambda r: r["ratio_vs_sdpa"])
            checks.append(at_least(f"L={length}: lowest ratio vs SDPA", worst["ratio_vs_sdpa"],
                                   target, f"{worst['case']} {worst['dtype']}"))
    copy_share = TARGETS["decode_kv_share_of_copy_at_lq1"]
    for r in (r for r in ok if r["section"] == "decode"):
        where = f"{r['case']} {r['dtype']}"
        sdpa_row = next(s for s in rows if s["impl"] == "sdpa" and s["case"] == r["case"]
                        and s["dtype"] == r["dtype"])
        rates = f"K/V GB/s ours {r['kv_gbps']:.1f}, SDPA {sdpa_row['kv_gbps']:.1f}"
        checks.append(at_least(f"decode ratio vs SDPA ({rates})", r["ratio_vs_sdpa"],
                               TARGETS["decode_ratio"].get(str(r["Lq"])), where))
        if r["Lq"] == 1:
            checks.append(at_least(f"decode K/V GB/s vs {copy_share:.0%} of copy_ "
                                   f"{copy_gbps:.1f} GB/s", r["kv_gbps"], copy_share * copy_gbps,
                                   where))
    for impl, result in (scaling or {}).items():
        for mode in ("fwd", "bwd"):
            target = TARGETS["ours_two_threads_speedup"] if impl == "ours" else None
            checks.append(at_least(f"{impl} {mode}: 2 threads vs 1", result[f"{mode}_speedup"],
                                   target, f"B=H=1 L={result['L']} D=64 float32"))
    for result in memory or []:
        if "ratio" not in result:
            checks.append(check(f"{result['impl']} peak RSS growth: FAILED", None, None, False,
                                result["error"][-300:]))
            continue
        target = TARGETS["ours_memory_ratio"] if result["impl"] == "ours" else None
        checks.append(check(f"{result['impl']} peak RSS growth / (inputs+outputs+gradients)",
                            result["ratio"], target,
                            None if target is None else result["ratio"] <= target,
                            f"f+b B=H=1 L={result['L']} D=64 float32, "
                            f"{result['peak_growth_bytes'] / 2**20:.1f} MiB vs "
                            f"{result['inputs_outputs_gradients_bytes'] / 2**20:.1f} MiB"))
    if accuracy:
        errors = accuracy["max_abs_error"]
        where = "B={B} H={H} L={L} D={D}".format(**accuracy["shape"])
        for name in ("out", "dq", "dk", "dv"):
            what = f"bf16 max|{name} - float64|: ours (SDPA {errors['sdpa'][name]:.3g})"
            if name == "out":
                checks.append(check(what, errors["ours"][name], where=where))
            else:
                checks.append(check(what, errors["ours"][name], errors["sdpa"][name],
                                    errors["ours"][name] < errors["sdpa"][name], where))
    return checks


def format_check(c):
    def num(value):
        return "-" if value is None else f"{value:.3g}"

    verdict = {True: "met", False: "MISSED", None: ""}[c["met"]]
    target = "" if c["target"] is None else f" (target {num(c['target'])})"
    where = f"  [{c['where']}]" if c["where"] else ""
    return f"  {c['what']}: {num(c['value'])}{target} {verdict}{where}".rstrip()


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path, rows, limit, dim=64, bh=(1, 8)):
    """GFLOP/s against L, one line per implementation and dtype; forward and forward+backward
    side by side; D=dim, (B, H)=bh; the block-product limit as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(IMPLS, ("tab:blue", "tab:red", "tab:green", "tab:gray")))
    styles = {"float32": "-", "bfloat16": "--"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (mode, title) in zip(axes, (("fwd", "forward"), ("f+b", "forward+backward"))):
        lengths = set()
        for impl in IMPLS:
            for dtype in DTYPES:
                points = sorted((r["Lq"], r["gflops"]) for r in rows
                                if r["section"] in ("grid", "short") and r["mode"] == mode
                                and r["impl"] == impl and r["dtype"] == dtype
                                and r["status"] == "ok" and r["D"] == dim
                                and (r["B"], r["H"]) == bh)
                if points:
                    xs, ys = zip(*points)
                    lengths.update(xs)
                    ax.plot(xs, ys, styles[dtype], color=colors[impl], marker="o",
                            label=f"{impl} {dtype}")
        for dtype, value in limit.items():
            ax.axhline(value, color="black", linestyle=styles[dtype], linewidth=0.8,
                       label=f"limit {dtype}")
        ax.set_xscale("log", base=2)
        if lengths:
            ax.set_xticks(sorted(lengths), [str(x) for x in sorted(lengths)])
        ax.set_title(f"{title}, B={bh[0]} H={bh[1]} D={dim}")
        ax.set_xlabel("L")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GFLOP/s (causal FLOPs)")
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
