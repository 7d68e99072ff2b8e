"""The small byte-level BPE tokenizer of every family's tiny test checkpoint (test_model.py):
trained with the tokenizers library on a family's corpus, its special tokens first (ids 0..)."""
from __future__ import annotations


def train_bpe_tokenizer(special_tokens: list[str], corpus: str, vocab_size: int):
    """-> tokenizers.Tokenizer: byte-level BPE of vocab_size trained on corpus's non-empty
    lines (four times over), special_tokens taking ids 0..len-1 in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([line for line in corpus.splitlines() if line] * 4, trainer)
    return tok
