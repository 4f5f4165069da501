"""The causal_lm task: how rows become next-token targets (plain text, prompt and completion,
truncation), the loss, exact accumulation over micro-batches, the metrics and chance level,
the model's special tokens, and bad input."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import entropy

from hpo.trainer.batching import collate
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.errors import DataError
from hpo.trainer.evaluation import evaluate_batches
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.step import accumulate_gradients
from hpo.trainer.tasks import make_task, prepare_data
from hpo.trainer.tasks.base import IGNORE
from hpo.trainer.tasks.causal_lm import SpecialTokens, fit_prompt_and_completion
from tests.conftest import MINILM_TOKENIZER, write_csv

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 30522,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
CLS, SEP, PAD = 101, 102, 0  # the MiniLM (BERT WordPiece) tokenizer's start, end and pad
WORDS = ["cat", "dog", "fish", "bird", "tree", "house", "car", "book", "lamp", "door"]


def instruct_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Reverse a list of 1 to 5 words: completions of 1 to 5 tokens (and the end token)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        words = list(rng.choice(WORDS, size=int(rng.integers(1, 6)), replace=False))
        rows.append({"prompt": f"reverse: {' '.join(words)}", "completion": " ".join(words[::-1])})
    return rows


def clm_job(train: Path, evaluation: Path, **data: Any) -> TrainJob:
    settings = {"prompt_column": "prompt", "completion_column": "completion", "max_length": 32}
    return TrainJob(
        data=DataConfig(train_file=str(train), eval_file=str(evaluation), **{**settings, **data}),
        model=ModelConfig(config=dict(TINY_LLAMA), tokenizer=MINILM_TOKENIZER),
        training=TrainingConfig(device="cpu", physical_batch_size=4, learning_rate=3e-3),
        task="causal_lm",
    )


def prepared_for(tmp_path: Path, rows: list[dict[str, str]], **data: Any) -> PreparedData:
    train = write_csv(tmp_path / "train.csv", rows)
    job = clm_job(train, train, **data)
    return prepare_data(job.data, load_tokenizer(job.model), "causal_lm", job.training)


def example(split: Any, index: int) -> tuple[list[int], list[int]]:
    start, end = split.offsets[index], split.offsets[index + 1]
    return list(split.ids[start:end]), list(split.token_labels[start:end])


def word_ids(*words: str) -> list[int]:
    tokenizer = load_tokenizer(ModelConfig(tokenizer=MINILM_TOKENIZER))
    return [int(tokenizer.convert_tokens_to_ids(w)) for w in words]


# -- encoding ------------------------------------------------------------------------------------


def test_a_prompt_and_completion_count_only_the_completion_and_its_end(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, [{"prompt": "reverse: cat dog", "completion": "dog cat"}])
    ids, targets = example(data.train, 0)
    reverse, colon = word_ids("reverse", ":")
    cat, dog = word_ids("cat", "dog")
    # [CLS] prompt [SEP] completion [SEP]: what tokenizer(prompt) gives, then the answer.
    assert ids == [CLS, reverse, colon, cat, dog, SEP, dog, cat, SEP]
    # Stored shifted: the target at i is the token at i + 1, where that token is the answer's.
    assert targets == [IGNORE] * 5 + [dog, cat, SEP, IGNORE]
    assert data.label_names == [] and data.pad_token_id == PAD


def test_plain_text_counts_every_token_after_the_start(tmp_path: Path) -> None:
    data = prepared_for(
        tmp_path, [{"text": "cat dog fish"}], prompt_column=None, completion_column=None
    )
    ids, targets = example(data.train, 0)
    cat, dog, fish = word_ids("cat", "dog", "fish")
    assert ids == [CLS, cat, dog, fish, SEP]
    assert targets == [cat, dog, fish, SEP, IGNORE]


def test_a_text_longer_than_max_length_is_cut_and_learns_no_end(tmp_path: Path) -> None:
    text = " ".join(WORDS)  # 10 tokens, 12 with [CLS] and [SEP]
    data = prepared_for(
        tmp_path, [{"text": text}], prompt_column=None, completion_column=None, max_length=6
    )
    ids, targets = example(data.train, 0)
    first = word_ids(*WORDS[:5])
    assert ids == [CLS, *first]  # the text goes on: no [SEP] to learn where it was cut
    assert targets == [*first, IGNORE]


def test_a_long_prompt_loses_its_start_and_the_completion_stays_whole(tmp_path: Path) -> None:
    prompt = "reverse: " + " ".join(WORDS)  # 12 tokens
    data = prepared_for(tmp_path, [{"prompt": prompt, "completion": "dog cat"}], max_length=10)
    ids, targets = example(data.train, 0)
    dog, cat = word_ids("dog", "cat")
    # 10 = [CLS] + 5 prompt tokens + [SEP] + 2 + [SEP]: the prompt keeps its last 5 (its end,
    # next to the answer), which is also max_length // 2.
    assert ids == [CLS, *word_ids(*WORDS[5:]), SEP, dog, cat, SEP]
    assert [t for t in targets if t != IGNORE] == [dog, cat, SEP]


def test_truncation_keeps_half_the_length_for_the_prompt_then_cuts_the_completion() -> None:
    tokens = SpecialTokens(start=CLS, separator=SEP, end=SEP, pad=PAD)
    prompt, completion = list(range(1000, 1012)), list(range(2000, 2012))
    fitted = fit_prompt_and_completion(prompt, completion, tokens, max_length=16)
    assert fitted.prompt == prompt[-8:]  # max_length // 2
    assert fitted.completion == completion[:6] and not fitted.ends  # 16 = 1 + 8 + 1 + 6
    whole = fit_prompt_and_completion(prompt[:3], completion[:3], tokens, max_length=16)
    assert (whole.prompt, whole.completion, whole.ends) == (prompt[:3], completion[:3], True)
    # A tokenizer without start or separator tokens (GPT-2 style) spends only the end token.
    bare = SpecialTokens(start=None, separator=None, end=50256, pad=50256)
    fitted = fit_prompt_and_completion(prompt, completion[:2], bare, max_length=10)
    assert fitted.prompt == prompt[-7:] and fitted.completion == completion[:2] and fitted.ends


@pytest.mark.parametrize(
    ("rows", "data", "message"),
    [
        (
            [{"prompt": "reverse: cat", "completion": "cat"}, {"prompt": "add", "completion": ""}],
            {},
            "row 2 has an empty completion (column 'completion')",
        ),
        (
            [{"prompt": "reverse: cat", "completion": "  "}],
            {},
            "row 1 has an empty completion",
        ),
        (
            [{"prompt": "reverse: cat dog fish bird", "completion": "bird fish dog cat"}],
            {"max_length": 4},
            "row 1: data.max_length 4 leaves no room for the completion after the prompt's 2 "
            "kept tokens (the prompt is 6 tokens); raise data.max_length to at least 9",
        ),
        (
            [{"text": "cat dog"}, {"text": ""}],
            {"prompt_column": None, "completion_column": None},
            "row 2 has no text in column 'text'",
        ),
        (
            [{"prompt": "reverse: cat", "answer": "cat"}],
            {},
            "no column 'completion' (columns: ['answer', 'prompt']); set data.completion_column",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_row_and_the_fix(
    tmp_path: Path, rows: list[dict[str, str]], data: dict[str, Any], message: str
) -> None:
    with pytest.raises(DataError) as caught:
        prepared_for(tmp_path, rows, **data)
    assert message in str(caught.value)
    assert str(tmp_path / "train.csv") in str(caught.value)


def test_jsonl_rows_encode_like_csv_rows(tmp_path: Path) -> None:
    rows = instruct_rows(6, seed=3)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    job = clm_job(jsonl, jsonl)
    from_json = prepare_data(job.data, load_tokenizer(job.model), "causal_lm")
    from_csv = prepared_for(tmp_path, rows)
    assert np.array_equal(from_json.train.ids, from_csv.train.ids)
    assert np.array_equal(from_json.train.token_labels, from_csv.train.token_labels)


def test_collation_pads_targets_with_ignore(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, instruct_rows(4, seed=1))
    batch = collate(data.train, np.arange(4), data.pad_token_id)
    lengths = data.train.lengths
    assert batch["labels"].shape == batch["input_ids"].shape == (4, int(lengths.max()))
    for row, length in enumerate(lengths):
        assert batch["attention_mask"][row].sum() == length
        assert (batch["labels"][row, length:] == IGNORE).all()
        assert (batch["input_ids"][row, length:] == PAD).all()


# -- the model -------------------------------------------------------------------------------------


def test_the_model_starts_ends_and_pads_with_the_tokenizers_tokens(tmp_path: Path) -> None:
    job = clm_job(tmp_path / "unused.csv", tmp_path / "unused.csv")
    model = build_model(job.model, [], seed=0, task="causal_lm")
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (CLS, SEP, PAD)
    assert model.generation_config.eos_token_id == SEP  # generate() stops at [SEP]


# -- loss ------------------------------------------------------------------------------------------


def test_the_loss_is_the_models_own_shifted_causal_lm_loss(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, instruct_rows(8, seed=2))
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    model = build_model(clm_job(tmp_path, tmp_path).model, [], seed=0, task="causal_lm").eval()
    batch = collate(data.train, np.arange(8), data.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ours = task.loss_sum(logits, batch["labels"]) / task.units(batch["labels"])
    # transformers' convention: labels are the ids themselves (-100 where nothing counts) and
    # the model shifts them; our stored targets are exactly those labels shifted by one.
    hf_labels = torch.full_like(batch["labels"], IGNORE)
    hf_labels[:, 1:] = batch["labels"][:, :-1]
    reference = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, labels=hf_labels)
    torch.testing.assert_close(ours, reference.loss, rtol=1e-6, atol=1e-6)
    assert int(task.units(batch["labels"])) == int((batch["labels"] != IGNORE).sum())


# One tiny model per family whose output layer may run on the counted positions alone.
SMALL = {
    "vocab_size": 120,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "gpt2": {
        "vocab_size": 120,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "gpt_neox": SMALL,
    "llama": SMALL,
    "mistral": {**SMALL, "num_key_value_heads": 2},
    "qwen2": {**SMALL, "num_key_value_heads": 4},
    "qwen3": {**SMALL, "num_key_value_heads": 4, "head_dim": 8},
    "phi3": {**SMALL, "pad_token_id": 0},
    "opt": {
        "vocab_size": 120,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "ffn_dim": 64,
        "num_attention_heads": 4,
        "word_embed_proj_dim": 32,
        "max_position_embeddings": 64,
    },
}


def family_model(family: str, settings: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **settings)
    config.hidden_dropout = config.attention_dropout = 0.0
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def prompt_batch(rows: int = 4, width: int = 12) -> dict[str, torch.Tensor]:
    """Rows of different lengths, each counting only its last few (completion) targets."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for row in range(rows):
        length = width - row  # padded on the right
        mask[row, length:] = 0
        labels[row, length - 4 : length - 1] = ids[row, length - 3 : length]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_output_layer_on_counted_positions_alone_gives_the_full_loss_and_gradients(
    family: str,
) -> None:
    """For every family in PLAIN_HEADS, the loss and every gradient through the counted-only
    output layer equal those through the full logits: an upgrade of transformers that puts
    anything between a family's body and its output layer fails here."""
    from hpo.trainer.tasks.causal_lm import PLAIN_HEADS, body_and_head

    assert set(FAMILIES) == PLAIN_HEADS
    model = family_model(family, FAMILIES[family])
    assert body_and_head(model) is not None
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    batch = prompt_batch()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    results = []
    for logits_of in (task.logits, super(type(task), task).logits):  # counted-only, then full
        model.zero_grad()
        logits, labels = logits_of(model, inputs, batch["labels"])
        loss = task.loss_sum(logits, labels) / task.units(batch["labels"])
        loss.backward()
        results.append((logits.shape, loss, [p.grad.clone() for p in model.parameters()]))
    (counted_shape, counted_loss, counted_grads), (full_shape, full_loss, full_grads) = results
    assert counted_shape[0] == int((batch["labels"] != IGNORE).sum()) < full_shape[:2].numel()
    torch.testing.assert_close(counted_loss, full_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(counted_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_lora_model_and_other_families_take_the_path_that_is_right_for_them() -> None:
    """LoRA's base model keeps the counted-only output layer (its adapters are inside the base
    model's layers); a family with something between body and output layer (Gemma 2's soft
    cap) and a compiled model run whole."""
    from peft import LoraConfig, get_peft_model

    from hpo.trainer.tasks.causal_lm import body_and_head

    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    batch = prompt_batch()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    lora = get_peft_model(family_model("llama", SMALL), LoraConfig(r=4, target_modules=["q_proj"]))
    assert body_and_head(lora) is not None
    with torch.no_grad():
        for module in lora.modules():  # LoRA's B starts at zero: make the adapter count
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_()
        logits, labels = task.logits(lora, inputs, batch["labels"])
        full = lora(**inputs).logits
    kept = batch["labels"] != IGNORE
    torch.testing.assert_close(logits, full[kept], rtol=1e-5, atol=1e-5)
    gemma2 = family_model("gemma2", {**SMALL, "head_dim": 8, "final_logit_softcapping": 5.0})
    assert body_and_head(gemma2) is None
    assert body_and_head(torch.compile(family_model("llama", SMALL))) is None
    logits, labels = task.logits(gemma2, inputs, batch["labels"])
    assert logits.shape[:2] == batch["input_ids"].shape and labels is batch["labels"]


def test_label_smoothing_is_token_cross_entropy_with_smoothing(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, instruct_rows(4, seed=5))
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    labels = collate(data.train, np.arange(4), data.pad_token_id)["labels"]
    logits = torch.randn(*labels.shape, 30522, generator=torch.Generator().manual_seed(0))
    kept = labels != IGNORE
    expected = torch.nn.functional.cross_entropy(
        logits[kept], labels[kept], label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(task.loss_sum(logits, labels, None, 0.1), expected)


def test_accumulated_micro_batches_give_the_gradient_of_one_big_batch(tmp_path: Path) -> None:
    """1 x 32 and 8 x 4: micro-batches of different counted-token totals (completions of 1 to
    5 words), so a mean of micro-batch means would weight their tokens unequally."""
    data = prepared_for(tmp_path, instruct_rows(32, seed=7))
    indices = np.argsort(-data.train.lengths, kind="stable")  # widths differ per micro-batch
    micro = [collate(data.train, part, data.pad_token_id) for part in np.split(indices, 8)]
    whole = [collate(data.train, indices, data.pad_token_id)]
    counted = [int((b["labels"] != IGNORE).sum()) for b in micro]
    assert len(set(counted)) > 1, counted  # the property is tested where it matters
    cfg = TrainingConfig(label_smoothing=0.1)
    task = make_task("causal_lm", DataConfig(), cfg)
    model = build_model(clm_job(tmp_path, tmp_path).model, [], seed=0, task="causal_lm").eval()
    twin = copy.deepcopy(model)
    results = []
    for net, batches in ((model, micro), (twin, whole)):
        loss = accumulate_gradients(net, batches, cfg, nullcontext, task)
        results.append((loss, [p.grad.clone() for p in net.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # The mean of micro-batch means (transformers before 4.46) is measurably another loss.
    means = [
        task.loss_sum(net_logits(model, b), b["labels"]) / n
        for b, n in zip(micro, counted, strict=True)
    ]
    assert abs(float(torch.stack(means).mean()) - float(loss_b)) > 1e-4


def net_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        return model(**inputs).logits  # type: ignore[no-any-return]


# -- evaluation ------------------------------------------------------------------------------------


def test_evaluation_reports_the_mean_token_loss_and_its_perplexity(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, instruct_rows(10, seed=4))
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    model = build_model(clm_job(tmp_path, tmp_path).model, [], seed=0, task="causal_lm").eval()
    parts = np.array_split(np.arange(10), 3)
    batches = [collate(data.eval, part, data.pad_token_id) for part in parts]
    metrics = evaluate_batches(model, batches, torch.device("cpu"), "fp32", task, [])
    assert set(metrics) == {"eval_loss", "perplexity"}
    whole = collate(data.eval, np.arange(10), data.pad_token_id)
    labels = whole["labels"]
    logits = net_logits(model, whole)
    expected = torch.nn.functional.cross_entropy(logits[labels != IGNORE], labels[labels != IGNORE])
    assert metrics["eval_loss"] == pytest.approx(float(expected), rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-6)
    assert task.eval_outputs(logits, labels) == {}  # no [batch, width, vocab] logits kept


def test_the_chance_level_is_the_unigram_entropy_of_the_counted_targets(tmp_path: Path) -> None:
    data = prepared_for(tmp_path, instruct_rows(20, seed=6))
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    levels = task.chance_levels(data.eval, [])
    targets = np.asarray(data.eval.token_labels)
    _, counts = np.unique(targets[targets != IGNORE], return_counts=True)
    assert levels["eval_loss"] == pytest.approx(entropy(counts), abs=1e-6)  # scipy, in nats
    assert levels["perplexity"] == pytest.approx(math.exp(entropy(counts)), rel=1e-6)
    # A diverged run's loss: perplexity is inf (not an OverflowError), NaN stays NaN.
    assert task.metrics({}, 1000.0, [])["perplexity"] == math.inf
    assert math.isnan(task.metrics({}, float("nan"), [])["perplexity"])


def test_the_batch_finders_worst_case_counts_every_token() -> None:
    task = make_task("causal_lm", DataConfig(), TrainingConfig())
    labels = task.worst_case_labels(3, 16, 0)
    assert labels.shape == (3, 16) and int(task.units(labels)) == 48


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "data", "message"),
    [
        (
            "causal_lm",
            {"prompt_column": "prompt"},
            "data.completion_column: is required with data.prompt_column: give both",
        ),
        (
            "causal_lm",
            {"completion_column": "answer"},
            "data.prompt_column: is required with data.completion_column",
        ),
        (
            "causal_lm",
            {"prompt_column": "q", "completion_column": "q"},
            "data.completion_column: got 'q'; must differ from prompt_column",
        ),
        (
            "sequence_classification",
            {"prompt_column": "q", "completion_column": "a"},
            "data.prompt_column: means nothing for the task sequence_classification",
        ),
        (
            "causal_lm",
            {"text_pair_column": "other"},
            "data.text_pair_column: means nothing for the task causal_lm",
        ),
    ],
)
def test_prompt_settings_are_checked_up_front(
    tmp_path: Path, task: str, data: dict[str, Any], message: str
) -> None:
    from hpo.config.loader import parse_config
    from hpo.errors import ConfigError
    from tests.conftest import tiny_config

    raw = tiny_config(tmp_path / "t.csv", tmp_path / "e.csv", data=data)
    raw["task"] = task
    raw["study"].pop("metric")  # the task's default
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    assert message in str(caught.value)


def test_the_shipped_config_trains_a_causal_llama_on_the_instruction_set() -> None:
    from hpo.config.loader import load_config

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "causal-lm.yaml")
    assert config.task == "causal_lm" and config.study.objectives == ["eval_loss"]
    assert config.model.config is not None and config.model.config["model_type"] == "llama"
    assert (config.data.prompt_column, config.data.completion_column) == ("prompt", "completion")
    assert Path(config.data.train_file).is_file() and Path(config.data.eval_file).is_file()


# -- end to end ------------------------------------------------------------------------------------


def test_a_causal_lm_study_prunes_resumes_and_downloads_a_generating_model(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Through `hpo run`: a trial stopped by SIGTERM and resumed from its checkpoint, one
    pruned; `hpo best --download` gives a folder that AutoModelForCausalLM loads and that
    generates until [SEP]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.task_study import run_task_study

    data = (
        write_csv(tmp_path / "train.csv", instruct_rows(192, seed=11)),
        write_csv(tmp_path / "eval.csv", instruct_rows(16, seed=12)),
    )
    run = run_task_study(
        tmp_path,
        hpo_main,
        capsys,
        "causal_lm",
        data,
        "eval_loss",
        model={"config": dict(TINY_LLAMA)},
        data={"prompt_column": "prompt", "completion_column": "completion"},
    )
    assert run.resumed.value is not None  # it learnt: past the untrained model by 0.5 nats
    assert run.resumed.value < run.pruned.intermediate_values[1] - 0.5

    assert "sha256 checked" in run.downloaded
    model = AutoModelForCausalLM.from_pretrained(run.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (CLS, SEP)
    # [CLS] prompt [SEP], as in training; a Llama takes no token_type_ids, and the tokenizer
    # saved with it gives none.
    prompt = tokenizer("reverse: cat dog", return_tensors="pt")
    assert "token_type_ids" not in prompt
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
