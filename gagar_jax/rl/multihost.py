"""The loop on several hosts: who does what, the exchanges between hosts, and their deadline.

Every host (JAX process) runs the same loop. What each one does:

* **Rollouts.** The ``G`` groups of a step are ``P`` blocks of ``G / P`` (``P`` processes);
  process ``p`` fills block ``p``: it generates and verifies the prompts of its block only, on
  its own devices (embedded sampler) or against the SGLang servers. Every host draws the same
  prompt indices from the task stream (so the data position advances identically) and each
  prompt's samples are seeded by its global data position, so a prompt's rollouts do not depend
  on the number of hosts. Block ``p`` is exactly the rows of the global ``[G * K, T]`` batch that
  process ``p``'s devices hold: the batch is assembled with
  ``jax.make_array_from_process_local_data`` and no host holds another host's rollouts.
* **Dynamic sampling.** After every round the hosts exchange how many mixed groups each block
  holds (and the outcome counts); the next round's prompts per block follow from these global
  counts, so every host runs the same number of rounds and raises the same error at the cap.
* **Grading.** One grading pool per host grades that host's kept groups; the verdicts (tier,
  rank, graded, cheat per slot, fallback reason) are exchanged, so every host builds the same
  replicated ``[G, K]`` arrays and the same grading metrics; a fallback on one host is the
  fallback everywhere.
* **Weight sync.** The embedded sampler on each host gets its copy of the sharded parameters
  device to device. SGLang servers shared by the hosts: every host takes part in the streamed
  export's gathers; process ``rollout.weight_writer`` alone writes it and updates the servers;
  the hosts exchange the outcome (a failure is the same ``WeightSyncError`` everywhere) and the
  others wait until the servers report the new version before they sample
  (``gagar_jax.rollout.SGLangEngine``, ``writer`` / ``exchange``).
* **Metrics and plots.** The step's counters are reduced over hosts (sums; times: the slowest
  host); process 0 writes them.
* **Checkpoints.** Every host takes part in the orbax save of the sharded state; process 0
  writes the loop's bookkeeping after the save is finished (the workdir must be shared).

Exchanges go through the key-value store of ``jax.distributed``'s coordination service (the
one orbax uses for its barriers), with a deadline (``mesh.host_timeout_s``), and every process
bumps a heartbeat counter there every ``HEARTBEAT_S`` seconds from a thread: a host that does
not post its part in time and whose heartbeat stopped is dead or hung, and every other host
ends the run with a :class:`HostError` naming it, instead of waiting for it forever (a late
host whose heartbeat still moves is waited for up to ``MAX_EXTENSIONS`` more deadlines). Phases
inside collectives (update, weight sync, checkpoint save) have a watchdog with the same rule.
The store's client is reached through ``jax._src.distributed.global_state`` (what
``orbax.checkpoint.multihost`` does; JAX has no public accessor).

With one process every exchange returns its own part at once: the single-host loop is the same
code.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from gagar_jax.models import BATCH_AXES

HEARTBEAT_S = 2.0  # each process bumps a counter in the key-value store this often
# A host that is late but alive (its heartbeat moves: compiling, a slow round) is waited for
# this many more deadlines before it counts as stuck; a dead or hung one ends the run at once.
MAX_EXTENSIONS = 3
_HEARTBEAT_STARTED: list[int] = []


class HostError(RuntimeError):
    """Another process is dead, hung or unreachable: the run cannot continue on this host."""


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised (several processes need it)")
    return client


class Hosts:
    """This process's view of the run's processes, and the deadline-bounded exchanges.

    Args:
      timeout_s: how long an exchange waits for the other hosts (``mesh.host_timeout_s``); it
        must exceed the longest a host may lag the others at an exchange point (a generation
        round, the grading deadline, a checkpoint save).
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"mesh.host_timeout_s must be > 0, got {timeout_s!r}")
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.timeout_s = float(timeout_s)
        self._client = _client() if self.count > 1 else None
        self._previous_key: str | None = None
        if self._client is not None and not _HEARTBEAT_STARTED:
            _HEARTBEAT_STARTED.append(self.index)
            threading.Thread(target=self._beat, daemon=True, name="gagar-heartbeat").start()

    @property
    def primary(self) -> bool:
        return self.index == 0

    def allgather(self, tag: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON-serialisable), in process order, on every process.

        ``tag`` must name this exchange uniquely within the run (e.g. ``"s3/r2/counts"``) and be
        the same on every host. Values come back JSON round-tripped on every host, this one's
        included, so all hosts see identical Python objects.

        Raises:
          HostError: some process did not post its value within ``timeout_s`` (names them), or
            the coordination service (on process 0) is unreachable.
        """
        own = json.loads(json.dumps(value))
        if self.count == 1:
            return [own]
        key = f"gagar/{tag}"
        self._client.key_value_set(f"{key}/{self.index}", json.dumps(value))
        out: list[Any] = []
        for q in range(self.count):
            if q == self.index:
                out.append(own)
                continue
            for attempt in range(MAX_EXTENSIONS + 1):
                try:
                    out.append(
                        json.loads(
                            self._client.blocking_key_value_get(
                                f"{key}/{q}", int(self.timeout_s * 1000)
                            )
                        )
                    )
                    break
                except Exception as e:  # noqa: BLE001 -- timeout or dead coordinator
                    # alive (heartbeat moving) but slow, e.g. compiling: wait once more
                    if (
                        attempt < MAX_EXTENSIONS
                        and "DEADLINE_EXCEEDED" in str(e)
                        and q not in self.stale_processes()
                    ):
                        continue
                    raise self._error(tag, key, e) from e
        # every host has read the previous exchange once it posted this one: drop ours
        if self._previous_key is not None:
            try:
                self._client.key_value_delete(self._previous_key)
            except Exception:  # noqa: BLE001, S110 -- housekeeping only
                pass
        self._previous_key = f"{key}/{self.index}"
        return out

    def barrier(self, tag: str) -> None:
        """Waits (deadline-bounded) until every process has reached ``tag``."""
        self.allgather(tag, None)

    @contextlib.contextmanager
    def collective(self, phase: str):
        """Runs a phase with cross-host collectives (update, weight sync, checkpoint save).

        A peer that dies inside the phase breaks its collectives (gloo on CPU: "Connection
        reset by peer"); the survivors then meet at a short barrier, which names the process
        that does not come, and end with a :class:`HostError`. A peer that hangs inside it
        (a collective waits for it forever) is caught by a watchdog: past ``timeout_s`` it
        names the processes whose heartbeat stopped, prints the error and ends this process
        (exit status 3; a thread cannot interrupt a collective).
        """
        if self.count == 1:
            yield
            return
        done = threading.Event()

        def watchdog():
            for attempt in range(MAX_EXTENSIONS + 1):
                if done.wait(self.timeout_s):
                    return
                stale = self.stale_processes()
                if stale or attempt == MAX_EXTENSIONS:
                    break  # else: every host alive (heartbeats moving), e.g. compiling: wait
            who = (
                f"process{'es' if len(stale) > 1 else ''} {', '.join(map(str, stale))} "
                "stopped sending heartbeats (hung)"
                if stale
                else "every process still sends heartbeats (stuck?)"
            )
            print(
                f"error: {HostError.__name__}: process {self.index}: {phase} did not finish "
                f"within {self.timeout_s:g}s (mesh.host_timeout_s): {who}; ending the run",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)

        threading.Thread(target=watchdog, daemon=True, name="gagar-watchdog").start()
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            short = Hosts(min(self.timeout_s, 30.0))
            short.barrier(f"failed/{phase}")  # raises, naming the dead process(es)
            raise HostError(
                f"process {self.index}: a collective failed in {phase} while every "
                f"process is alive: {e}"
            ) from e
        finally:
            done.set()

    def _beat(self) -> None:
        n = 0
        while True:
            n += 1
            try:
                self._client.key_value_set(
                    f"gagar/alive/{self.index}", str(n), allow_overwrite=True
                )
            except Exception:  # noqa: BLE001 -- the service is gone: nothing left to tell
                return
            time.sleep(HEARTBEAT_S)

    def stale_processes(self, wait_s: float = 3 * 2.0) -> list[int]:
        """Other processes whose heartbeat counter did not move for ``wait_s`` seconds."""

        def read():
            out = {}
            for q in range(self.count):
                if q != self.index:
                    try:
                        out[q] = self._client.key_value_try_get(f"gagar/alive/{q}")
                    except Exception:  # noqa: BLE001 -- never beat: counts as stale
                        out[q] = None
            return out

        before = read()
        time.sleep(wait_s)
        after = read()
        return [q for q in before if before[q] == after[q]]

    def _error(self, tag: str, key: str, cause: Exception) -> HostError:
        missing, reachable = [], True
        for q in range(self.count):
            if q == self.index:
                continue
            try:
                if self._client.key_value_try_get(f"{key}/{q}") is None:
                    missing.append(q)
            except Exception as e:  # noqa: BLE001 -- NOT_FOUND is how a missing key is reported
                if "NOT_FOUND" in str(e):
                    missing.append(q)
                else:
                    reachable = False
                    break
        if not reachable:
            return HostError(
                f"process {self.index}: the coordination service (process 0) is unreachable at "
                f"exchange {tag!r}: process 0 is dead ({type(cause).__name__}: "
                f"{str(cause)[:200]})"
            )
        names = ", ".join(str(q) for q in missing) or "?"
        return HostError(
            f"process {self.index}: process{'es' if len(missing) > 1 else ''} {names} did not "
            f"reach exchange {tag!r} within {self.timeout_s:g}s (mesh.host_timeout_s): dead or "
            f"hung; ending the run ({type(cause).__name__}: {str(cause)[:200]})"
        )


def check_process_rows(mesh, num_rows: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the ``[num_rows, T]`` batch this process's devices hold.

    The loop's blocks need them contiguous, equal in size and in process order (process ``p``
    holds block ``p``), which a mesh built from ``jax.devices()`` with the batch axes
    ``('data', 'fsdp')`` leading gives.

    Raises:
      ValueError: the mesh lays the batch rows out otherwise (names ``mesh.shape``).
    """
    from jax.sharding import NamedSharding, PartitionSpec

    P, p = jax.process_count(), jax.process_index()
    if num_rows % P:
        raise ValueError(f"{num_rows} batch rows do not split over {P} processes")
    sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map((num_rows, 1)).values():
        rows.update(range(*idx[0].indices(num_rows)))
    per = num_rows // P
    if rows != set(range(p * per, (p + 1) * per)):
        raise ValueError(
            f"mesh.shape={tuple(mesh.devices.shape)}: process {p} holds batch rows "
            f"{sorted(rows)[:8]}..., expected the contiguous block [{p * per}, {(p + 1) * per}): "
            "the batch axes ('data', 'fsdp') must split the rows by process (a tensor axis "
            "spanning processes, or a reordered device mesh, does not)"
        )
    return p * per, (p + 1) * per


def prompt_seed(words, *key: int) -> int:
    """A sampler seed in ``[0, 2**32)`` from the run's key words and a prompt's global key."""
    return int(np.random.default_rng([*(int(w) for w in words), *key]).integers(2**32))
