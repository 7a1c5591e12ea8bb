"""Every time the benchmarks report comes from torch.utils.benchmark: blocked_autorange's median
at a given thread count, over rounds that take every compared callable in turn."""

import statistics

from torch.utils import benchmark


def timer(fn, threads):
    """A Timer of fn() at `threads` intra-op threads (set for the measurement, then restored)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)


def interleaved_medians(timers, rounds, min_run_time):
    """{label: per-round medians, in seconds}: `rounds` rounds, each running blocked_autorange
    (whose first calls are the warm-up that sizes its blocks) on every timer in turn, so that a
    drift of the machine's speed reaches all of them alike."""
    samples = {label: [] for label in timers}
    for _ in range(rounds):
        for label, t in timers.items():
            samples[label].append(t.blocked_autorange(min_run_time=min_run_time).median)
    return samples


def interleaved_median(timers, rounds, min_run_time):
    """{label: the median over the rounds of interleaved_medians, in seconds}."""
    return {label: statistics.median(values)
            for label, values in interleaved_medians(timers, rounds, min_run_time).items()}
