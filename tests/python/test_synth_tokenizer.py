"""A `fathom synth` checkpoint's tokenizer module, loaded the way converters do.

    FATHOM_BIN=target/release/fathom python tests/python/test_synth_tokenizer.py

Writes a small synthetic K3 checkpoint, loads its tokenizer with Hugging Face
`AutoTokenizer.from_pretrained(..., trust_remote_code=True)` (the module named
in `tokenizer_config.json`'s `auto_map`), and checks that it gives the same ids
as `fathom tokenize` on mixed text, that it decodes them back, and that it
exposes what llama.cpp's converter reads (`model._mergeable_ranks`,
`special_tokens`, `eos_id`). Needs `tiktoken` and `transformers`.
"""

import json
import os
import subprocess
import sys
import tempfile

from transformers import AutoTokenizer

BIN = os.environ.get("FATHOM_BIN", "fathom")
TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "Hello\n\nworld  ",
    "你好，世界！漢字",
    "def add(a, b):\n    return a + b\n",
    "a <|open|> b",
    "It's 3.14159 — naïve café, ÄÖÜ ÉCOLE don't WE'LL\t\ttabs\r\n",
    "🚀 emoji 😶\u200d🌫️ and 1234567 numbers",
]


def fathom_ids(model: str, text: str) -> list:
    out = subprocess.run(
        [BIN, "tokenize", "--model", model, "--json", text],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return json.loads(out.stdout)["ids"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "synth")
        subprocess.run(
            [BIN, "synth", "--preset", "tiny", "--vocab", "4352", "--out", model],
            check=True,
            capture_output=True,
            timeout=300,
        )
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
        failures = 0
        for text in TEXTS:
            want = fathom_ids(model, text)
            got = tok.encode(text)
            back = tok.decode(got)
            ok = got == want and back == text
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {text!r}: {got}" + ("" if ok else f" want {want}, decoded {back!r}"))
        cfg = json.load(open(os.path.join(model, "tokenizer_config.json")))
        eos = next(int(i) for i, t in cfg["added_tokens_decoder"].items() if t["content"] == "[EOS]")
        ranks = len(tok.model._mergeable_ranks)
        facts_ok = (
            tok.eos_id == eos
            and ranks + 256 == len(tok)
            and tok.special_tokens["<|end_of_msg|>"] == ranks + 2
        )
        failures += not facts_ok
        print(f"{'ok  ' if facts_ok else 'FAIL'} ranks {ranks}, eos {tok.eos_id} (config {eos}), vocab {len(tok)}")
    print(f"synth tokenizer module: {len(TEXTS) + 1 - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
