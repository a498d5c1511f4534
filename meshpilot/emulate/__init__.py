"""Emulate a multi-node cluster on one machine: a network namespace per node, links shaped by tc, torchrun.

``run_emulated(cluster, ["train.py", ...])`` runs a torch.distributed program with one torchrun agent per
node of `cluster`'s layer 0, its ranks in that node's namespace; traffic between nodes crosses veths shaped
to the cluster's inter-node bandwidths (and latency, where the kernel has sch_netem). Needs root.
See docs/emulate.md.
"""

from meshpilot.emulate.launch import Interrupted, agent_command, devices_per_node, run_emulated, torchrun_target
from meshpilot.emulate.netns import (
    SUBNET,
    EmulationError,
    KernelSupport,
    NetworkPlan,
    NodeNet,
    check_privileges,
    cleanup_stale,
    emulated_network,
    leftovers,
    netns_unavailable_reason,
    plan_network,
    probe_kernel,
)

__all__ = [
    "SUBNET",
    "EmulationError",
    "Interrupted",
    "KernelSupport",
    "NetworkPlan",
    "NodeNet",
    "agent_command",
    "check_privileges",
    "cleanup_stale",
    "devices_per_node",
    "emulated_network",
    "leftovers",
    "netns_unavailable_reason",
    "plan_network",
    "probe_kernel",
    "run_emulated",
    "torchrun_target",
]
