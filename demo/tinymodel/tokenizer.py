"""The tiny model's tokenizer: a word-level vocabulary trained locally, plus the chat template.

Text is lower-cased and split into words and punctuation runs; each piece is one token, and
decoding joins tokens with single spaces. So any sequence of ordinary (non-special) tokens the
model emits decodes to text that re-encodes to exactly the same ids, which is what lets a
multi-turn trajectory be assembled from served token ids.

Chat format (system-less)::

    <|user|>{content}<|end|><|assistant|>{content}<|end|><|user|>...

``add_generation_prompt`` appends ``<|assistant|>``. The end-of-sequence token is ``<|end|>``: a
completion ends with it, so turn 2's prompt ids are turn 1's prompt ids + turn 1's completion ids +
the new user turn + ``<|assistant|>``.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, UNK, USER, ASSISTANT, END = "<|pad|>", "<|unk|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, UNK, USER, ASSISTANT, END]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}" + USER + "{{ message['content'] }}" + END + ""
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT + "{{ message['content'] }}" + END + ""
    "{%- else -%}{{ raise_exception('only user and assistant roles are supported') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)

#: Always in the vocabulary, so that unseen user text still mostly maps to known tokens.
BASE_WORDS: tuple[str, ...] = tuple(string.ascii_lowercase) + tuple(string.digits) + tuple(
    string.punctuation
)


def train_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Train the word-level tokenizer on ``texts`` and wrap it with the chat template."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=1000, min_frequency=1, special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(list(BASE_WORDS) + list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
