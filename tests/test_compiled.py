"""model.compile: graphs compiled once per process and reused by a fresh model of the next trial;
the batch dimension dynamic; what a trial compiled is recorded. aot_eager stands in for inductor
(which takes minutes on this CPU); the counting, the reuse and the shapes are the same."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch

from hpo.trainer import compiled
from hpo.trainer.config import ModelConfig
from hpo.trainer.model import build_model
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, run_study, tiny_config, write_config


def test_the_private_torch_names_hpo_compiles_with_still_exist() -> None:
    # If this fails after a torch upgrade, mend trainer/compiled.py (the only place using them).
    from torch._dynamo import lookup_backend, maybe_mark_dynamic

    assert callable(lookup_backend("inductor")) and callable(lookup_backend("aot_eager"))
    assert callable(maybe_mark_dynamic)


def _forward(model: torch.nn.Module, batch: int, width: int) -> None:
    ids = torch.randint(0, 1000, (batch, width))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_a_fresh_model_reuses_the_graphs_of_the_last_and_batch_sizes_share_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch.compiler.reset()
    config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
    shapes = [(4, 32), (5, 32), (3, 32), (8, 32), (4, 48), (7, 48)]
    before = compiled.compile_stats()
    first = compiled.compile_model(build_model(config, ["a", "b"], seed=0), "model")
    with torch.no_grad():
        for batch, width in shapes:
            _forward(first, batch, width)
    used = compiled.compile_stats() - before
    # One graph per width: the batch sizes (3 to 8) do not each compile a graph of their own.
    assert 1 <= used.graphs <= 2 and used.seconds > 0
    before = compiled.compile_stats()
    second = compiled.compile_model(build_model(config, ["a", "b"], seed=1), "model")  # next trial
    with torch.no_grad():
        for batch, width in shapes:
            _forward(second, batch, width)
    assert (compiled.compile_stats() - before).graphs == 0
    torch.compiler.reset()


def test_a_worker_compiles_for_its_first_trial_only(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 2, "pruner": {"type": "none"}},
        model={"compile": True},
        training={"max_steps": 3},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    result = run_study(config, url, tmp_path, env={compiled.BACKEND_ENV: "aot_eager"})
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    graphs = [t.user_attrs["compile_graphs"] for t in sorted(trials, key=lambda t: t.number)]
    assert graphs[0] > 0 and graphs[1] == 0, graphs
    assert trials[0].user_attrs["compile_s"] > 0


def _train_step(model: torch.nn.Module, batch: int, width: int) -> None:
    ids = torch.randint(0, 1000, (batch, width))
    model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 1000,
}


@pytest.mark.parametrize(
    ("family", "task"), [(TINY_BERT, "sequence_classification"), (TINY_LLAMA, "causal_lm")]
)
def test_compiling_the_blocks_costs_one_layer_whatever_the_depth(
    monkeypatch: pytest.MonkeyPatch, family: dict, task: str
) -> None:
    # Issue 48: the whole 1B model compiled for over 400 s on an H200. Compiled by blocks, a
    # model of 4 layers compiles the graphs of a model of 2, and every batch and width share them.
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    shapes = [(4, 32), (5, 32), (3, 32), (8, 48), (7, 48)]
    graphs = {}
    for layers in (2, 4):
        torch.compiler.reset()
        config = ModelConfig(
            config={**family, "num_hidden_layers": layers},
            tokenizer=MINILM_TOKENIZER,
            compile_scope="blocks",
        )
        model = build_model(config, ["a", "b"], seed=0, task=task)
        assert len(compiled.repeated_blocks(model)) == layers
        before = compiled.compile_stats()
        assert compiled.compile_model(model, "blocks") is model  # compiled in place
        for batch, width in shapes:
            _train_step(model, batch, width)
        graphs[layers] = (compiled.compile_stats() - before).graphs
        before = compiled.compile_stats()
        fresh = compiled.compile_model(build_model(config, ["a", "b"], seed=1, task=task), "blocks")
        for batch, width in shapes:
            _train_step(fresh, batch, width)
        assert (compiled.compile_stats() - before).graphs == 0  # the next trial's model
    assert 1 <= graphs[4] == graphs[2] <= 3, graphs
    torch.compiler.reset()


def test_a_model_without_repeated_blocks_is_compiled_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch.compiler.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert compiled.repeated_blocks(model) == []
    before = compiled.compile_stats()
    whole = compiled.compile_model(model, "blocks")
    assert whole is not model
    whole(torch.randn(3, 4)).sum().backward()
    assert (compiled.compile_stats() - before).graphs >= 1
    torch.compiler.reset()


def test_a_causal_model_trains_without_a_key_value_cache() -> None:
    config = ModelConfig(config={**TINY_LLAMA, "num_hidden_layers": 2}, tokenizer=MINILM_TOKENIZER)
    model = build_model(config, [], seed=0, task="causal_lm")
    assert model.config.use_cache is False


def test_cuda_graphs_ask_inductor_for_them_for_the_forward_and_the_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Inductor's compile_fx applies config_patches to the backward graph it compiles later too.
    asked: list[dict] = []

    def inductor(graph: torch.fx.GraphModule, inputs: list, **options: dict) -> object:
        asked.append(options)
        return graph.forward

    monkeypatch.delenv(compiled.BACKEND_ENV, raising=False)
    monkeypatch.setattr(compiled, "_compiler", lambda name: inductor)
    torch.compiler.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    compiled.compile_model(model, "model", cuda_graphs=True)(torch.randn(3, 4))
    graphed = asked[-1]
    torch.compiler.reset()
    compiled.compile_model(model, "model")(torch.randn(3, 4))
    assert graphed == {"config_patches": {"triton.cudagraphs": True}} and asked[-1] == {}
    torch.compiler.reset()


def test_cuda_graphs_without_compile_are_refused() -> None:
    config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER, cuda_graphs=True)
    assert [key for key, _, _ in config.problems()] == ["cuda_graphs"]
    config = ModelConfig(
        config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER, cuda_graphs=True, compile=True
    )
    assert config.problems() == []


def test_auto_compiles_a_shallow_model_whole_and_a_deep_one_by_blocks() -> None:
    def model(layers: int) -> torch.nn.Module:
        config = ModelConfig(
            config={**TINY_BERT, "num_hidden_layers": layers}, tokenizer=MINILM_TOKENIZER
        )
        return build_model(config, ["a", "b"], seed=0)

    shallow, deep = model(compiled.WHOLE_UP_TO_BLOCKS), model(compiled.WHOLE_UP_TO_BLOCKS + 1)
    assert compiled.compile_model(shallow, "auto") is not shallow  # one graph, the whole forward
    assert compiled.compile_model(deep, "auto") is deep  # its blocks compiled in place
    assert ModelConfig().compile_scope == "auto"
    torch.compiler.reset()


class _Replayed(torch.autograd.Function):
    """x @ w whose weight gradient comes out in one buffer reused by every backward, as a CUDA
    graph's outputs do: a fresh tensor on the pool's storage, which autograd may keep as .grad."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        pool: torch.UntypedStorage,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.pool = pool  # type: ignore[attr-defined]
        return x @ w

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        out = torch.empty(0).set_(ctx.pool, 0, w.shape)  # type: ignore[attr-defined]
        out.copy_(x.T @ grad)
        return grad @ w.T, out, None


class _ReplayedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 1))
        self.pool = torch.UntypedStorage(4 * 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _Replayed.apply(input_ids, self.weight, self.pool)


@pytest.mark.parametrize("graphed", [False, True])
def test_accumulation_over_graph_replays_sums_every_micro_batch_when_grads_are_allocated(
    graphed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU failure of 2026-11-28 (128 x 2 with model.cuda_graphs): the first micro-batch's
    # gradient was the graph's own buffer, overwritten by the second replay before autograd added
    # to it. With a gradient of its own (allocate_grads, kept by keep_grads) both count.
    from contextlib import nullcontext

    from hpo.trainer.config import DataConfig, TrainingConfig
    from hpo.trainer.step import (
        accumulate_gradients,
        allocate_grads,
        make_optimizer,
        optimizer_step,
    )
    from hpo.trainer.tasks import make_task

    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    torch.manual_seed(0)
    model = _ReplayedLinear()
    cfg = TrainingConfig(max_grad_norm=None)
    task = make_task("regression", DataConfig(), cfg)
    batches = [{"input_ids": torch.randn(3, 4), "labels": torch.randn(3)} for _ in range(2)]
    whole = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    expected = torch.func.grad(lambda w: ((whole @ w).squeeze(-1) - labels).pow(2).mean())(
        model.weight.detach()
    )
    if graphed:
        allocate_grads(model)
    optimizer, _ = make_optimizer(model, cfg)
    for _ in range(2):  # the grads stay the parameter's own from step to step
        own = model.weight.grad
        accumulate_gradients(model, batches, cfg, nullcontext, task, cuda_graphs=graphed)
        got = model.weight.grad.clone()
        if graphed:
            assert model.weight.grad is own
            torch.testing.assert_close(got, expected)
        else:  # the hazard itself: only the last micro-batch's gradient is left
            assert not torch.allclose(got, expected)
        optimizer_step(model, optimizer, cfg, keep_grads=graphed)
        expected = torch.func.grad(lambda w: ((whole @ w).squeeze(-1) - labels).pow(2).mean())(
            model.weight.detach()
        )
    assert len(marks) == (4 if graphed else 0)
