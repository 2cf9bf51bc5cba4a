"""Start ``world_size`` processes, give them a process group, run a function on each, collect results.

One process per rank is how ``torch.distributed`` works everywhere, from two CPU processes on a
laptop to thousands of GPUs. :func:`run` hides the plumbing::

    from lmfs.parallel import run
    from lmfs.parallel.collectives import demo_collectives
    results = run(demo_collectives, 4)         # one return value per rank, tensors on the CPU

Single machine (a notebook, a script): :func:`run` spawns the workers itself. It picks a free TCP
port on 127.0.0.1 for the rendezvous (``MASTER_ADDR``/``MASTER_PORT``), asks :func:`placement`
for the backend (NCCL with one process per GPU when there are at least ``world_size`` GPUs, gloo
on the CPU otherwise, and why), builds the process group around the function and tears it down
after.

Several machines, or a cluster scheduler: launch a script with ``torchrun``, which starts the
processes and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``::

    # on every node (node_rank 0 .. nnodes-1), 8 GPUs each:
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
             --master-addr $HEAD_NODE_IP --master-port 29500 my_script.py

Inside such a process :func:`run` notices ``RANK``/``WORLD_SIZE``, initialises the process group
from those variables (if nobody did yet), calls ``fn`` once, in this process, for this process's
rank, and returns every rank's result (exchanged with ``all_gather_object``). So the same script
runs unchanged under ``python my_script.py`` (spawning) and under ``torchrun`` (one rank each).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_lib
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailedError(RuntimeError):
    """A rank raised (or died); ``rank`` and ``remote_traceback`` say which and where."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.rank, self.remote_traceback = rank, remote_traceback


def free_port() -> int:
    """A TCP port nobody listens on right now: the OS hands one out for port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Where ``world_size`` ranks run: ``backend`` (``"nccl"`` or ``"gloo"``), the ``device`` type
    each rank computes on (``"cuda"``: its own GPU; ``"cpu"``), and the ``reason`` for the choice."""

    world_size: int
    backend: str
    device: str
    reason: str

    def __str__(self) -> str:
        where = "one GPU per rank" if self.device == "cuda" else "CPU processes"
        return f"{self.world_size} ranks, backend {self.backend} ({where}): {self.reason}"


def placement(world_size: int, backend: str = "auto", ranks_per_node: int | None = None) -> Placement:
    """Decide how ``world_size`` ranks run: NCCL with one GPU per rank when this machine has a
    GPU for each of its ranks, gloo on the CPU otherwise (for instance 2 ranks on a 1-GPU machine).

    ``ranks_per_node``: how many of the ranks run on this machine (under ``torchrun``,
    ``LOCAL_WORLD_SIZE``); all of them by default. ``backend="auto"`` first reads the environment
    variable ``LMFS_DIST_BACKEND`` (``gloo`` keeps CPU processes even on a GPU machine, e.g. for
    checks that compare with CPU results). :func:`run` and the lectures ask here, so they agree.
    """
    local = world_size if ranks_per_node is None else ranks_per_node
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = os.environ.get("LMFS_DIST_BACKEND", "auto") or "auto"
        if backend != "auto":
            reason = f"LMFS_DIST_BACKEND={backend}"
        elif gpus >= local:
            backend, reason = "nccl", f"{gpus} GPUs for {local} ranks"
        else:
            backend = "gloo"
            reason = (f"{gpus} GPU{'s' if gpus != 1 else ''} for {local} ranks: NCCL needs one GPU per "
                      "rank, so the ranks are CPU processes")
    else:
        reason = f"backend={backend!r} asked for"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} (argument or LMFS_DIST_BACKEND): use 'auto', 'nccl' or 'gloo'")
    if backend == "nccl" and gpus < local:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {local} ranks on this machine but "
                         f"{gpus} GPUs visible; use backend='gloo' (CPU processes) or fewer ranks")
    return Placement(world_size, backend, "cuda" if backend == "nccl" else "cpu", reason)


def device_for(rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_importable(fn):
    target = getattr(fn, "func", fn)  # functools.partial wraps the real function
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    # A script's __main__ is fine (spawn re-imports the script); an interactive one (a notebook,
    # the REPL) has no file to re-import.
    interactive_main = module == "__main__" and not hasattr(sys.modules["__main__"], "__file__")
    if interactive_main or "<lambda>" in qualname or "<locals>" in qualname or module is None:
        raise ValueError(
            f"run() starts its workers with the 'spawn' method: each new process imports `fn` by "
            f"module and name, and {qualname or fn!r} (module {module!r}) cannot be imported that way "
            "(a lambda, a nested function, or one defined in a notebook or the REPL). Put the "
            "function at the top level of a .py module and import it from there; the lectures use "
            "the ones in lmfs.parallel.")


def _to_cpu(obj):
    """The same structure with every tensor detached and on the CPU (safe to pickle and send)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _init_process_group(backend: str, rank: int, world_size: int, timeout: float, local_rank: int):
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        # device_id makes NCCL build its communicator now, not lazily at the first collective.
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)


def _worker(fn, rank, world_size, backend, port, timeout, args, kwargs, results):
    """Body of each spawned process: join the group, run ``fn``, report the result or the error."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast (NVLS) stays off
    if backend == "gloo":
        # CPU ranks share the cores: each one's thread pool gets its share. Left at its default
        # (all cores in every process), spinning threads oversubscribe the CPU many times over.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        _init_process_group(backend, rank, world_size, timeout, local_rank=rank)
        value = fn(rank, world_size, *args, **kwargs)
        # Pickle here, to bytes: the parent then owns a plain copy, with no shared memory that
        # would vanish when this process exits.
        results.put((rank, True, pickle.dumps(_to_cpu(value))))
    except BaseException:  # whatever went wrong (even KeyboardInterrupt), the parent must hear
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout):
    rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"run(..., world_size={world_size}) inside a torchrun job of WORLD_SIZE="
                         f"{env_world}: pass world_size={env_world} (or int(os.environ['WORLD_SIZE']))")
    created = not dist.is_initialized()
    if created:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        where = placement(world_size, backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if rank == 0:
            print(f"lmfs.parallel.run under torchrun: {where}", flush=True)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        _init_process_group(where.backend, rank, world_size, timeout, local_rank)
    try:
        value = _to_cpu(fn(rank, world_size, *args, **kwargs))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, value)
        return everyone
    finally:
        if created:
            dist.destroy_process_group()


def run(fn, world_size: int, *args, backend: str = "auto", timeout: float = 60, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    ``fn`` must be importable (top level of a module or script; not a lambda, a nested function
    or a notebook cell) because workers are started with the ``spawn`` method. Results come back
    in rank order with tensors on the CPU.

    Failures surface here instead of hanging:

    * a rank that raises makes :func:`run` raise :class:`RankFailedError` with its rank and
      traceback; the other ranks are killed;
    * a collective that some rank never joins fails after ``timeout`` seconds (the process
      group's timeout), which surfaces the same way; under NCCL the watchdog aborts the process,
      reported as a rank that died;
    * once one rank has returned, the others get ``timeout`` more seconds before all are killed
      with a :class:`TimeoutError`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout)
    _check_importable(fn)
    where = placement(world_size, backend)
    backend = where.backend
    print(f"lmfs.parallel.run: {where}", flush=True)

    ctx = mp.get_context("spawn")
    for attempt in (1, 2):
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, daemon=True, name=f"lmfs-rank-{rank}",
                             args=(fn, rank, world_size, backend, port, timeout, args, kwargs, results))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        except RankFailedError as err:
            # Between free_port() and rank 0 binding it, another process may have taken the
            # port (tests running in parallel): try once more with a new one.
            if attempt == 1 and "address already in use" in err.remote_traceback.lower():
                continue
            raise
        finally:
            for p in procs:  # only the workers started above; a finished one is left alone
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            results.close()


def _run_jobs(rank: int, world_size: int, jobs: dict) -> dict:
    """Rank function behind :func:`run_each`: the jobs one after the other, in the same order on
    every rank (so their collectives pair up)."""
    return {name: fn(rank, world_size) for name, fn in jobs.items()}


def run_each(jobs: dict, world_size: int, backend: str = "auto", timeout: float = 60) -> dict[str, list]:
    """Run several rank functions in one launch; ``{name: [result of rank 0, rank 1, ...]}``.

    Starting processes (each imports torch) often costs more than a small demo itself, so a
    lecture pays it once::

        from functools import partial
        out = run_each({"naive": partial(train_ddp, config=cfg, batches=b, mode="naive"),
                        "zero3": partial(train_zero, config=cfg, batches=b, stage=3)}, 2)
        out["zero3"][0]["state"]       # rank 0's result of the second job

    ``jobs`` maps names to rank functions ``fn(rank, world_size)`` (bind the other arguments
    with :func:`functools.partial`); each must be importable, as for :func:`run`. They run in
    the order given, in the same process group.
    """
    for name, fn in jobs.items():
        if not callable(fn):
            raise TypeError(f"job {name!r} is {fn!r}: pass a rank function, or functools.partial(fn, ...)")
        _check_importable(fn)
    per_rank = run(_run_jobs, world_size, dict(jobs), backend=backend, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name in jobs}


def _drain(results, values: dict, failures: dict) -> None:
    """Take every message already waiting: results into ``values``, errors into ``failures``
    (the first error a rank reported is kept)."""
    while True:
        try:
            rank, ok, payload = results.get_nowait()
        except queue_lib.Empty:
            return
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures.setdefault(rank, payload)


def _collect(procs, results, timeout: float) -> list:
    """Wait for one message per rank; turn the first error, death or hang into an exception."""
    world_size = len(procs)
    values, failures = {}, {}
    deadline = None  # set when the first rank returns
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_lib.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            if dead:
                # Give a message that is still in flight a moment to arrive before blaming the rank.
                time.sleep(1.0)
                _drain(results, values, failures)
                if failures:
                    break
                dead = [r for r in dead if r not in values]
                if dead:
                    r = dead[0]
                    raise RankFailedError(r, f"rank {r} exited with code {procs[r].exitcode} without "
                                          "returning a result (killed, out of memory, or aborted by "
                                          "the NCCL watchdog after a collective timed out; see its "
                                          "output above)")
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in values]
                raise TimeoutError(
                    f"ranks {missing} were still running {timeout:g} s after rank(s) {sorted(values)} "
                    "returned: probably waiting in a collective the others never called (every rank "
                    "must make the same collective calls in the same order). They were killed.")
            continue
        if not ok:
            failures[rank] = payload
            # A rank's failure makes its peers fail too (their collectives lose a partner); wait
            # briefly so we can name the rank that failed first rather than a bystander.
            time.sleep(0.5)
            _drain(results, values, failures)
            break
        values[rank] = pickle.loads(payload)
        if deadline is None:
            deadline = time.monotonic() + timeout
    if failures:
        first = next(iter(failures))
        others = [r for r in failures if r != first]
        also = f" (ranks {others} failed after it)" if others else ""
        hint = (f": a collective timed out after {timeout:g} s, so some rank never joined it (every "
                "rank must make the same collective calls in the same order)"
                if "timed out" in failures[first].lower() else "")
        raise RankFailedError(first, f"rank {first} failed{also}{hint}\n{failures[first]}", failures[first])
    return [values[r] for r in range(world_size)]
