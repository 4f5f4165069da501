"""`hpo run` on a host other than the first of trials across hosts (`training.distributed.nodes`
above 1): no study, no data; this host's ranks join each trial the first host's worker starts.
On the first host, its last word to the others once its worker ended (FollowersTold).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

from hpo.config.schema import Config
from hpo.errors import ConfigError
from hpo.stopping import StopRequest

log = logging.getLogger("hpo")
# How long the first host, stopped by a signal, serves its last word (seconds).
STOPPED_END_WAIT_S = 3.0


def following_place(config: Config, gpu_groups: list[str]) -> object | None:
    """This host's NodePlace when it follows another host's trials; None when it runs trials
    (one host per trial, or the first host). Raises ConfigError for a layout that cannot
    work, and the trainer's DeviceError when the environment does not say which host this is."""
    settings = config.training.distributed
    if settings is None or settings.nodes == 1:
        return None
    if len(gpu_groups) > 1:
        raise ConfigError(
            [
                f"--gpus: {len(gpu_groups)} workers on this host, but a trial across "
                f"{settings.nodes} hosts (training.distributed.nodes) runs one worker per "
                f"host: give it gpus_per_trial ({settings.gpus_per_trial}) GPUs"
            ]
        )
    from hpo.trainer.nodes import node_place

    place = node_place(settings.nodes)
    return None if place.leads else place


def follow(config: Config, place: object, stop: StopRequest, say: Callable[[str], None]) -> int:
    """Join the first host's trials until its worker says it ended (this host then exits with
    its exit code), a stop (SIGTERM, Ctrl-C; a stop while a trial trains waits for it, since
    every rank stops at the step the first host's worker chose), or no word from the first
    host for HPO_FOLLOW_IDLE_S (it is gone: exit 1)."""
    from hpo.trainer.launch import follow_trials
    from hpo.trainer.nodes import NodePlace

    assert isinstance(place, NodePlace)  # noqa: S101 (from following_place)
    say(
        f"hpo: host {place.node_rank} of {place.nodes}: following the trials of the first host "
        f"(rendezvous {place.endpoint})"
    )
    training = config.training
    followed = follow_trials(
        training.ranks_per_node, training.device, place, lambda: stop.requested
    )
    say(f"hpo: followed {followed.trials} trials")
    code = followed.first_host_exit
    if stop.requested:
        return stop.exit_code
    if code is None:
        say(
            f"hpo: the first host is gone without saying its worker ended: no trial and no "
            f"word from {place.endpoint} for {followed.quiet_s:.0f} s (HPO_FOLLOW_IDLE_S)"
        )
        return 1
    say(f"hpo: the first host's worker ended (exit code {code}): nothing more to follow")
    return code


class FollowersTold:
    """On the first host of trials across hosts: once its worker ends, however (the study
    done, a stop, an error), the hosts that follow are told, with its exit code, and end.

        with FollowersTold(say) as told:
            told.place = leading_place(config)  # once the config is known
            told.ended(run_the_worker())  # the exit code stays 1 when it raises
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.place: object | None = None
        self.exit_code = 1
        self.wait_s: float | None = None  # None: END_WAIT_S

    def ended(self, exit_code: int, stopped: bool = False) -> None:
        """The worker's exit code; `stopped` by a signal, which the hosts that follow most
        likely had too (Slurm sends it to every task): they are not waited for long."""
        self.exit_code = exit_code
        self.wait_s = STOPPED_END_WAIT_S if stopped else None

    def __enter__(self) -> FollowersTold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None
    ) -> None:
        from hpo.trainer.nodes import NodePlace, tell_the_end

        if not isinstance(self.place, NodePlace):
            return
        others = self.place.nodes - 1
        seen = tell_the_end(self.place, self.exit_code, self.wait_s)
        late = "" if seen == others else "; the others end after HPO_FOLLOW_IDLE_S"
        self.say(f"hpo: told {seen} of {others} following hosts that the worker ended{late}")


def leading_place(config: Config) -> object | None:
    """This host's NodePlace when it is the first host of trials across hosts; else None."""
    settings = config.training.distributed
    if settings is None or settings.nodes == 1:
        return None
    from hpo.trainer.nodes import node_place

    place = node_place(settings.nodes)
    return place if place.leads else None
