"""The tokenizer module a `fathom synth` checkpoint ships beside `tiktoken.model`.

`tokenizer_config.json` names `tokenization_kimi.TikTokenTokenizer` in its
`auto_map`, as released Kimi checkpoints do, so tools that load a checkpoint's
tokenizer with `trust_remote_code` (Hugging Face `AutoTokenizer`, llama.cpp's
converter) find this class. It was written for fathom: byte-pair encoding by
`tiktoken` over the rank file, the K3 pre-tokenizer pattern, and the 256
reserved specials after the ranks, spelled as `tokenizer_config.json` says.

Requires the `tiktoken` and `transformers` packages.
"""

import os
import shutil
from typing import Dict, List, Optional, Tuple

import tiktoken
from tiktoken.load import load_tiktoken_bpe
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

NUM_SPECIALS = 256


def _content(token) -> str:
    """The spelling of an `added_tokens_decoder` entry (AddedToken or dict)."""
    if isinstance(token, dict):
        return str(token["content"])
    return str(getattr(token, "content", token))


class TikTokenTokenizer(PreTrainedTokenizer):
    """tiktoken byte-pair encoding over `tiktoken.model` with K3's specials."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        added_tokens_decoder: Optional[Dict[int, object]] = None,
        **kwargs,
    ):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        names = {int(i): _content(t) for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_SPECIALS)
        }
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = n + NUM_SPECIALS
        # Regular tokens are named by their bytes read as Latin-1 (one
        # character per byte, so every byte string has its own name).
        self._piece = {rank: tok.decode("latin-1") for tok, rank in ranks.items()}
        self._piece.update({i: s for s, i in self.special_tokens.items()})
        self._id = {p: i for i, p in self._piece.items()}
        self.bos_id = self.special_tokens.get(_content(bos_token))
        self.eos_id = self.special_tokens.get(_content(eos_token))
        self.pad_id = self.special_tokens.get(_content(pad_token))
        # Text is untrusted: a special's spelling inside it is ordinary text,
        # as in fathom's tokenizer; chat templates add specials by id.
        kwargs.setdefault("split_special_tokens", True)
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> Dict[str, int]:
        return dict(self._id)

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        # Special-looking text inside ordinary text is ordinary text.
        ids = self.model.encode(text, allowed_special=set(), disallowed_special=())
        return [self._piece[i] for i in ids]

    def _convert_token_to_id(self, token: str) -> int:
        return self._id.get(token, self.special_tokens.get(str(self.unk_token), 0))

    def _convert_id_to_token(self, index: int) -> str:
        return self._piece[int(index)]

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        out = bytearray()
        for t in tokens:
            if t in self.special_tokens:
                out += t.encode("utf-8")
            else:
                out += t.encode("latin-1")
        return out.decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        specials = set(self.special_tokens.values())
        if skip_special_tokens:
            token_ids = [i for i in token_ids if i not in specials]
        return self.model.decode(list(token_ids), errors="replace")

    def save_vocabulary(
        self, save_directory: str, filename_prefix: Optional[str] = None
    ) -> Tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model"
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
