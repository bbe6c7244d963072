"""Train the bundled byte-level BPE tokenizer on the train split of the bundled corpus.

    python -m train.train_tokenizer [--vocab-size 8192] [--out train/tokenizer]

The result is saved as a `transformers` fast tokenizer (tokenizer.json + tokenizer_config.json), committed
to git and loaded offline with `AutoTokenizer.from_pretrained("train/tokenizer")` (or
`train.data.load_tokenizer()`). Special tokens: `<|endoftext|>` (eos and bos, separates documents) and
`<|pad|>`. Byte-level pre-tokenizer and decoder, no normalizer: decode(encode(x)) == x for any text.
Only the train split is used, so validation works stay unseen. Training is deterministic: running it
twice writes identical files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from train.data import TOKENIZER_DIR, load_text_dataset

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with `vocab_size` entries in all (256 bytes, merges, 2 special tokens)."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps the text exactly as given, which the exact round trip needs.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        # All 256 bytes up front, so any text (any script, emoji, control bytes) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        # The default clean-up would rewrite " ." as "." on decode and break the round trip.
        clean_up_tokenization_spaces=False,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args(argv)

    texts = load_text_dataset()["train"]["text"]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(args.out))
    # save_pretrained pretty-prints tokenizer.json (~540 KB); the compact form is the same data in ~220 KB.
    tokenizer.backend_tokenizer.save(str(args.out / "tokenizer.json"), pretty=False)
    print(
        f"saved a {len(tokenizer)}-token byte-level BPE tokenizer trained on {len(texts)} works to {args.out}"
    )


if __name__ == "__main__":
    main()
