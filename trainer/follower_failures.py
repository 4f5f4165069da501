"""A rank's own error on a host that follows, told to the first host. Its line to the launching
process ends on its own host, so without this the first host's ranks would only see a lost peer
(gloo's "Connection closed by peer") and the trial would fail without its reason; an OOM in a
sharded step would fail the trial rather than start every rank again at half the batch.

The rank leaves a word in the trial's rendezvous store (served by the first host's trial
process, which every host reaches) before it ends; a rank of the first host that then loses a
peer raises the error the word describes in place of the lost connection, and the first host's
launcher acts on it as on one of its own ranks' (trainer.launch, trainer.rank_failures).
Before the ranks of every host start again, the last start's rendezvous must be gone from the
first host's trial process (rendezvous_let_go).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import socket
import time
from typing import Any

import torch.distributed as dist

from hpo.trainer.fsdp import ShardedEvaluationOutOfMemory, ShardedStepOutOfMemory
from hpo.trainer.memory import OutOfMemoryAtBatchOne
from hpo.trainer.rank_failures import RankFailed, lost_a_peer

log = logging.getLogger(__name__)

# How long a rank waits to reach the rendezvous store (seconds): it is up for the whole trial,
# so a rank that cannot reach it soon goes on without a word (the trial fails as before).
STORE_TIMEOUT_S = 10.0
# How long a restart waits for the last start's rendezvous port to be let go (seconds).
RDZV_FREED_WAIT_S = 10.0
# The batch each error of the run's own carries, by its type: rebuilt whole on the first host.
_SIZES = {
    ShardedStepOutOfMemory.__name__: "physical_batch_size",
    ShardedEvaluationOutOfMemory.__name__: "eval_batch_size",
}


def word_key(launch: int) -> str:
    """The store key of a word in the `launch`th start of a trial's ranks (a restart after an
    OOM starts them again: a word of an earlier start is not read for a later one)."""
    return f"hpo.follower_failure.{launch}"


def described(error: BaseException, rank: int) -> dict[str, Any]:
    """`error` of rank `rank` as a word: plain JSON, never a pickle, since anything that
    reaches the rendezvous port could write one."""
    word: dict[str, Any] = {"rank": rank, "type": type(error).__name__, "message": str(error)}
    size_name = _SIZES.get(type(error).__name__)
    if size_name is not None:
        word[size_name] = getattr(error, size_name)
    word["oom"] = isinstance(error, OutOfMemoryAtBatchOne)
    return word


def rebuilt(word: dict[str, Any]) -> Exception:
    """The error a word describes: a sharded step's or evaluation's OOM as it was raised (the
    first host's launcher starts every rank again on it), any other OOM as one at batch 1, and
    any other error as RankFailed naming the rank and what it raised."""
    kind, message = str(word.get("type")), str(word.get("message"))
    if kind == ShardedStepOutOfMemory.__name__:
        return ShardedStepOutOfMemory(message, int(word["physical_batch_size"]))
    if kind == ShardedEvaluationOutOfMemory.__name__:
        return ShardedEvaluationOutOfMemory(message, int(word["eval_batch_size"]))
    if word.get("oom") is True:
        return OutOfMemoryAtBatchOne(message)
    return RankFailed(f"rank {word.get('rank')} (on a host that follows): {kind}: {message}")


def leave_word(endpoint: str, launch: int, rank: int, error: BaseException) -> None:
    """On a host that follows: `error`, this rank's own, in the rendezvous store at `endpoint`
    for the first host's ranks. A lost peer is not a cause of its own: no word."""
    if lost_a_peer(error):
        return
    try:
        store = _store(endpoint)
        store.set(word_key(launch), json.dumps(described(error, rank)))
    except (RuntimeError, OSError, ValueError) as e:  # DistError is a RuntimeError
        log.warning("rank %d: its error not told to the first host (%s): %s", rank, endpoint, e)


def peer_word(endpoint: str, launch: int) -> Exception | None:
    """On the first host: the error a rank of a host that follows left in this start of the
    trial's ranks (None: none, or the store not reached)."""
    key = word_key(launch)
    try:
        store = _store(endpoint)
        if not store.check([key]):
            return None
        word = json.loads(store.get(key))
    except (RuntimeError, OSError, ValueError) as e:  # a JSONDecodeError is a ValueError
        log.warning("no word from the hosts that follow read at %s: %s", endpoint, e)
        return None
    return rebuilt(word) if isinstance(word, dict) else None


def told_across_hosts(
    error: Exception, endpoint: str | None, launch: int, leads: bool, rank: int
) -> Exception:
    """The error this rank reports, in a trial across hosts (`endpoint`: its rendezvous; None:
    one host). On a host that follows, its own error is left for the first host, and reported
    as it is; on the first host, a lost peer is reported as the error a rank of a host that
    follows left, if one did (it ended before its connections closed: its word is there)."""
    if endpoint is None:
        return error
    if not leads:
        leave_word(endpoint, launch, rank, error)
        return error
    if lost_a_peer(error):
        return peer_word(endpoint, launch) or error
    return error


def _store(endpoint: str) -> dist.TCPStore:
    """A client of the rendezvous store at `endpoint` (host:port, an IPv6 host in brackets)."""
    host, _, port = endpoint.rpartition(":")
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)


def rendezvous_let_go(endpoint: str) -> bool:
    """On the first host, before the ranks start again: whether the last start's rendezvous
    store is gone from this process. The c10d backend's store server is shared by every store
    object of this process on its port (multi-tenant) and lives while one does; the last start's
    live on in reference cycles (its failure's traceback holds the launcher's frames) until a
    collection. Kept, it holds the last rendezvous, closed as its ranks ended, and a new start
    would fail at once (the hosts that follow know only the one run id): the caller then ends
    the trial with the OOM, as before the ranks could start again across hosts."""
    gc.collect()
    port = int(endpoint.rpartition(":")[2])
    deadline = time.monotonic() + RDZV_FREED_WAIT_S  # the server's thread lets the port go
    while True:
        try:
            socket.create_server(("", port)).close()
            return True
        except OSError as e:
            if time.monotonic() > deadline:
                log.warning("the ranks cannot start again across hosts: port %d held (%s)", port, e)
                return False
        time.sleep(0.05)
