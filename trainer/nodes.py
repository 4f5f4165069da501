"""Where this host stands in a trial across several hosts (`training.distributed.nodes`): its
node rank, the rendezvous endpoint on the first host, read from Slurm's variables, Kubernetes'
(an indexed Job) or hpo's own; trainer.launch starts this host's ranks with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpo.trainer.errors import DeviceError

# hpo's own variables, which win over a scheduler's: the first host's rendezvous as host:port,
# this host's rank among the trial's hosts (0: the one that runs the study's worker) and the
# address the other hosts reach this one at (default: its host name).
RDZV_ENDPOINT_ENV = "HPO_RDZV_ENDPOINT"
NODE_RANK_ENV = "HPO_NODE_RANK"
NODE_ADDR_ENV = "HPO_NODE_ADDR"
# torchrun's default rendezvous port, on the first host of a Slurm job.
DEFAULT_RDZV_PORT = 29400
# Where a node rank comes from, first found wins: hpo's, Slurm's (one task per node) and a
# Kubernetes indexed Job's (one pod per node).
_NODE_RANK_SOURCES = (NODE_RANK_ENV, "SLURM_NODEID", "JOB_COMPLETION_INDEX")
_NODE_COUNT_SOURCES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")


@dataclass(frozen=True)
class NodePlace:
    """This host's place in a trial across `nodes` hosts."""

    nodes: int
    node_rank: int
    endpoint: str  # host:port of the rendezvous, which the first host serves
    local_addr: str | None  # this host as the others reach it; None: its host name

    @property
    def leads(self) -> bool:
        """Whether this host runs the trial's worker (its rank 0 reports); the others follow."""
        return self.node_rank == 0


def node_place(nodes: int, environ: Mapping[str, str] = os.environ) -> NodePlace:
    """This host's place among `nodes` hosts, from the environment. Raises DeviceError, one
    line naming the variable to set, when the environment does not say."""
    rank = _node_rank(environ)
    counted = next((environ[name] for name in _NODE_COUNT_SOURCES if name in environ), None)
    if counted is not None and counted.isdigit() and int(counted) < nodes:
        raise DeviceError(
            f"training.distributed.nodes is {nodes} but this Slurm job has {counted} nodes; "
            f"sbatch --nodes={nodes} (or more), or lower training.distributed.nodes"
        )
    if not 0 <= rank < nodes:
        raise DeviceError(
            f"this host's node rank is {rank} but training.distributed.nodes is {nodes}: "
            f"run one `hpo run` on each of {nodes} hosts"
        )
    return NodePlace(nodes, rank, _endpoint(environ), environ.get(NODE_ADDR_ENV) or None)


def _node_rank(environ: Mapping[str, str]) -> int:
    for name in _NODE_RANK_SOURCES:
        value = environ.get(name)
        if value is not None:
            if not value.strip().isdigit():
                raise DeviceError(f"{name} is {value!r}: a node rank must be 0, 1, 2 ...")
            return int(value)
    raise DeviceError(
        "training.distributed.nodes is above 1 but nothing says which host this is: run under "
        f"Slurm (srun sets SLURM_NODEID), or set {NODE_RANK_ENV} (0 on the first host) and "
        f"{RDZV_ENDPOINT_ENV}=host:port"
    )


def _endpoint(environ: Mapping[str, str]) -> str:
    """hpo's endpoint; else MASTER_ADDR:MASTER_PORT (a PyTorchJob's); else the first host of
    the Slurm job at port 29400."""
    if environ.get(RDZV_ENDPOINT_ENV):
        return environ[RDZV_ENDPOINT_ENV]
    if environ.get("MASTER_ADDR"):
        return f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT') or DEFAULT_RDZV_PORT}"
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        return f"{first_host(nodelist)}:{DEFAULT_RDZV_PORT}"
    raise DeviceError(
        f"training.distributed.nodes is above 1 but no rendezvous is known: set "
        f"{RDZV_ENDPOINT_ENV}=host:port (the first host, a free port), or run under Slurm"
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[07-09,12],cpu1` -> `gpu07`,
    `rack[1-2]-n[3,5]` -> `rack1-n3` (each bracket's first value, zero-padding kept)."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):  # the first host expression: up to a top-level comma
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split("[,-]", m.group(1))[0], nodelist[:end])
