"""Memory one rank needs to train a model whole (ddp, or one process) and sharded over N ranks
(strategy fsdp, trainer.fsdp), fp32 with AdamW: the weights and optimizer state it holds after a
step, and the peak of live tensors while it builds (and shards) the model, as the trainer does:
rank 0 builds it whole, the others on the meta device, and each receives its share (gloo ranks
on the CPU, counted by the tracker the CPU tests use as a memory budget). The peak *during* a
step is not measured: FSDP frees and regrows a gathered weight's storage in place (`resize_`),
which that tracker does not see; it needs a GPU's allocator (torch.cuda.max_memory_allocated).
Run: .venv/bin/python bench/sharded_memory.py [--size mini] [--ranks 1,2,4] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpo.trainer.config import TrainingConfig
from hpo.trainer.fsdp import (
    held_state_bytes,
    load_from_rank0,
    match_rank0_layout,
    non_persistent_buffers,
    shard_model,
)
from hpo.trainer.memory import MemoryBudget
from hpo.trainer.step import make_optimizer

SIZES = {  # BERT shapes: hidden size, layers, heads, vocabulary
    "tiny": (64, 2, 2, 30522),
    "mini": (256, 4, 4, 30522),  # the embeddings are 70% of the weights
    "deep": (512, 8, 8, 8192),  # the embeddings are 15%, as in a 7B LLM's 8%
    "base": (768, 12, 12, 30522),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument("--ranks", default="1,2,4", help="1: the whole model, no sharding")
    parser.add_argument("--batch", type=int, default=8, help="examples per rank in the step")
    parser.add_argument("--length", type=int, default=128, help="tokens per example")
    args = parser.parse_args()
    print(f"BERT-{args.size} {SIZES[args.size]}, {args.batch} x {args.length} tokens a rank")
    for ranks in (int(n) for n in args.ranks.split(",")):
        found = mp.get_context("spawn").Manager().dict()
        port = _free_port()
        mp.spawn(_rank, args=(ranks, port, args, found), nprocs=ranks, join=True)
        params = found["params"]
        figures = ", ".join(
            f"{what} {found[key] / 2**20:7.1f} MiB ({found[key] / params:5.2f} B/param)"
            for what, key in (("holds", "held"), ("build peak", "built"))
        )
        others = ""
        if ranks > 1:
            others = f"; rank 1 build peak {found['built1'] / params:5.2f} B/param"
        how = "whole  " if ranks == 1 else f"{ranks} ranks"
        print(f"{how}: rank 0 {figures}{others}; {params / 1e6:.1f}M parameters")
    return 0


def _rank(rank: int, ranks: int, port: int, args: argparse.Namespace, found: dict) -> None:
    from transformers import AutoConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    hidden, layers, heads, vocab = SIZES[args.size]
    config = AutoConfig.for_model(
        "bert",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max(512, args.length),
    )
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length))
    with MemoryBudget(1 << 62) as budget:
        model = _built(config, rank, ranks)
        params = sum(p.numel() for p in model.parameters())
        optimizer, _ = make_optimizer(model, TrainingConfig())
        built_peak = budget.peak_bytes
        loss = model(input_ids=ids, labels=torch.zeros(args.batch, dtype=torch.long)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    if rank == 0:
        held = held_state_bytes(model, optimizer)
        found.update(held=held, built=built_peak, params=params)
    if rank == 1:
        found.update(built1=built_peak)
    dist.destroy_process_group()


def _built(config: Any, rank: int, ranks: int) -> torch.nn.Module:
    """The model whole (1 rank), or sharded as trainer.fsdp.ShardedTrainer builds it: every rank
    on the meta device, rank 0 whole as well, each rank's share sent from rank 0."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    if ranks == 1:
        return AutoModelForSequenceClassification.from_config(config)
    cpu = torch.device("cpu")
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    whole = AutoModelForSequenceClassification.from_config(config) if rank == 0 else None
    match_rank0_layout(model, whole)
    unsaved = non_persistent_buffers(model)
    shard_model(model, ranks, cpu, "fp32")
    load_from_rank0(model, whole, unsaved, cpu)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
