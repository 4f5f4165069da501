"""Causal language modelling: next-token prediction on plain text, or on a completion given a
prompt (the loss then counts the completion's tokens only); eval_loss and perplexity.

The next-token targets are stored shifted at encoding time (`token_labels[i]` is the id of token
i + 1, IGNORE where nothing counts), so the loss is plain token cross-entropy, summed over the
counted tokens of a batch, with no shift at loss time: accumulation stays exact.

How a row becomes one sequence, for any tokenizer (the names are the tokenizer's special tokens):
    text:                 [start] text [end]
    prompt + completion:  [start] prompt [separator] completion [end]
`start` is the tokenizer's bos token, else its cls token; `end` its eos token, else its sep
token; `separator` its sep token (BERT WordPiece has one: [SEP]; GPT-2 and Llama have none).
For the MiniLM (BERT) tokenizer that is `[CLS] prompt [SEP] completion [SEP]`: exactly what
`tokenizer(prompt)` gives, so a downloaded model continues `tokenizer(prompt)` and stops at [SEP].

The output layer (hidden size x vocabulary) is most of a small model's step, and with a prompt
most positions count for nothing: for the model families in `PLAIN_HEADS` the loss runs the
output layer on the counted positions alone (`CausalLM.logits`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpo.trainer.data import TokenizedSplit, flat_split
from hpo.trainer.errors import DataError
from hpo.trainer.labels import text_column
from hpo.trainer.tasks.base import IGNORE, TokenTask
from hpo.trainer.text_window import heads, tails, window_chars

log = logging.getLogger(__name__)

# What the cache key records of the encoding rules: raise it when they change.
ENCODING_VERSION = 1


@dataclass(frozen=True)
class SpecialTokens:
    """The ids that frame a sequence; None where the tokenizer has no such token."""

    start: int | None
    separator: int | None
    end: int | None
    pad: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokens:
        def first(*names: str) -> int | None:
            ids = (getattr(tokenizer, f"{name}_token_id", None) for name in names)
            return next((int(i) for i in ids if i is not None), None)

        end = first("eos", "sep")
        # A tokenizer without a pad token (GPT-2, Llama) pads with its end token: padding is
        # masked out and never counted, so any id would do; this one keeps generate() quiet.
        pad = first("pad")
        return cls(first("bos", "cls"), first("sep"), end, end if pad is None else pad)

    @property
    def framing(self) -> int:
        """Tokens a prompt-and-completion row spends besides its prompt and completion."""
        return sum(t is not None for t in (self.start, self.separator, self.end))


@dataclass(frozen=True)
class Fitted:
    """One row's prompt and completion after truncation to max_length."""

    prompt: list[int]
    completion: list[int]
    ends: bool  # whether the end token still fits (it does not once the completion is cut)


def fit_prompt_and_completion(
    prompt: list[int], completion: list[int], tokens: SpecialTokens, max_length: int
) -> Fitted:
    """A row that fits in `max_length` as it is; else its prompt loses its first tokens (its
    end, next to the answer, stays) until the whole completion fits, but keeps its last
    max_length // 2 tokens (or all, if fewer); only past that does the completion lose its last
    tokens, and its end token. The completion is empty only where max_length is tiny."""
    framing = (tokens.start is not None) + (tokens.separator is not None)
    end = int(tokens.end is not None)
    if framing + len(prompt) + len(completion) + end <= max_length:
        return Fitted(prompt, completion, bool(end))
    keep = max(max_length - framing - len(completion) - end, min(len(prompt), max_length // 2))
    keep = max(0, min(len(prompt), keep))
    kept_prompt = prompt[len(prompt) - keep :]
    room = max_length - framing - keep
    if room >= len(completion) + end:
        return Fitted(kept_prompt, completion, bool(end))
    return Fitted(kept_prompt, completion[: max(room, 0)], False)


def sequence_and_targets(
    prompt: list[int] | None, body: list[int], tokens: SpecialTokens, ends: bool
) -> tuple[list[int], list[int]]:
    """The ids of one row and their next-token targets: the target at i is the id at i + 1
    where that id is one the loss counts (the body, i.e. the text or the completion, and the
    end token), IGNORE elsewhere (the prompt, its framing, the last position)."""
    ids = [] if tokens.start is None else [tokens.start]
    if prompt is not None:
        ids += prompt
        if tokens.separator is not None:
            ids.append(tokens.separator)
    first_counted = max(len(ids), 1)  # the first token of all is never predicted
    ids += body
    if ends and tokens.end is not None:
        ids.append(tokens.end)
    targets = [ids[i + 1] if i + 1 >= first_counted else IGNORE for i in range(len(ids) - 1)]
    return ids, [*targets, IGNORE]


# Families whose logits are their output layer applied to their body's last hidden state, with
# nothing between (no scaling, no soft-capping): for these the output layer may run on the
# counted positions alone. tests/test_causal_lm.py checks each against the full forward, so an
# upgrade of transformers that changes one fails there.
PLAIN_HEADS = frozenset({"gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "phi3", "opt"})


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The model's body (returning the last hidden state) and its output layer, where its family
    is in PLAIN_HEADS; None for any other model (a compiled one included: it runs whole), and
    for a sharded one (FSDP2): the weights its root holds, the head's and the last norm's, are
    gathered in the root's own forward alone, which the body and the head would skip."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    if isinstance(model, FSDPModule):
        return None
    inner: Any = model
    if hasattr(inner, "peft_config") and hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()  # LoRA's layers live inside the base model's own modules
    if not isinstance(inner, PreTrainedModel) or inner.config.model_type not in PLAIN_HEADS:
        return None
    body, head = inner.base_model, inner.get_output_embeddings()
    if body is inner or not isinstance(head, torch.nn.Module):
        return None
    return body, head


class CausalLM(TokenTask):
    name = "causal_lm"
    model_follows_tokenizer = True

    def logits(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output layer on the counted positions alone, where the family allows it: the
        same loss as the full logits, without the [batch, width, vocabulary] product of the
        positions that count for nothing (a prompt's, the padding). Finding the positions is
        one host sync on a GPU, taken before the forward is queued."""
        parts = body_and_head(model)
        if parts is None:
            return super().logits(model, inputs, labels)
        body, head = parts
        counted = (labels != IGNORE).nonzero(as_tuple=True)
        hidden = body(**inputs).last_hidden_state
        return head(hidden[counted]), labels[counted]

    @property
    def prompted(self) -> bool:
        """Prompt and completion columns (DataConfig.problems: both or neither), or one text."""
        return self.data.prompt_column is not None and self.data.completion_column is not None

    def required_columns(self) -> list[str]:
        if self.prompted:
            return [str(self.data.prompt_column), str(self.data.completion_column)]
        return [self.data.text_column]

    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        return []  # the outputs are the vocabulary: unnamed

    def cache_parts(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "encoding": ENCODING_VERSION,
            "prompt_column": self.data.prompt_column,
            "completion_column": self.data.completion_column,
        }

    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        tokens = SpecialTokens.of(tokenizer)
        if self.prompted:
            rows = self._prompted_rows(table, source, tokenizer, tokens)
        else:
            rows = self._text_rows(table, source, tokenizer, tokens)
        split = flat_split([ids for ids, _ in rows], None)
        split.token_labels = np.fromiter(
            (t for _, targets in rows for t in targets), dtype=np.int64, count=len(split.ids)
        )
        return split

    def _text_rows(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, tokens: SpecialTokens
    ) -> list[tuple[list[int], list[int]]]:
        texts = text_column(table, self.data.text_column, source, "text_column")
        rows, max_length, cut = [], self.data.max_length, 0
        chars = window_chars(tokenizer, max_length)
        bodies = _token_ids(tokenizer, heads(texts, chars))
        for row, (text, body) in enumerate(zip(texts, bodies, strict=True), start=1):
            if not body:
                raise DataError(
                    f"{source}: row {row} has no text in column {self.data.text_column!r} (it is "
                    "empty or blank); write the text or drop the row"
                )
            whole = len(text) <= chars  # else it goes on past its window: no end to learn
            ids, targets = sequence_and_targets(None, body, tokens, ends=whole)
            longer = len(ids) > max_length
            if longer:  # the text goes on past the cut: no end token to learn
                ids, targets = ids[:max_length], [*targets[: max_length - 1], IGNORE]
            cut += longer or not whole
            rows.append((ids, targets))
        if cut:
            log.info(
                "%s: %d of %d texts cut to data.max_length %d (their end is not learnt)",
                source,
                cut,
                len(rows),
                max_length,
            )
        return rows

    def _prompted_rows(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, tokens: SpecialTokens
    ) -> list[tuple[list[int], list[int]]]:
        prompt_key, completion_key = str(self.data.prompt_column), str(self.data.completion_column)
        rows, max_length, cut = [], self.data.max_length, 0
        chars = window_chars(tokenizer, max_length)
        questions = text_column(table, prompt_key, source, "prompt_column")
        prompts = _token_ids(tokenizer, tails(questions, chars))  # a prompt loses its start
        answers = text_column(table, completion_key, source, "completion_column")
        completions = _token_ids(tokenizer, heads(answers, chars))
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True), 1):
            if not completion:
                raise DataError(
                    f"{source}: row {row} has an empty completion (column {completion_key!r}): "
                    "there is nothing to learn from it; write the completion or drop the row"
                )
            fitted = fit_prompt_and_completion(prompt, completion, tokens, max_length)
            if not fitted.completion:
                raise DataError(
                    f"{source}: row {row}: data.max_length {max_length} leaves no room for the "
                    f"completion after the prompt's {len(fitted.prompt)} kept tokens (the prompt "
                    f"is {len(prompt)} tokens); raise data.max_length to at least "
                    f"{len(fitted.prompt) + len(completion) + tokens.framing} or shorten the prompt"
                )
            # A completion cut before tokenizing goes on past its window: no end to learn.
            whole = len(questions[row - 1]) <= chars and len(answers[row - 1]) <= chars
            ends = fitted.ends and len(answers[row - 1]) <= chars
            cut += fitted.prompt != prompt or fitted.completion != completion or not whole
            rows.append(sequence_and_targets(fitted.prompt, fitted.completion, tokens, ends))
        if cut:
            log.info(
                "%s: %d of %d rows cut to data.max_length %d (prompts from the left, then "
                "completions from the right)",
                source,
                cut,
                len(rows),
                max_length,
            )
        return rows

    def check_split(self, split: TokenizedSplit, source: str) -> None:
        labels = split.token_labels
        if labels is None or not np.any(np.asarray(labels) != IGNORE):
            raise DataError(
                f"{source}: no row has a token to predict (every text is one token long); "
                "give texts of at least two tokens"
            )

    @classmethod
    def head_options(cls, label_names: list[str]) -> dict[str, Any]:
        return {}  # no classes: the head is the vocabulary

    @classmethod
    def tokenizer_to_save(cls, tokenizer: Any) -> Any:
        """Without token type ids: a BERT tokenizer would return them, and a decoder's
        generate() refuses them (`model.generate(**tokenizer(prompt))` must just work)."""
        names = [name for name in tokenizer.model_input_names if name != "token_type_ids"]
        tokenizer.model_input_names = names
        tokenizer.init_kwargs["model_input_names"] = names  # what save_pretrained writes
        return tokenizer

    @classmethod
    def tokenizer_options(cls, tokenizer: Any) -> dict[str, Any]:
        """The model config's bos, eos and pad ids: the tokenizer's start, end and pad tokens
        (for BERT WordPiece: [CLS], [SEP], [PAD]), so that generate() stops where training ended
        every row."""
        tokens = SpecialTokens.of(tokenizer)
        return {
            "bos_token_id": tokens.start,
            "eos_token_id": tokens.end,
            "pad_token_id": tokens.pad,
        }

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}  # the loss is all the metrics need: no [batch, width, vocab] logits kept

    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        return {"eval_loss": eval_loss, "perplexity": perplexity(eval_loss)}

    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        """The loss of the best model that ignores context, on `split` itself: the entropy of
        the unigram distribution of its counted targets (a unigram model fitted to the training
        split scores at least this on it)."""
        labels = np.asarray(split.token_labels) if split.token_labels is not None else None
        if labels is None:
            return {}
        counted = labels[labels != IGNORE]
        if not len(counted):
            return {}
        _, counts = np.unique(counted, return_counts=True)
        shares = counts / len(counted)
        entropy = float(-np.sum(shares * np.log(shares)))
        return {"eval_loss": entropy, "perplexity": perplexity(entropy)}


def perplexity(mean_loss: float) -> float:
    """exp of the mean token loss (nats); inf past what a float holds, NaN for NaN."""
    if math.isnan(mean_loss):
        return math.nan
    return math.exp(mean_loss) if mean_loss < 709.0 else math.inf


def _token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's token ids without the tokenizer's own special tokens (this task frames them),
    untruncated (this task decides what a long row loses; its callers cut each text to the
    characters max_length can reach first)."""
    if not texts:
        return []
    encoded = tokenizer(
        texts,
        add_special_tokens=False,
        truncation=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    return [list(ids) for ids in encoded["input_ids"]]


TASK = CausalLM
