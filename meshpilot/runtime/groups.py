"""The process groups of a plan's mesh: on gloo, one collective at a time per group, in issue order.

The cost model and the simulator give each process group one communication stream: collectives issued on a
group run one after the other, in the order issued (NCCL's behaviour: one stream per communicator). gloo's
process group instead runs its work on a pool of threads (``ProcessGroupGloo::Options::threads``, 2 by
default), so two collectives issued back to back on one group run *at once* and share the link: the first
one ends when both do. Under duplex that is the wrong order of completion — microbatch 0's collective is
issued, then microbatch 1's right after it, and microbatch 0 waits on its own before it can compute; with
both sharing the link it waits about twice as long, and the computation duplex meant to hide behind the
second collective runs with the link idle. Measured under ``meshpilot emulate`` (2 × 4 ranks, 100 Mbit/s
between the nodes), two 4 MiB all-reduces issued back to back: the first completes after 1.30 s with gloo's
two threads, 0.73 s with one; both after 1.32 / 1.37 s (the link's throughput is the same).

torch's ``new_group`` passes gloo no options but a timeout, so a group with one thread is made through a
registered backend (:data:`SERIAL_GLOO`, ``torch.distributed.Backend.register_backend``, extended API: its
creator receives the options ``DeviceMesh`` passes) that builds ``ProcessGroupGloo`` from them;
:func:`mesh_backends` gives ``DeviceMesh`` those options (``threads = 1``, the default group's timeout) for
every axis when the default group is gloo. The groups are ordinary ``ProcessGroupGloo`` objects
(functional collectives, DTensor and ``all_to_all_single`` work as on the default gloo). Setting
``MESHPILOT_GLOO_THREADS`` to a number keeps gloo's pool of that many threads (``2``: torch's default), to
compare.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpilot.errors import UserError

SERIAL_GLOO = "meshpilot_gloo"
"""The registered backend: gloo with one worker thread per process group."""

THREADS_ENV = "MESHPILOT_GLOO_THREADS"
"""Environment variable: gloo worker threads per mesh group (default 1; ``2`` is torch's own default)."""


def _threads() -> int:
    """The worker threads per group: :data:`THREADS_ENV`, or 1."""
    value = os.environ.get(THREADS_ENV, "1")
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"{THREADS_ENV}={value!r}: give a whole number of threads, at least 1 (e.g. 1 or 2)")
    return n


def _create(common, opts: dist.ProcessGroupGloo._Options) -> dist.ProcessGroupGloo:
    """The registered backend's creator (torch's extended API): `common` carries the group's store, rank and
    size; `opts` are :func:`mesh_backends`' options (threads, timeout), given the default network device."""
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(common.store, common.group_rank, common.group_size, opts)


def mesh_backends(ndim: int) -> tuple[tuple[str, dist.ProcessGroupGloo._Options], ...] | None:
    """``DeviceMesh``'s ``backend_override`` for a mesh of `ndim` axes: :data:`SERIAL_GLOO` on every axis when
    the default process group is gloo (registered on first use), with the default group's timeout (what
    ``init_process_group(timeout=...)`` and ``meshpilot train --timeout`` set; ``new_group`` would take
    torch's 30 minutes), else ``None`` (torch's groups)."""
    if not dist.is_initialized() or str(dist.get_backend()).lower() != "gloo":
        return None
    try:  # private corners of torch.distributed: a torch without them keeps its own groups (two threads)
        default = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = default.options._timeout
        opts._threads = _threads()  # a bad MESHPILOT_GLOO_THREADS is one line here, before any group is made
    except (AttributeError, RuntimeError):
        return None
    if not hasattr(dist.Backend, SERIAL_GLOO.upper()):
        dist.Backend.register_backend(SERIAL_GLOO, _create, extended_api=True, devices=["cpu"])
    return tuple((SERIAL_GLOO, opts) for _ in range(ndim))


def device_mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """The DeviceMesh over `ranks` (its shape the mesh's) with axes `names`, on :func:`mesh_backends`' groups
    (every rank must call it, in one order: new process groups are collective)."""
    override = mesh_backends(ranks.dim()) if device_type == "cpu" else None
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=override)
