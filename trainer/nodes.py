"""Where this host stands in a trial across several hosts (`training.distributed.nodes`): its
node rank, the rendezvous endpoint on the first host, read from Slurm's variables, Kubernetes'
(an indexed Job) or hpo's own; trainer.launch starts this host's ranks with it. Also the first
host's last word at that endpoint once its worker ended, which ends the hosts that follow.
"""

from __future__ import annotations

import os
import re
import socket
import time
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
# The first host's last word, served at the rendezvous port once its worker ended (no trial holds
# the port then): "hpo-end CODE\n", its exit code; each host that follows answers "seen\n". A
# trial's c10d store says nothing to a client that says nothing, so a follower that asks while
# a trial's rendezvous is up hears nothing, and joins the trial.
_END_WORD, _SEEN_WORD = b"hpo-end", b"seen\n"
# How long the first host serves its last word for hosts that have not answered yet (seconds).
END_WAIT_S = float(os.environ.get("HPO_FOLLOW_END_WAIT_S", "30"))


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


def tell_the_end(place: NodePlace, exit_code: int, wait_s: float | None = None) -> int:
    """On the first host, once its worker ended: say `exit_code` at the rendezvous port to each
    host that follows, until all nodes - 1 said they saw it or `wait_s` (None: END_WAIT_S)
    passed. Returns how many did (the others end after their idle limit, HPO_FOLLOW_IDLE_S)."""
    deadline = time.monotonic() + (END_WAIT_S if wait_s is None else wait_s)
    server = _end_server(_host_port(place.endpoint)[1], deadline)
    if server is None:
        return 0
    seen = 0
    with server:
        while seen < place.nodes - 1 and (left_s := deadline - time.monotonic()) > 0:
            server.settimeout(left_s)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            with conn:
                seen += _told(conn, exit_code)
    return seen


def _end_server(port: int, deadline: float) -> socket.socket | None:
    """A socket listening on `port` at every address of this host; None when the port stays
    taken (the last trial's rendezvous lets it go as its process ends)."""
    dual = socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if dual else socket.AF_INET
    while True:
        try:
            return socket.create_server(("", port), family=family, dualstack_ipv6=dual)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


def _told(conn: socket.socket, exit_code: int) -> int:
    """1 when the host at `conn` saw the last word (it answered), else 0 (a rendezvous client
    of a late trial, or a host gone)."""
    conn.settimeout(2.0)
    try:
        conn.sendall(b"%s %d\n" % (_END_WORD, exit_code))
        return int(_read_line(conn) == _SEEN_WORD)
    except OSError:
        return 0


@dataclass(frozen=True)
class FirstHostWord:
    """What a host that follows hears at the rendezvous endpoint."""

    listening: bool  # something listens: a trial's rendezvous, or the last word
    exit_code: int | None = None  # the first host's, once it said its worker ended


def ask_first_host(endpoint: str, timeout_s: float = 0.5) -> FirstHostWord:
    """On a host that follows: whether anything listens at `endpoint` (nothing between trials,
    or once the first host is gone), and the first host's exit code once it said its worker
    ended. A trial's rendezvous says nothing within `timeout_s`."""
    try:
        with socket.create_connection(_host_port(endpoint), timeout=timeout_s) as conn:
            try:
                word = _read_line(conn).split()
            except TimeoutError:
                return FirstHostWord(listening=True)
            if len(word) != 2 or word[0] != _END_WORD or not word[1].lstrip(b"-").isdigit():
                return FirstHostWord(listening=True)
            conn.sendall(_SEEN_WORD)
            return FirstHostWord(listening=True, exit_code=int(word[1]))
    except OSError:  # refused, or reset
        return FirstHostWord(listening=False)


def _read_line(conn: socket.socket) -> bytes:
    """Up to a newline (included) or 64 bytes; raises TimeoutError when the peer is silent."""
    line = b""
    while not line.endswith(b"\n") and len(line) < 64:
        chunk = conn.recv(64 - len(line))
        if not chunk:
            break
        line += chunk
    return line


def _host_port(endpoint: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets) as (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)
