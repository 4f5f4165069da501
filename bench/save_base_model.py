"""Save the model a config builds from `model.config` (random init, as hpo builds it for the
config's task) with its tokenizer, as a pretrained model folder: what an adapter (LoRA) needs as
its base, on a host that cannot download one.
Run: python bench/save_base_model.py bench/configs/llama-1b.yaml /tmp/hpo-llama-1b
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import PreTrainedModel

from hpo.config.loader import load_config
from hpo.trainer.model import build_model, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config whose model is built from model.config")
    parser.add_argument("folder", help="where the model and its tokenizer go")
    args = parser.parse_args()
    config = load_config(args.config)
    if not config.model.config:
        raise SystemExit(f"{args.config}: model.config is empty; nothing to build")
    started = time.perf_counter()
    # Initialised on the GPU where there is one: a 1B model's random init on the CPU is slow.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(config.model, [], config.training.seed, device, task=config.task)
    if not isinstance(model, PreTrainedModel):  # model.factory: the user's code, not saved here
        raise SystemExit(f"{args.config}: the model is not a transformers model; nothing to save")
    model.save_pretrained(args.folder)
    load_tokenizer(config.model, config.task).save_pretrained(args.folder)
    count = sum(p.numel() for p in model.parameters())
    kind = config.model.config.get("model_type")
    print(
        f"saved {kind} ({count / 1e6:.0f}M parameters) to {args.folder} "
        f"in {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
