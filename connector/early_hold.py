"""How the scheduler's process finds the workers' foreground gates, to hold the movers
from the moment it plans a step that serves a hit (tiercache/foreground.py).

On vLLM's CPU backend the engine core (the scheduler) and each worker are separate
processes, the workers started by the engine core. Each worker publishes its gate's
page in /dev/shm under a name made of the engine's id, the engine core's process id
(the worker's parent) and its rank; the scheduler, built after the workers registered
their KV caches, opens each rank's page and removes its name. Where the processes are
laid out otherwise (one process, or workers not started by the engine core), the
scheduler finds no page and the hold starts in the worker, as it would without this."""

from __future__ import annotations

import logging
import os

from tiercache.foreground import GateFlag

log = logging.getLogger("tiercache.connector")

SHM_DIR = "/dev/shm"


def gate_page_path(engine_id: str, engine_core_pid: int, rank: int) -> str:
    safe_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return os.path.join(SHM_DIR, f"tiercache-gate-{safe_id}-{engine_core_pid}-{rank}")


def publish_gate_page(engine_id: str, rank: int) -> GateFlag | None:
    """The worker's side: its gate's page, under the name its engine core looks for.
    None (the hold then starts in the worker only) where /dev/shm cannot take it."""
    path = gate_page_path(engine_id, os.getppid(), rank)
    try:
        return GateFlag.published(path)
    except OSError as error:
        log.warning("tiercache: holds start in the worker only: cannot publish %s (%s)", path, error)
        return None


class EarlyHold:
    """The scheduler's side: announces a step that serves a hit to every rank's gate."""

    def __init__(self, engine_id: str, ranks: int):
        self._paths = [gate_page_path(engine_id, os.getpid(), rank) for rank in range(ranks)]
        # The ranks' pages found; a rank without one holds from its own step only.
        self.pages: list[GateFlag] = []
        self.announced = 0  # steps announced (for tests)
        for path in self._paths:
            try:
                self.pages.append(GateFlag.joined(path))
            except FileNotFoundError:
                log.debug("tiercache: no gate page at %s: holds start in the worker", path)
            except OSError as error:
                log.warning("tiercache: holds start in the worker only: cannot open %s (%s)", path, error)

    def announce(self) -> None:
        if not self.pages:
            return
        if any(page.announce() for page in self.pages):
            self.announced += 1

    def close(self) -> None:
        pages, self.pages = self.pages, []
        for page in pages:
            page.close()
