"""What /proc says of this process and this machine, for the benchmarks that measure memory, and
where their report goes."""

import json


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_name() -> str:
    """The model name /proc/cpuinfo gives this machine's CPU."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def write_report(out, report: dict) -> None:
    """The report as JSON at ``out`` (a Path), its folder made where missing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
