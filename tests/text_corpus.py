"""A character-level BPE tokenizer for the small text corpora the MTP training CLI tests write."""

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
