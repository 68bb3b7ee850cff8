"""A step trace of single requests in vLLM with tiercache: where a hit's milliseconds
go, phase by phase, and whether each phase worked, waited for a core or was blocked.

    python benchmarks/step_trace.py run /tmp/trace -- python benchmarks/inflight_ab.py --order on --prompts 8
    python benchmarks/step_trace.py report /tmp/trace --skip 3 --cycle cold,inflight,pc,cpu

`run` starts the command with benchmarks/step_trace/ first on PYTHONPATH, so that every
Python process it starts (the benchmark, vLLM's engine core, its worker) installs the
tracer (step_trace/tiercache_step_trace.py) and appends marks to <dir>/<pid>.jsonl.
The marks cost a few microseconds each; a traced run is not a timing run.

`report` takes the requests in the order the engine core received them, drops
`--skip` warm-ups, names the rest by `--cycle` (inflight_ab.py sends cold, in-flight
hit, prefix-cache hit, quiet CPU hit per prompt) and prints, per name, the median of
each phase of the request's first step. With `--per-engine` (a run of several engines,
as inflight_ab.py's A/Bs are) each engine's requests are skipped and named apart, the
names marked `@<engine's number>`:

  scheduled   the engine core received the request -> its scheduler planned the step
  handed      the plan done -> the worker starts the step
  inputs      the worker prepares the step (vLLM's input preparation, the connector's
              step and load hooks) up to the model's forward
  forward     the model's forward, with the hit copied in beside it
  token out   the forward's end -> the engine core takes the step's output
  total       received -> output taken
  gc          time in garbage collections, in any traced process, within total
  gc_count    how many collections overlapped it

and for `inputs` and `forward`, the worker thread's time running, waiting for a core
and blocked (neither: the interpreter lock, most often)."""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = ("scheduled", "handed", "inputs", "forward", "token_out", "total", "gc", "gc_count")
SPLIT = ("ran", "waited", "blocked")


def run(folder: str, command: list[str]) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "step_trace"), env.get("PYTHONPATH")]))
    # Not TIERCACHE_*: that prefix is tiercache's config, which refuses unknown keys.
    env["STEP_TRACE_DIR"] = str(Path(folder).resolve())
    return subprocess.call(command, env=env)


def load(folder: str) -> list[dict[str, Any]]:
    marks = []
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        pid = Path(path).stem
        with open(path) as lines:
            text = lines.read().splitlines()
        for line in text:
            try:
                mark = json.loads(line)
            except json.JSONDecodeError:  # a process killed mid-line
                continue
            mark["pid"] = pid
            marks.append(mark)
    return sorted(marks, key=lambda m: m["t"])


def collections(marks: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, stop) of every garbage collection, in any process."""
    started: dict[tuple[str, str], dict[str, Any]] = {}
    found = []
    for mark in marks:
        if mark["n"] == "gc.start":
            started[mark["pid"], mark["th"]] = mark
        elif mark["n"] == "gc.stop" and (begun := started.pop((mark["pid"], mark["th"]), None)):
            found.append((begun["t"], mark["t"]))
    return found


class Timeline:
    def __init__(self, marks: list[dict[str, Any]]):
        self.marks = marks  # in time order
        self._times = [mark["t"] for mark in marks]
        self.collections = collections(marks)

    def next(self, name: str, after: float) -> dict[str, Any]:
        for i in range(bisect.bisect_left(self._times, after), len(self.marks)):
            if self.marks[i]["n"] == name:
                return self.marks[i]
        raise LookupError(f"no {name} after {after}")

    def first_step(self, received: dict[str, Any]) -> dict[str, float]:
        """The phases of the first step that ran a request received at `received`."""
        planned = self.next("Scheduler.schedule<", self.next("Scheduler.schedule>", received["t"])["t"])
        # The worker may take the step a hair before the engine core's mark is written.
        starts = self.next("GPUModelRunner.execute_model>", planned["t"] - 0.0005)
        forward = self.next("GPUModelRunner._model_forward>", starts["t"])
        forward_end = self.next("GPUModelRunner._model_forward<", forward["t"])
        taken = self.next("Scheduler.update_from_output>", forward_end["t"])
        row = {
            "scheduled": planned["t"] - received["t"],
            "handed": starts["t"] - planned["t"],
            "inputs": forward["t"] - starts["t"],
            "forward": forward_end["t"] - forward["t"],
            "token_out": taken["t"] - forward_end["t"],
            "total": taken["t"] - received["t"],
        }
        inside = [
            min(stop, taken["t"]) - max(start, received["t"])
            for start, stop in self.collections
            if start < taken["t"] and stop > received["t"]
        ]
        row["gc"], row["gc_count"] = sum(inside), len(inside)
        for phase, (a, b) in (("inputs", (starts, forward)), ("forward", (forward, forward_end))):
            ran, waited = b["ran"] - a["ran"], b["waited"] - a["waited"]
            row[f"{phase}_ran"], row[f"{phase}_waited"] = ran, waited
            row[f"{phase}_blocked"] = max(0.0, b["t"] - a["t"] - ran - waited)
        return row


def shown(column: str, value: float) -> float:
    """Times in milliseconds, counts as they are."""
    return value if column == "gc_count" else 1000 * value


def named_requests(
    marks: list[dict[str, Any]], skip: int, cycle: list[str], per_engine: bool
) -> list[tuple[str, dict[str, Any]]]:
    """Each request's received mark and its name from `cycle`, after `skip` warm-ups in
    the whole run, or in each engine (`per_engine`: engines run one after another,
    each with its own warm-ups, and a name gets `@<engine's number>`)."""
    received = [m for m in marks if m["n"] == "EngineCore.preprocess_add_request>"]
    engines: dict[str, list[dict[str, Any]]] = {}
    for mark in received:
        engines.setdefault(mark["pid"] if per_engine else "", []).append(mark)
    named = []
    for number, requests in enumerate(engines.values()):
        suffix = f"@{number}" if per_engine else ""
        for i, mark in enumerate(requests[skip:]):
            named.append((f"{cycle[i % len(cycle)]}{suffix}", mark))
    return named


def report(
    folder: str, skip: int, cycle: list[str], each: bool, per_engine: bool = False
) -> dict[str, dict[str, float]]:
    timeline = Timeline(load(folder))
    rows: dict[str, list[dict[str, float]]] = {}
    for name, mark in named_requests(timeline.marks, skip, cycle, per_engine):
        row = timeline.first_step(mark)
        rows.setdefault(name, []).append(row)
        if each:  # the name, and which of its kind (the prompt's number)
            values = " ".join(f"{k}={shown(k, v):.1f}" for k, v in row.items())
            print(f"{name}/{len(rows[name]) - 1} {values}")
    columns = [*PHASES, *(f"{p}_{s}" for p in ("inputs", "forward") for s in SPLIT)]
    medians = {
        name: {c: shown(c, statistics.median(r[c] for r in got)) for c in columns}
        for name, got in rows.items()
    }
    print("| request (median ms) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, values in medians.items():
        print(f"| {name} ({len(rows[name])}) | " + " | ".join(f"{values[c]:.1f}" for c in columns) + " |")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="action", required=True)
    run_args = sub.add_parser("run", help="run a command with the tracer in every Python process")
    run_args.add_argument("folder")
    run_args.add_argument("command", nargs=argparse.REMAINDER)
    report_args = sub.add_parser("report", help="phases of each request's first step")
    report_args.add_argument("folder")
    report_args.add_argument("--skip", type=int, default=3, help="warm-up requests first")
    report_args.add_argument(
        "--cycle", default="cold,inflight,pc,cpu", help="names of the requests, repeating"
    )
    report_args.add_argument("--each", action="store_true", help="also print every request")
    report_args.add_argument(
        "--per-engine",
        action="store_true",
        help="skip and name each engine's requests apart (a run of engines one after another)",
    )
    args = parser.parse_args()
    if args.action == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        sys.exit(run(args.folder, command))
    report(args.folder, args.skip, args.cycle.split(","), args.each, args.per_engine)


if __name__ == "__main__":
    main()
