"""hpo batch-size: the batch finder alone on this machine's device, with every probe it made."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from hpo.config.loader import load_config
from hpo.config.search_paths import with_params
from hpo.errors import ConfigError

if TYPE_CHECKING:
    pass


def batch_size_command(args: argparse.Namespace) -> int:
    from hpo.plugins.loading import load_user_code
    from hpo.trainer import device as dev
    from hpo.trainer.batch_finder import batch_key, find_physical_batch_size
    from hpo.trainer.model import check_model_config, load_tokenizer
    from hpo.trainer.tasks import prepare_data

    config = load_config(args.config)
    if config.training.entrypoint is not None:
        rule = (
            "trains a model hpo does not know, so hpo batch-size cannot probe it; call "
            "ctx.find_batch_size(step) in your function"
        )
        raise ConfigError(
            [f"training.entrypoint: {config.training.entrypoint} {rule}"], config.source
        )
    if args.device is not None:
        config.training.device = args.device
        rules = [rule for key, _, rule in config.training.problems() if key == "device"]
        if rules:
            raise ConfigError([f"--device: got {args.device!r}; {rules[0]}"], "command line")
    # The device first: `cuda` on a host without CUDA is reported before minutes of data prep.
    source = "--device" if args.device is not None else "training.device"
    device = dev.resolve_device(config.training.device, source)
    load_user_code(config)  # a task class, a model factory: one line if they cannot be used
    check_model_config(config.model, config.data.max_length, config.task)
    data = prepare_data(
        config.data, load_tokenizer(config.model, config.task), config.task, config.training
    )
    if args.max is not None:
        config.training.batch_search_max = min(args.max, config.training.batch_search_max)
    job = with_params(config, {}, bound_batch_search=False)  # the config's own search
    search = find_physical_batch_size(job, data.label_names, device)
    key = batch_key(job, device, dev.resolve_precision(config.training.precision, device))
    if args.json:
        print(json.dumps({**search.as_dict(), "cache_key": key}, sort_keys=True))
    else:
        print(search.report())
        print(f"cache key: {json.dumps(key, sort_keys=True)}")
    if search.chosen == 0:
        print(
            "hpo: not even one example fits in memory: shorten data.max_length, enable "
            "training.gradient_checkpointing or use a smaller model",
            file=sys.stderr,
        )
        return 1
    return 0
