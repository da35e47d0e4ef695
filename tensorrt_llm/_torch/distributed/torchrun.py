"""Ranks started by ``torchrun`` (PyTorch's launcher), on one host or several.

``torchrun`` starts one process per rank on every host and gives each its place in the
environment (``env://``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``. Its agent on the first host serves the rendezvous store there
(``TORCHELASTIC_USE_AGENT_STORE=True``), so the store outlives every rank and the abort
records of :class:`Communicator` stay readable; without an agent (another ``env://``
launcher) rank 0 serves it.

Roles, as with the spawned ranks (:mod:`.launcher`), but each in its own process:

* rank 0 serves: its ``LLM`` runs a :class:`MultiRankExecutor` over a :class:`TorchrunGroup`,
  which runs rank 0's serving job (:func:`~.worker.serve_rank`) on a thread of that process
  and hands it the submissions through an in-process queue;
* every other rank follows (:func:`follow`): it runs the same job on its main thread and
  learns the requests from rank 0's broadcast at the start of each iteration. It posts
  nothing back: under tensor parallelism rank 0's responses and statistics are the group's.
  Attention DP (where each rank's responses and statistics are its own) is refused here.

A rank that stops answering is found within ``dead_after_s``, not at a collective's timeout:
every rank bumps a counter in the store (``beat/RANK``) from a thread of its own every
``beat_s``; rank 0 reads the counters, and one that has not moved for ``dead_after_s`` names
its rank dead. A killed process also fails its peers' collectives at once (gloo sees the
connection close), but its error names an address, not a rank: the communicator then asks the
heartbeats which rank went silent and says so (``Communicator``'s ``diagnose``). A host whose
network is gone fails no collective before the timeout; its silent heartbeat is what finds it.
Counters, not timestamps, so the hosts' clocks need not agree.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch.distributed as dist

from tensorrt_llm._torch.distributed.communicator import Communicator
from tensorrt_llm._torch.distributed.launcher import LaunchOptions, RankContext, RankResult, result_of

logger = logging.getLogger(__name__)

_BEAT_KEY = "torchrun/beat/{}"


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """This process's place in an ``env://`` launch."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # the launcher's agent serves the store (torchrun); else rank 0 does

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> TorchrunEnv | None:
        """The launch this process is part of, or None when it was not started by ``env://``
        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set)."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(name in environ for name in names):
            return None
        try:
            env = cls(
                rank=int(environ["RANK"]),
                world_size=int(environ["WORLD_SIZE"]),
                local_rank=int(environ.get("LOCAL_RANK", "0")),
                master_addr=environ["MASTER_ADDR"],
                master_port=int(environ["MASTER_PORT"]),
                agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            )
        except ValueError as error:
            raise ValueError(f"the env:// launch variables are malformed: {error}") from None
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
        return env

    def connect(self, timeout_s: float) -> dist.Store:
        """The rendezvous store: a client of the agent's, or rank 0's own."""
        serves = self.rank == 0 and not self.agent_store
        return dist.TCPStore(self.master_addr, self.master_port, world_size=None, is_master=serves,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    """Bumps this rank's counter in the store every ``beat_s``, from a daemon thread."""

    def __init__(self, store: dist.Store, rank: int, beat_s: float) -> None:
        self._store, self._key, self._beat_s = store, _BEAT_KEY.format(rank), beat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store's host is gone: the others find this rank silent
                logger.warning("heartbeat: the rendezvous store does not answer")

    def stop(self) -> None:
        self._stop.set()


class HeartbeatWatch:
    """Rank 0's view of the others' counters: which have not moved for ``dead_after_s``."""

    def __init__(self, store: dist.Store, ranks: Iterable[int], dead_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._dead_after_s, self._clock = store, dead_after_s, clock
        now = clock()
        self._seen = {rank: (-1, now) for rank in ranks}  # rank -> (last count, when it last moved)

    def silent_over(self, window_s: float) -> list[int]:
        """Ranks whose counter does not move over the next ``window_s`` (several beats): after a
        collective failed, which peer is gone (a killed process stops beating at once)."""
        before = {rank: self._store.add(_BEAT_KEY.format(rank), 0) for rank in self._seen}
        time.sleep(window_s)
        return [rank for rank, count in before.items() if self._store.add(_BEAT_KEY.format(rank), 0) == count]

    def silent(self) -> dict[int, float]:
        """Ranks silent for longer than ``dead_after_s``, with how long (seconds)."""
        now, silent = self._clock(), {}
        for rank, (count, moved) in self._seen.items():
            current = self._store.add(_BEAT_KEY.format(rank), 0)
            if current != count:
                self._seen[rank] = (current, now)
            elif now - moved > self._dead_after_s:
                silent[rank] = now - moved
        return silent


def _gone(watch: HeartbeatWatch, beat_s: float) -> str | None:
    """After a collective failed: the ranks whose heartbeat stopped, named (a failed collective
    says which address closed, not which rank); None if every peer still beats."""
    try:
        gone = watch.silent_over(4 * beat_s)
    except Exception:  # the store is gone: its host (rank 0's, under torchrun) is
        return "the rendezvous store does not answer"
    return ", ".join(f"rank {rank}" for rank in gone) + " stopped answering (heartbeat silent)" if gone else None


class _Outbox:
    """What rank 0's job posts, routed to the group's ``posts`` queue as the spawned group's reader does."""

    def __init__(self, posts: queue.Queue) -> None:
        self._posts = posts

    def put(self, item: tuple[str, int, Any]) -> None:
        kind, rank, body = item
        if kind == "post":
            self._posts.put((rank, body))


class TorchrunGroup:
    """Rank 0's side of a ``torchrun`` group, with the surface :class:`MultiRankExecutor`
    uses of a spawned :class:`~.launcher.RankGroup`: one job (the serving loop) on a thread of
    this process, messages to it, its posts, and the ranks found dead (by heartbeat)."""

    def __init__(self, env: TorchrunEnv, options: LaunchOptions = LaunchOptions(), *, beat_s: float = 0.25,
                 dead_after_s: float = 5.0) -> None:
        if env.rank != 0:
            raise ValueError(f"rank {env.rank} follows rank 0 (torchrun.follow); only rank 0 serves")
        self.world_size = env.world_size
        self._store = env.connect(options.start_timeout_s)
        self._watch = HeartbeatWatch(self._store, range(1, env.world_size), dead_after_s)
        self._comm = Communicator(self._store, 0, env.world_size, timeout_s=options.collective_timeout_s,
                                  diagnose=lambda: _gone(self._watch, beat_s))
        self._heartbeat = Heartbeat(self._store, 0, beat_s)
        self._silent: dict[int, float] = {}
        self._inbox: queue.Queue = queue.Queue()
        self.posts: queue.Queue = queue.Queue()
        self._result: RankResult | None = None
        self._thread: threading.Thread | None = None
        self.closed = False

    def start(self, fn: Callable[..., Any], *args: Any) -> int:
        """Start rank 0's job ``fn(ctx, *args)`` on a thread; its job id (always 0: one job)."""
        if self._thread is not None:
            raise RuntimeError("a torchrun group runs one job")
        context = RankContext(0, self.world_size, self._comm, self._inbox, _Outbox(self.posts))

        def run() -> None:
            result = result_of(0, lambda: fn(context, *args))
            if not result.ok:  # the followers may be waiting in a collective: stop them now
                self._comm.abort(f"{result.error_type}: {result.error}")
            self._result = result

        self._thread = threading.Thread(target=run, name="rank0-serve", daemon=True)
        self._thread.start()
        return 0

    def send(self, rank: int, message: Any) -> None:
        if rank != 0:
            raise ValueError(f"only rank 0 takes messages, not rank {rank}")
        self._inbox.put(("message", None, message, ()))

    def poll(self, job_id: int) -> list[RankResult] | None:
        """Rank 0's result once its job has ended (the followers end with it), else None."""
        if self._thread is None or self._thread.is_alive():
            return None
        return [self._result]

    def dead_ranks(self) -> list[int]:
        """Ranks whose heartbeat has stopped for ``dead_after_s``."""
        if not self.closed:
            try:
                self._silent = self._watch.silent()
            except Exception:  # the store itself is gone: every follower is out of reach
                self._silent = {rank: float("inf") for rank in range(1, self.world_size)}
        return sorted(self._silent)

    def why_dead(self, rank: int) -> str:
        return f"rank {rank} stopped answering (no heartbeat for {self._silent.get(rank, 0.0):.1f} s)"

    @property
    def pids(self) -> list[int | None]:
        """This process's id for rank 0; the followers' live on their own hosts."""
        return [os.getpid()] + [None] * (self.world_size - 1)

    def close(self, *, kill: bool = False, timeout_s: float = 5.0) -> None:
        """Stop the heartbeat and wait for the job (it ends once rank 0 was told to stop). With
        ``kill`` (a dead follower), abort the group so that rank 0's pending collective fails."""
        if self.closed:
            return
        self.closed = True
        self._heartbeat.stop()
        if kill:
            self._comm.abort("the group is closed: a rank is dead")
        if self._thread is not None:
            self._thread.join(timeout_s)


def follow(env: TorchrunEnv, job: Callable[[RankContext], int], options: LaunchOptions = LaunchOptions(),
           *, beat_s: float = 0.25) -> int:
    """A follower rank (``RANK`` > 0): join the group and run ``job(ctx)`` on this thread until
    rank 0 stops the group; its return value. Raises what the job raised (the group's error)."""
    if env.rank == 0:
        raise ValueError("rank 0 serves (TorchrunGroup); follow() is for the other ranks")
    # gloo picks the interface the hostname resolves to (GLOO_SOCKET_IFNAME overrides it);
    # unlike spawned ranks these may span hosts, so loopback is not forced here
    logging.basicConfig(level=options.log_level, format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s")
    store = env.connect(options.start_timeout_s)
    watch = HeartbeatWatch(store, (r for r in range(env.world_size) if r != env.rank), dead_after_s=float("inf"))
    comm = Communicator(store, env.rank, env.world_size, timeout_s=options.collective_timeout_s,
                        diagnose=lambda: _gone(watch, beat_s))
    heartbeat = Heartbeat(store, env.rank, beat_s)
    try:
        return job(RankContext(env.rank, env.world_size, comm, None, _Outbox(queue.Queue())))
    except BaseException as error:
        comm.abort(f"{type(error).__name__}: {error}")
        raise
    finally:
        heartbeat.stop()
        comm.close()
