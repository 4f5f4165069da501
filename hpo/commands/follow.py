"""`hpo run` on a host other than the first of trials across hosts (`training.distributed.nodes`
above 1): no study, no data; this host's ranks join each trial the first host's worker starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hpo.config.schema import Config
from hpo.errors import ConfigError
from hpo.stopping import StopRequest

log = logging.getLogger("hpo")


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
    """Join the first host's trials until a stop (SIGTERM, Ctrl-C): a stop while a trial
    trains waits for it, since every rank stops at the step the first host's worker chose."""
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
    say(f"hpo: followed {followed} trials")
    return stop.exit_code if stop.requested else 0
