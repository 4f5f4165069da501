"""Save the causal LM a config builds from `model.config` (random init) with its tokenizer, as a
pretrained model folder: what an adapter (LoRA) needs as its base, on a host that cannot download
one. Run: python bench/save_base_model.py bench/configs/llama-1b.yaml /tmp/hpo-llama-1b
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from hpo.config.loader import load_config
from trainer.model import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config whose model is built from model.config")
    parser.add_argument("folder", help="where the model and its tokenizer go")
    args = parser.parse_args()
    config = load_config(args.config)
    if not config.model.config:
        raise SystemExit(f"{args.config}: model.config is empty; nothing to build")
    started = time.perf_counter()
    settings = dict(config.model.config)
    shape = transformers.AutoConfig.for_model(**settings)
    torch.manual_seed(0)
    # Initialised on the GPU where there is one: a 1B model's random init on the CPU is slow.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(shape)
    model.save_pretrained(args.folder)
    load_tokenizer(config.model, config.task).save_pretrained(args.folder)
    count = sum(p.numel() for p in model.parameters())
    print(f"saved {settings.get('model_type')} ({count / 1e6:.0f}M parameters) to {args.folder} "
          f"in {time.perf_counter() - started:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
