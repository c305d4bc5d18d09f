"""A character-level BPE tokenizer for the small text corpora the MTP training CLI tests write."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from omnimtp.models.tiny_lm import TINY_LM_VOCAB_SIZE


def char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=TINY_LM_VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  show_progress=False)
    tokenizer.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def write_code_corpus_and_model(target, tmp_path: Path) -> tuple[Path, Path, PreTrainedTokenizerFast]:
    """12 small code files under tmp_path/data, and target saved with a char tokenizer of that text
    under tmp_path/model. Returns (data dir, model dir, tokenizer)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.txt").write_text("".join(f"def f{j}(x): return x + {j}\n" for j in range(i, i + 30)))
    model_dir = tmp_path / "model"
    target.save_pretrained(model_dir)
    tokenizer = char_tokenizer("".join(p.read_text() for p in data.iterdir()))
    tokenizer.save_pretrained(model_dir)
    return data, model_dir, tokenizer
