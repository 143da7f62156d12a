#!/usr/bin/env python3
"""Dev tool: writes parity.json, the reference ids for fathom-tokenizer's tests.

Needs `pip install tiktoken tokenizers`. CI does not run this; it only reads the JSON.

- `tiktoken` cases: Python tiktoken (the reference engine Kimi's tokenizer wraps) built
  from k3-code-small/tiktoken.model with the Kimi pattern, and the input pre-splitting
  of tokenization_kimi.py (400,000-char slices, 25,000-char same-class runs).
- `hf` cases: Python `tokenizers` on hf-tiny/tokenizer.json.

Run from anywhere: python3 make_parity.py
"""
import base64
import json
import os

import tiktoken
import tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

MAX_SLICE = 400_000
MAX_RUN = 25_000


def split_runs(s, max_run):
    """Same-class run splitting as in tokenization_kimi.py (str.isspace classes)."""
    run_len = 0
    run_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if sp != run_space:
            run_len = 1
            run_space = sp
        else:
            run_len += 1
            if run_len > max_run:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


def kimi_encode(enc, text):
    ids = []
    for i in range(0, len(text), MAX_SLICE):
        for part in split_runs(text[i:i + MAX_SLICE], MAX_RUN):
            ids.extend(enc.encode_ordinary(part))
    return ids


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


CASES = [
    ("py_def", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"),
    ("py_class", "class Config:\n    \"\"\"Holds settings.\"\"\"\n\n    def __init__(self, path: str = './cfg.toml') -> None:\n        self.path = path\n"),
    ("py_imports", "import os\nimport sys\nfrom typing import List, Dict\n\n"),
    ("py_fstring", "print(f\"{name!r:>10} = {value:.3f}\")  # comment\n"),
    ("py_lambda", "xs = sorted(items, key=lambda kv: (-kv[1], kv[0]))[:10]"),
    ("rust_fn", "pub fn encode(&self, text: &str) -> Vec<u32> {\n    let mut out = Vec::new();\n    out\n}\n"),
    ("rust_impl", "impl<'a, T: Clone + Send> Iterator for Iter<'a, T> {\n\ttype Item = &'a T;\n}\n"),
    ("rust_macro", "#[derive(Debug, Clone)]\nmacro_rules! m { ($x:expr) => { $x * 2 }; }"),
    ("json", "{\"name\": \"fathom\", \"ids\": [1, 22, 333, 4444], \"ok\": true, \"x\": null}"),
    ("english", "The capital of France is Paris. It's a city of about 2.1 million people."),
    ("english_hello", "Hello, world!"),
    ("english_ws", "Hello\n\nworld  "),
    ("contractions", "it's they're we've I'm you'll he'd don't"),
    ("contractions_upper", "IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T It'S tHEY'Re"),
    ("contractions_odd", "'s 'T 're 'VE x's X'S"),
    ("han", "你好，世界！漢字"),
    ("han_mixed", "中文English混合abc中文123测试"),
    ("han_long", "深度学习模型的推理引擎需要高效地处理专家混合层。"),
    ("japanese", "日本語のテキストです。カタカナとひらがな、そして漢字。"),
    ("korean", "안녕하세요, 세계! 한국어 텍스트입니다."),
    ("arabic", "مرحبا بالعالم! هذا نص عربي."),
    ("hindi", "नमस्ते दुनिया! यह हिंदी पाठ है।"),
    ("cyrillic", "Привет, мир! Это русский текст. ЁЖИК в тумане."),
    ("greek", "Γειά σου Κόσμε! Αυτό είναι ελληνικό κείμενο."),
    ("thai", "สวัสดีชาวโลก ภาษาไทย"),
    ("emoji", "I ❤️ Rust 🦀🔥👍🏽"),
    ("emoji_zwj", "Family: 👨‍👩‍👧‍👦, flag: 🏳️‍🌈, pirate 🏴‍☠️"),
    ("emoji_only", "😀😃😄😁😆😅😂🤣"),
    ("spaces", "a  b   c    d     e"),
    ("spaces_trailing", "word     "),
    ("spaces_leading", "     word"),
    ("spaces_only", "        "),
    ("tabs", "\tindented\n\t\tdouble\t tab-space \t"),
    ("crlf", "line1\r\nline2\r\n\r\nline3\r\n"),
    ("mixed_newlines", "a\n \n  \n\tb\r \n"),
    ("newlines_only", "\n\n\n"),
    ("info_separators", "a\x1cb\x1dc\x1ed\x1fe \x1c\x1d x"),
    ("line_separator", "first\u2028second\u2029third"),
    ("nbsp", "100\u00a0km and\u00a0\u00a0more\u202fnarrow"),
    ("ideographic_space", "全角\u3000スペース"),
    ("digits", "1234567890"),
    ("digits_long", "3.14159265358979323846264338327950288419716939937510"),
    ("digits_mixed", "v1.2.3-rc4 at 12:34:56 on 2026-12-02, x=1e-10"),
    ("arabic_indic_digits", "٠١٢٣٤٥٦٧٨٩ and ١٢٣"),
    ("punct_run", "!!!??? ... --- === ***///\\\\"),
    ("punct_newline", "end.\n\n}\n)\r\n"),
    ("special_like", "a <|open|> b"),
    ("special_like_all", "<|open|>message role=\"user\"<|sep|>x<|close|>message<|sep|><|end_of_msg|>"),
    ("brackets", "[BOS] [EOS] [UNK] [PAD] <|reserved_token_8300|>"),
    ("html", "<div class=\"a&amp;b\">x &lt; y</div>"),
    ("url", "https://example.com/path?q=1&r=%20#frag"),
    ("markdown", "# Title\n\n- item *bold* `code`\n\n```rust\nfn main() {}\n```\n"),
    ("accents", "café naïve résumé Ångström"),
    ("combining", "e\u0301 a\u0300 n\u0303 base\u0308"),
    ("math", "∑ᵢ xᵢ² ≤ ∞, α+β=γ, √2 ≈ 1.414"),
    ("titlecase", "ǅemal ǈubljana ǋ"),
    ("control", "a\x00b\x07c\x1bd\x7f"),
    ("single_char", "x"),
    ("empty", ""),
    ("lone_space", " "),
    ("mixed_everything", "Mix: English, 中文, русский, 日本語, 한국어, العربية, हिन्दी 🌍 123456!\n"),
    ("long_word", "supercalifragilisticexpialidocious" * 5),
    ("repeat_letters", "a" * 300),
    ("repeat_dashes", "-" * 300),
    ("run_split_spaces", {"repeat": " ", "count": 25_010, "prefix": "x", "suffix": "y"}),
    ("run_split_letters", {"repeat": "ab", "count": 12_600, "prefix": "", "suffix": " end"}),
]


def expand(spec):
    if isinstance(spec, str):
        return spec
    return spec["prefix"] + spec["repeat"] * spec["count"] + spec["suffix"]


def main():
    ranks = load_ranks(os.path.join(HERE, "k3-code-small", "tiktoken.model"))
    enc = tiktoken.Encoding("k3-code-small", pat_str=KIMI_PATTERN,
                            mergeable_ranks=ranks, special_tokens={})
    hf = tokenizers.Tokenizer.from_file(os.path.join(HERE, "hf-tiny", "tokenizer.json"))
    out = {"tiktoken": [], "hf": []}
    for name, spec in CASES:
        text = expand(spec)
        entry = {"name": name, "ids": kimi_encode(enc, text)}
        if isinstance(spec, str):
            entry["text"] = text
        else:
            entry["spec"] = spec
        out["tiktoken"].append(entry)
        if isinstance(spec, str):
            hf_ids = hf.encode(text, add_special_tokens=False).ids
            out["hf"].append({"name": name, "text": text, "ids": hf_ids,
                              "decoded": hf.decode(hf_ids, skip_special_tokens=False)})
    with open(os.path.join(HERE, "parity.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(out['tiktoken'])} tiktoken and {len(out['hf'])} hf cases")


if __name__ == "__main__":
    main()
