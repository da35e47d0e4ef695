"""Starting rank processes: ``torch.multiprocessing`` spawn, gloo on 127.0.0.1, bounded waits.

The launching process hosts the rendezvous store (``TCPStore`` on a free loopback port), so
the store outlives any rank and abort records can always be read. Each rank process runs
with one intra-op thread (ranks share the cores; OpenMP spin-waits would starve the peers
they wait for in every collective), joins the gloo group and then runs what it is given:

* :func:`launch` runs one function on every rank and returns the ranks' results (the
  multi-rank replay uses it);
* :class:`RankGroup` keeps the ranks alive and runs *jobs* sent to them one after another:
  spawning (importing torch in each process) costs seconds, a job on a warm group costs
  milliseconds, so a test module spawns a group once and runs many generated cases on it.
  A job that fails on any rank resets the process group before the next job; a job that
  outlives its timeout kills the group.

A job is a picklable module-level function ``fn(ctx, *args)`` with ``ctx`` a :class:`RankContext`.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tensorrt_llm._torch.distributed.communicator import Communicator
from tensorrt_llm._torch.distributed.errors import DistributedError
from tensorrt_llm.mapping import Mapping

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """How rank processes start. ``hash_seeds`` gives rank r ``PYTHONHASHSEED=hash_seeds[r]``:
    tests run the ranks with different string-hash salts on purpose, so that any decision that
    depends on one shows up as a divergence."""

    collective_timeout_s: float = 60.0
    start_timeout_s: float = 180.0
    num_threads: int = 1
    hash_seeds: tuple[int, ...] | None = None
    log_level: int = logging.WARNING


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a job gets on its rank. A long-running job (a serving loop) talks to the launching
    process through :meth:`receive` (messages :meth:`RankGroup.send` sent to this rank) and
    :meth:`post` (read there from :attr:`RankGroup.posts`)."""

    rank: int
    world_size: int
    comm: Communicator
    inbox: Any = None
    outbox: Any = None

    def mapping(self, *, enable_attention_dp: bool = False) -> Mapping:
        return Mapping(self.world_size, self.rank, self.world_size, enable_attention_dp)

    def receive(self, timeout_s: float | None) -> Any:
        """The next message sent to this rank; raises ``queue.Empty`` after ``timeout_s`` (0: don't wait)."""
        while True:
            item = self.inbox.get(timeout=timeout_s) if timeout_s else self.inbox.get_nowait()
            if item is None:
                raise EOFError("the rank group is closing")
            kind, _, body, _ = item
            if kind == "message":
                return body

    def post(self, message: Any) -> None:
        self.outbox.put(("post", self.rank, message))


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's outcome of a job: its return value, or the error it raised (as text)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


class RankJobError(DistributedError):
    """A job failed on some ranks; carries every rank's result."""

    def __init__(self, results: list[RankResult]) -> None:
        self.results = results
        failed = [r for r in results if not r.ok]
        lines = [f"rank {r.rank}: {r.error_type}: {r.error}" for r in failed]
        first = failed[0].traceback if failed else ""
        super().__init__("job failed on " + "; ".join(lines) + (f"\n{first}" if first else ""))


def loopback_interface() -> str:
    """The loopback interface's name, for gloo (which otherwise binds what the hostname resolves to)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def configure_rank_process(options: LaunchOptions) -> None:
    """Per-process settings every rank needs before it joins the group."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(options.num_threads)
    logging.basicConfig(level=options.log_level, format=f"[rank {os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s")


def host_store() -> dist.TCPStore:
    """The rendezvous store, served by this (launching) process on a free loopback port."""
    return dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)


def result_of(rank: int, run: Callable[[], Any]) -> RankResult:
    """``run()``'s value as a :class:`RankResult`, or the error it raised (as text)."""
    try:
        return RankResult(rank, value=run())
    except BaseException as error:  # reported to the launcher, which decides what it means
        return RankResult(rank, error_type=type(error).__name__, error=str(error), traceback=traceback.format_exc())


def _rank_main(rank: int, world_size: int, port: int, inbox, outbox, options: LaunchOptions) -> None:
    """Body of every rank process of a :class:`RankGroup` (or of :func:`launch`)."""
    os.environ["RANK"] = str(rank)
    configure_rank_process(options)
    store = Communicator.connect_store(LOOPBACK, port, timeout_s=options.start_timeout_s)
    generation = 0
    comm = Communicator(store, rank, world_size, timeout_s=options.collective_timeout_s, generation=generation)
    outbox.put(("ready", rank, None))
    while True:
        message = inbox.get()
        if message is None:
            break
        kind, job_id, fn, args = message
        if kind == "reset":  # the last job failed somewhere: a fresh process group for the next
            comm.close()
            generation += 1
            comm = Communicator(store, rank, world_size, timeout_s=options.collective_timeout_s, generation=generation)
            outbox.put(("reset", rank, job_id))
        elif kind == "job":
            context = RankContext(rank, world_size, comm, inbox, outbox)
            result = result_of(rank, lambda: fn(context, *args))
            if not result.ok:  # peers may be waiting in a collective for this rank: stop them now
                comm.abort(f"{result.error_type}: {result.error}")
            outbox.put(("result", rank, (job_id, result)))
        # a "message" outside a job is stale (its job ended): dropped
    comm.close()


class RankGroup:
    """``world_size`` live rank processes that run jobs sent to them, one job at a time.

    A reader thread routes what the ranks send back: job results, control acknowledgements,
    and posts (messages a running job sends, see :class:`RankContext`), which it queues on
    :attr:`posts` as ``(rank, message)``.
    """

    def __init__(self, world_size: int, options: LaunchOptions = LaunchOptions()) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if options.hash_seeds is not None and len(options.hash_seeds) != world_size:
            raise ValueError(f"hash_seeds needs one seed per rank ({world_size}), got {options.hash_seeds}")
        self.world_size, self.options = world_size, options
        self._store = host_store()
        context = mp.get_context("spawn")
        self._inboxes = [context.Queue() for _ in range(world_size)]
        self._outbox = context.Queue()
        self._jobs = itertools.count()
        self._needs_reset = False
        self.closed = False
        self.posts: queue.Queue = queue.Queue()
        self._arrived = threading.Condition()
        self._messages: dict[tuple[str, int | None], dict[int, Any]] = {}  # (kind, job) -> rank -> body
        self.processes = []
        saved_seed = os.environ.get("PYTHONHASHSEED")
        try:
            for rank in range(world_size):
                if options.hash_seeds is not None:
                    os.environ["PYTHONHASHSEED"] = str(options.hash_seeds[rank])
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, self._store.port, self._inboxes[rank], self._outbox, options),
                    name=f"rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes.append(process)
        finally:
            if saved_seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = saved_seed
        self._reader = threading.Thread(target=self._read, name="RankGroup-reader", daemon=True)
        self._reader.start()
        self._collect("ready", None, options.start_timeout_s)

    def _read(self) -> None:
        while not self.closed:
            try:
                kind, rank, body = self._outbox.get(timeout=0.2)
            except queue.Empty:
                with self._arrived:
                    self._arrived.notify_all()  # waiters re-check the ranks' liveness
                continue
            except (EOFError, OSError):
                return
            if kind == "post":
                self.posts.put((rank, body))
                continue
            job = body[0] if kind == "result" else body if kind == "reset" else None
            value = body[1] if kind == "result" else body
            with self._arrived:
                self._messages.setdefault((kind, job), {})[rank] = value
                self._arrived.notify_all()

    # ---- jobs -----------------------------------------------------------------------
    def start(self, fn: Callable[..., Any], *args: Any, rank_args: Sequence[tuple] | None = None) -> int:
        """Start ``fn(ctx, *args)`` (or ``fn(ctx, *args, *rank_args[rank])``) on every rank; its job id."""
        if self.closed:
            raise RuntimeError("the rank group is closed")
        if self._needs_reset:
            self._reset()
        job_id = next(self._jobs)
        for rank, inbox in enumerate(self._inboxes):
            extra = tuple(rank_args[rank]) if rank_args is not None else ()
            inbox.put(("job", job_id, fn, (*args, *extra)))
        return job_id

    def wait(self, job_id: int, timeout_s: float) -> list[RankResult]:
        """Every rank's result of job ``job_id``. TimeoutError (the group is killed) past ``timeout_s``."""
        results = [result for _, result in sorted(self._collect("result", job_id, timeout_s).items())]
        self._needs_reset = not all(result.ok for result in results)
        return results

    def poll(self, job_id: int) -> list[RankResult] | None:
        """Job ``job_id``'s results if every rank has reported, else None (never waits)."""
        with self._arrived:
            if len(self._messages.get(("result", job_id), {})) < self.world_size:
                return None
        return self.wait(job_id, timeout_s=1.0)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            rank_args: Sequence[tuple] | None = None) -> list[RankResult]:
        """Run ``fn`` on every rank and wait: every rank's result, errors included."""
        return self.wait(self.start(fn, *args, rank_args=rank_args), timeout_s)

    def run_ok(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
               rank_args: Sequence[tuple] | None = None) -> list[Any]:
        """:meth:`run`, returning the values; raises :class:`RankJobError` if any rank failed."""
        results = self.run(fn, *args, timeout_s=timeout_s, rank_args=rank_args)
        if not all(result.ok for result in results):
            raise RankJobError(results)
        return [result.value for result in results]

    def send(self, rank: int, message: Any) -> None:
        """A message for the job running on ``rank`` (it reads it with ``ctx.receive``)."""
        self._inboxes[rank].put(("message", None, message, ()))

    def dead_ranks(self) -> list[int]:
        return [rank for rank, process in enumerate(self.processes) if process.exitcode is not None]

    def why_dead(self, rank: int) -> str:
        return f"rank {rank} exited with code {self.processes[rank].exitcode}"

    @property
    def pids(self) -> list[int | None]:
        """The process id of each rank, by rank."""
        return [process.pid for process in self.processes]

    def _reset(self) -> None:
        job_id = next(self._jobs)
        for inbox in self._inboxes:
            inbox.put(("reset", job_id, None, ()))
        self._collect("reset", job_id, self.options.start_timeout_s)
        self._needs_reset = False

    def _collect(self, kind: str, job_id: int | None, timeout_s: float) -> dict[int, Any]:
        """One message of ``kind`` from every rank, or TimeoutError / a dead rank's error."""
        deadline = time.monotonic() + timeout_s
        key = (kind, job_id)
        with self._arrived:
            while len(self._messages.get(key, {})) < self.world_size:
                dead = self.dead_ranks()
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(self._messages.get(key, {})))
                    reason = (self.why_dead(dead[0]) if dead
                              else f"no {kind} from ranks {missing} within {timeout_s} s")
                    self._arrived.release()
                    try:
                        self.close(kill=True)
                    finally:
                        self._arrived.acquire()
                    raise TimeoutError(f"rank group ({self.world_size} ranks): {reason}; the group was killed")
                self._arrived.wait(timeout=0.5)
            return self._messages.pop(key)

    # ---- lifetime -------------------------------------------------------------------
    def close(self, *, kill: bool = False, timeout_s: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        if not kill:
            for inbox in self._inboxes:
                inbox.put(None)
            deadline = time.monotonic() + timeout_s
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, options: LaunchOptions = LaunchOptions(),
           timeout_s: float = 3600.0) -> list[Any]:
    """Spawn ``world_size`` ranks, run ``fn(ctx, *args)`` once on each, return their values.

    Raises :class:`RankJobError` naming every failed rank's error if any rank failed.
    """
    with RankGroup(world_size, options) as group:
        return group.run_ok(fn, *args, timeout_s=timeout_s)
