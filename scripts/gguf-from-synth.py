"""Convert a `fathom synth` Kimi checkpoint to GGUF with llama.cpp's converter.

    python scripts/gguf-from-synth.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf [converter flags] < /dev/null

(stdin from /dev/null: the converter first tries a loader that asks on the
terminal whether to run the checkpoint's code; without a terminal it moves
on to the one that is told to.)

llama.cpp's `convert_hf_to_gguf.py` identifies a tokenizer's pre-tokenizer by
hashing the ids it gives for a fixed text and accepts only hashes it knows.
A synth checkpoint's vocabulary is synthetic (the released rank file is not
public here), so its hash is unknown, although its pre-tokenizer *is* Kimi's
(the pattern in the `tokenization_kimi.py` the synth ships). This wrapper runs
the converter unchanged except for that one decision: when the hash is unknown
and MODEL_DIR is a fathom synth (its `tokenization_kimi.py` says so), the
pre-tokenizer is named `kimi-k2` (K3 shares K2's). A checkpoint written with
`fathom synth --tokenizer-from` a released tokenizer needs no wrapper.

Nothing else changes: tensors, hyperparameters and the vocabulary itself are
the converter's own work. See docs/bench.md for the whole recipe.
"""

import logging
import os
import sys


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    llama_dir, model_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    module = os.path.join(model_dir, "tokenization_kimi.py")
    try:
        with open(module, encoding="utf-8") as f:
            synth = "fathom synth" in f.read()
    except OSError as e:
        sys.exit(f"{module}: {e} (write the checkpoint with a current `fathom synth`)")
    if not synth:
        sys.exit(f"{module} is not a fathom synth's: run the converter itself")
    sys.path[:0] = [llama_dir, os.path.join(llama_dir, "gguf-py")]
    import torch

    # An older torch (Debian's python3-torch 1.13, the CPU build a registry
    # serves without the CUDA wheels) lacks the float8 dtypes the converter
    # names as table keys. A synth K3 has no float8 tensor, so stand-ins that
    # no tensor carries are enough to import it.
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        if not hasattr(torch, name):
            setattr(torch, name, type(name, (), {})())
    import convert_hf_to_gguf as convert
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("gguf-from-synth").warning(
                "synthetic vocabulary: naming its pre-tokenizer kimi-k2"
            )
            return "kimi-k2"

    TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [sys.argv[0], model_dir, "--outfile", out, *sys.argv[4:]]
    convert.main()


if __name__ == "__main__":
    main()
