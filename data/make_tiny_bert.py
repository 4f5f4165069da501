"""Save a tiny BERT with a WordPiece tokenizer of its own under data/models/tiny-bert, the second
model of configs/model-choice.yaml; run ``python data/make_tiny_bert.py``. Deterministic.

Its weights are random (a stand-in for a second pretrained model where no hub is reachable);
its tokenizer is trained on the NLI training texts, so it tokenizes unlike MiniLM's.
"""

from __future__ import annotations

import csv
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
FOLDER = DATA_DIR / "models" / "tiny-bert"
VOCAB_SIZE = 2000
SEED = 20240601


def save_tiny_bert(folder: Path, texts: list[str], vocab_size: int = VOCAB_SIZE) -> Path:
    """A BERT of two small layers and its own tokenizer, saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    wordpiece.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = sorted(wordpiece.get_vocab().items(), key=lambda item: item[1])
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), "utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=128)  # the config as one table  # fmt: skip
    torch.manual_seed(SEED)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def nli_texts() -> list[str]:
    with (DATA_DIR / "nli" / "train.csv").open(encoding="utf-8", newline="") as file:
        return [
            text for row in csv.DictReader(file) for text in (row["premise"], row["hypothesis"])
        ]


if __name__ == "__main__":
    print(save_tiny_bert(FOLDER, nli_texts()))
