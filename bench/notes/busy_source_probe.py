"""Where a warm pull's time goes at a source whose host thread is busy: a timeline of the
source's side of each fetch, per host mode (idle, sleep, spin).

    PYTHONPATH=bench .venv/bin/python bench/notes/busy_source_probe.py --reps 3 [cold_pull args]

Runs ``bench/cold_pull.py`` with its source process instrumented: the source stamps
``time.perf_counter_ns()`` when a fetch arrives, around each post (in the worker thread and
around the engine's wait for it), around each wait for a handle's completion, and when the
reply is queued. At the end it prints, per mode, the median of each step over the fetches.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import cold_pull

from p2pkv.completion import CompletionPoller
from p2pkv.session import producer as producer_mod

STAMPS: list[tuple[str, int, str]] = []
OUT = os.environ.get("PROBE_OUT", f"/tmp/busy_source_probe_{os.getppid()}.json")


def stamp(tag: str) -> None:
    STAMPS.append((tag, time.perf_counter_ns(), threading.current_thread().name))


def wrap_sync(cls: Any, name: str, tag: str) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        stamp(tag + "_in")
        try:
            return inner(*a, **k)
        finally:
            stamp(tag + "_out")

    setattr(cls, name, wrapper)


def wrap_async(cls: Any, name: str, tag: str) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    async def wrapper(*a: Any, **k: Any) -> Any:
        stamp(tag + "_in")
        try:
            return await inner(*a, **k)
        finally:
            stamp(tag + "_out")

    setattr(cls, name, wrapper)


def instrument() -> None:
    wrap_sync(producer_mod.ProducerSide, "_on_fetch", "fetch")
    wrap_sync(producer_mod.ProducerSide, "_post", "post")
    wrap_async(producer_mod.ProducerSide, "_serve_fetch", "serve")
    wrap_async(CompletionPoller, "wait", "poll")
    wrap_sync(producer_mod.ProducerSide, "_reply", "reply")
    emit = cold_pull.emit  # type: ignore[attr-defined]

    def emit_stamped(message: dict[str, Any]) -> None:
        if "mode" in message:
            STAMPS.append(("mode", time.perf_counter_ns(), message["mode"]))
        emit(message)

    cold_pull.emit = emit_stamped  # type: ignore[attr-defined]

    def dump() -> None:
        with open(OUT, "w") as f:
            json.dump(STAMPS, f)

    atexit.register(dump)


def summarise(stamps: list[list[Any]]) -> None:
    mode = "idle"
    fetches: list[tuple[str, list[tuple[str, int, str]]]] = []
    cur: list[tuple[str, int, str]] | None = None
    for tag, t, extra in stamps:
        if tag == "mode":
            mode = extra
            continue
        if tag == "fetch_in":
            cur = []
            fetches.append((mode, cur))
        if cur is not None:
            cur.append((tag, t, extra))
    steps: dict[str, dict[str, list[float]]] = {}
    for mode, ev in fetches:
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        posts = 0
        polls = 0
        post_thread = 0.0
        for tag, t, _ in ev:
            first.setdefault(tag, t)
            last[tag] = t
            posts += tag == "post_in"
            polls += tag == "poll_in"
        if "reply_in" not in first or "post_in" not in first:
            continue
        ins = [t for tag, t, _ in ev if tag == "post_in"]
        outs = [t for tag, t, _ in ev if tag == "post_out"]
        post_thread = sum(b - a for a, b in zip(ins, outs, strict=False)) / 1e6
        row = {
            "fetch frame to first post begins (ms)": (first["post_in"] - first["fetch_in"]) / 1e6,
            "posts (count)": posts,
            "inside posts, summed (ms)": post_thread,
            "first post begins to last post ends (ms)": (last["post_out"] - first["post_in"]) / 1e6,
            "last post ends to first wait (ms)": (first["poll_in"] - last["post_out"]) / 1e6,
            "waits (count)": polls,
            "first wait to last wait ends (ms)": (last["poll_out"] - first["poll_in"]) / 1e6,
            "last wait ends to reply (ms)": (first["reply_in"] - last["poll_out"]) / 1e6,
            "fetch frame to reply (ms)": (first["reply_in"] - first["fetch_in"]) / 1e6,
        }
        for k, v in row.items():
            steps.setdefault(mode, {}).setdefault(k, []).append(v)
    for mode, rows in steps.items():
        n = len(next(iter(rows.values())))
        print(f"source side of a fetch, host {mode} ({n} fetches, medians):")
        for k, vals in rows.items():
            print(f"  {k:<46}{statistics.median(vals):9.2f}")


def main() -> int:
    if "source" in sys.argv:
        instrument()
    cold_pull.__file__ = os.path.abspath(__file__)  # its source process runs this script
    rc: int = cold_pull.main()
    if "source" not in sys.argv:
        with open(f"/tmp/busy_source_probe_{os.getpid()}.json") as f:
            summarise(json.load(f))
    return rc


if __name__ == "__main__":
    sys.exit(main())
