"""The tokenizer module a `fathom synth` checkpoint ships beside `tiktoken.model`.

`tokenizer_config.json` names `tokenization_kimi.TikTokenTokenizer` in its
`auto_map`, as released Kimi checkpoints do, so tools that load a checkpoint's
tokenizer with `trust_remote_code` (Hugging Face `AutoTokenizer`, llama.cpp's
converter) find this class; the file and class names are fixed by that.
Written for fathom: byte-pair encoding by `tiktoken` over the rank file (read
here, line by line), the K3 pre-tokenizer pattern, and the reserved specials
after the ranks, spelled as `tokenizer_config.json` says.

What llama.cpp's converter reads is kept under the names it reads:
`model` (a `tiktoken.Encoding`, for `model._mergeable_ranks`),
`special_tokens` (spelling -> id) and `eos_id`.

Requires the `tiktoken` and `transformers` packages.
"""

import base64
import os
import shutil
from typing import Dict, List, Optional, Tuple

import tiktoken
from transformers import PreTrainedTokenizer

# The K3 pre-tokenizer: eight alternatives, tried in order.
PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# The reserved ids that follow the ranks.
SPECIAL_SLOTS = 256


def read_ranks(path: str) -> Dict[bytes, int]:
    """`tiktoken.model`: `base64(bytes) rank` per line, ranks 0.. in order."""
    ranks: Dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or int(fields[1]) != len(ranks):
                raise ValueError(f"{path}:{lineno}: expected `base64 {len(ranks)}`")
            ranks[base64.b64decode(fields[0])] = len(ranks)
    return ranks


def spelling(entry) -> str:
    """The text of an `added_tokens_decoder` entry (AddedToken or dict)."""
    if isinstance(entry, dict):
        return str(entry["content"])
    return str(getattr(entry, "content", entry))


class TikTokenTokenizer(PreTrainedTokenizer):
    """tiktoken byte-pair encoding over `tiktoken.model`, K3's specials after it."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        added_tokens_decoder: Optional[Dict[int, object]] = None,
        **kwargs,
    ):
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        first = len(ranks)
        named = {int(i): spelling(t) for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {}
        for i in range(first, first + SPECIAL_SLOTS):
            self.special_tokens[named.get(i, f"<|reserved_token_{i}|>")] = i
        self.model = tiktoken.Encoding(
            name="fathom-synth",
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        # Pieces: a regular token is named by its bytes read as Latin-1 (one
        # character per byte, so distinct byte strings get distinct names).
        self._piece_of = {i: b.decode("latin-1") for b, i in ranks.items()}
        self._piece_of.update({i: s for s, i in self.special_tokens.items()})
        self._id_of = {p: i for i, p in self._piece_of.items()}
        self._special_ids = set(self.special_tokens.values())
        self.eos_id = self.special_tokens.get(spelling(kwargs.get("eos_token", "[EOS]")))
        # Text is untrusted: a special's spelling inside it is ordinary text,
        # as in `fathom tokenize` without --trusted. (Hugging Face's
        # apply_chat_template(tokenize=True) tokenizes rendered text, so it
        # yields no special ids with this default; pass
        # split_special_tokens=False to recognise them.)
        kwargs.setdefault("split_special_tokens", True)
        super().__init__(added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._piece_of)

    def get_vocab(self) -> Dict[str, int]:
        vocab = dict(self._id_of)
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        # Special-looking text inside ordinary text is ordinary text.
        ids = self.model.encode(text, allowed_special=set(), disallowed_special=())
        return [self._piece_of[i] for i in ids]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self._id_of:
            return self._id_of[token]
        return self.added_tokens_encoder.get(token, self.unk_token_id or 0)

    def _convert_id_to_token(self, index: int) -> str:
        index = int(index)
        if index in self._piece_of:
            return self._piece_of[index]
        return self.added_tokens_decoder[index].content

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        out = bytearray()
        for t in tokens:
            if t in self._id_of and self._id_of[t] not in self._special_ids:
                out += t.encode("latin-1")
            else:
                out += t.encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(i) for i in token_ids]
        if any(i not in self._piece_of for i in ids):
            # Tokens added after loading: the base class knows them.
            return super()._decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.model.decode(ids, errors="replace")

    def save_vocabulary(
        self, save_directory: str, filename_prefix: Optional[str] = None
    ) -> Tuple[str]:
        name = f"{filename_prefix}-tiktoken.model" if filename_prefix else "tiktoken.model"
        target = os.path.join(save_directory, name)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
