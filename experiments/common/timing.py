"""Timers and memory: wall seconds of calls (donated state rebound after each), compile time, the load
average and this process's resident set. Stdlib only at import (jax arrays are only blocked on).
"""

import os
import time


def timed(fn, *args, **kwargs) -> tuple:
    """(fn(*args, **kwargs), its wall seconds)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def time_calls(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn() (which blocks), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[1] for _ in range(repeats)]


def time_donating(program, state, *args, repeats: int, warmup: int = 2) -> tuple[list[float], object]:
    """Seconds of each of `repeats` calls of program(state, *args) -> (out, state) after `warmup` untimed
    ones, the donated state rebound after every call; and the last call's output."""
    holder = {"state": state}

    def run():
        out, holder["state"] = program(holder["state"], *args)
        holder["out"] = out.block_until_ready()

    return time_calls(run, repeats, warmup), holder["out"]


def compile_timed(jitted, *args, **kwargs):
    """(jitted lowered and compiled for these arguments, the seconds that took)."""
    return timed(lambda: jitted.lower(*args, **kwargs).compile())


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (a shared machine: well above the core count inflates timings)."""
    return [round(x, 2) for x in os.getloadavg()]


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes; VmHWM is the high-water mark since the last reset_peak_rss()."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def peak_rss_bytes() -> int:
    return rss_bytes()[1]


def reset_peak_rss() -> bool:
    """Start a new VmHWM at the current RSS (Linux >= 4.0: writing 5 to clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False
