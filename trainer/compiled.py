"""`model.compile: true`: torch.compile, paid once per trial process rather than once per trial.

The worker keeps its trial process from one trial to the next, and torch.compile treats a
module's parameters as graph inputs, so a fresh model of the same architecture runs the graphs
compiled for an earlier trial, provided that every trial compiles through the same backend
object: `BACKEND`, one per process. What a trial compiles is counted (`compile_stats`): graphs
and seconds spent in the compiler. A deep model's repeated blocks are compiled alone
(`compile_model`), one graph for every layer. Shapes are kept few: the batch dimension becomes
dynamic (micro-batches of an accumulated step differ by one, evaluation batches are twice as
large), and sequence lengths are padded to a handful of widths (`hpo.trainer.batching.Padding`).
Inductor keeps its caches in one folder per host (`inductor_cache_dir`), which every worker of
the host shares.

The only private torch names hpo uses for compilation are here, with a test that breaks when
an upgrade moves them (tests/test_compiled.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpo.trainer.config import CompileScope
from hpo.trainer.digests import hpo_cache_root

# Tests only: compile with this backend (aot_eager compiles in seconds on a CPU, inductor takes
# minutes there); users get torch's default, inductor.
BACKEND_ENV = "HPO_TEST_COMPILE_BACKEND"


@dataclass(frozen=True)
class CompileStats:
    graphs: int = 0  # graphs compiled: the first ones, then every recompile
    seconds: float = 0.0  # in the compiler backend (a lazily compiled backward graph excepted)

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(self.graphs - other.graphs, self.seconds - other.seconds)


_stats = CompileStats()
_lock = threading.Lock()


def compile_stats() -> CompileStats:
    """Everything compiled in this process so far; a run subtracts what it found at its start."""
    return _stats


def _compiler(name: str) -> Callable[..., Any]:
    from torch._dynamo import lookup_backend  # private: see the module's docstring

    return lookup_backend(name)


def _count(compile_graph: Callable[[], Any]) -> Any:
    global _stats
    started = time.perf_counter()
    try:
        return compile_graph()
    finally:
        with _lock:
            _stats = CompileStats(_stats.graphs + 1, _stats.seconds + time.perf_counter() - started)


def _counting_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    name = os.environ.get(BACKEND_ENV) or "inductor"
    return _count(lambda: _compiler(name)(graph, example_inputs))


# What torch.compile's mode "reduce-overhead" sets: inductor's output replays as CUDA graphs.
# Inductor applies the patch to the backward graph too, compiled later (config_patches).
CUDA_GRAPHS = {"triton.cudagraphs": True}


def _graphed_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    name = os.environ.get(BACKEND_ENV) or "inductor"
    if name != "inductor":  # the tests' aot_eager has no CUDA graphs to make
        return _count(lambda: _compiler(name)(graph, example_inputs))
    return _count(lambda: _compiler(name)(graph, example_inputs, config_patches=CUDA_GRAPHS))


BACKEND = _counting_backend
GRAPHED_BACKEND = _graphed_backend


def _batch_dimension_dynamic(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    from torch._dynamo import maybe_mark_dynamic  # private: see the module's docstring

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            maybe_mark_dynamic(value, 0)


# `auto` compiles a model of at most this many blocks whole. On an H200 (2026-11-28),
# BERT-base (12 blocks) at 26 tokens ran 1,908 samples/s compiled whole against 1,385 by
# blocks, its compile 103 s against 19 s; a 1B causal LM (22 blocks) compiled by blocks in
# 25 s and ran at 41.7% MFU, where compiled whole it had printed nothing after 400 s.
WHOLE_UP_TO_BLOCKS = 12


def compile_model(
    model: torch.nn.Module, scope: CompileScope = "auto", cuda_graphs: bool = False
) -> torch.nn.Module:
    """`model` compiled through this process's one backend (model.compile_scope), its
    graphs replayed as CUDA graphs with `cuda_graphs` (model.cuda_graphs).

    `blocks`: each layer of the model's repeated blocks is compiled in place, and since they
    share one forward, one graph serves them all: compiling costs one layer, not the model's
    depth (a 1B causal LM compiled whole did not finish in 400 s on an H200, 2026-11-28). Its
    sizes are dynamic from the start (its inputs are made inside the model, where no hook can
    mark them): one graph for every batch and width.
    A model without repeated blocks (a user's small network) is compiled whole.
    `model`: the whole forward as one graph, its batch dimension dynamic from the start.
    `auto`: `model` up to WHOLE_UP_TO_BLOCKS blocks, `blocks` above."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    backend = GRAPHED_BACKEND if cuda_graphs else BACKEND
    blocks = repeated_blocks(model) if scope != "model" else []
    if scope == "auto" and len(blocks) <= WHOLE_UP_TO_BLOCKS:
        blocks = []
    if blocks:
        for block in blocks:
            block.compile(backend=backend, dynamic=True)
        return model
    compiled: torch.nn.Module = torch.compile(model, backend=backend)  # type: ignore[assignment]
    compiled.register_forward_pre_hook(_batch_dimension_dynamic, with_kwargs=True)
    return compiled


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of the model's largest list of same-class modules (a transformer's blocks:
    BERT's encoder.layer, Llama's model.layers, also inside a peft wrapper); none if it has no
    such list."""
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(layer) for layer in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = list(module), size
    return best


def inductor_cache_dir() -> Path:
    """Inductor's kernel and graph caches, beside hpo's token cache: every worker of the host
    shares them, and they outlive a reboot (torch's default is under /tmp)."""
    return hpo_cache_root() / "inductor"
