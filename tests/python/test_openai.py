"""The official `openai` client against `fathom serve`.

    FATHOM_URL=http://127.0.0.1:18080 FATHOM_BIN=target/release/fathom \
    FATHOM_MODEL=path/to/model python tests/python/test_openai.py

Greedy results are compared with `fathom run --json` on the same prompt (each
prompt runs the CLI once). Env: FATHOM_URL (base URL, without /v1),
FATHOM_BIN (the fathom binary), FATHOM_MODEL (model directory), FATHOM_API_KEY
(optional; sent as the bearer token).
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import openai

URL = os.environ.get("FATHOM_URL", "http://127.0.0.1:18080").rstrip("/")
BIN = os.environ.get("FATHOM_BIN", "fathom")
MODEL_DIR = os.environ.get("FATHOM_MODEL", "")
MAX_NEW = 24
CLI_TIMEOUT_S = 300
TEST_TIMEOUT_S = 600

client = openai.OpenAI(
    base_url=URL + "/v1",
    api_key=os.environ.get("FATHOM_API_KEY") or "none",
    timeout=120.0,
    max_retries=0,
)

NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
COMPLETION_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:",
    "Write a Python function that reverses a string.",
    "import os\n",
]

# A long, code-like prompt for the prefix cache test (a few hundred tokens).
LONG_PROMPT = (
    '"""Utilities for a small in-memory key-value store."""\n\n'
    "import threading\n"
    "import time\n\n\n"
    "class Entry:\n"
    "    def __init__(self, value, ttl=None):\n"
    "        self.value = value\n"
    "        self.expires = None if ttl is None else time.monotonic() + ttl\n\n"
    "    def expired(self, now):\n"
    "        return self.expires is not None and now >= self.expires\n\n\n"
    "class Store:\n"
    "    def __init__(self, capacity=1024):\n"
    "        self.capacity = capacity\n"
    "        self.items = {}\n"
    "        self.lock = threading.Lock()\n"
    "        self.hits = 0\n"
    "        self.misses = 0\n\n"
    "    def get(self, key, default=None):\n"
    "        with self.lock:\n"
    "            entry = self.items.get(key)\n"
    "            if entry is None or entry.expired(time.monotonic()):\n"
    "                self.misses += 1\n"
    "                self.items.pop(key, None)\n"
    "                return default\n"
    "            self.hits += 1\n"
    "            return entry.value\n\n"
    "    def put(self, key, value, ttl=None):\n"
    "        with self.lock:\n"
    "            if len(self.items) >= self.capacity and key not in self.items:\n"
    "                self.evict()\n"
    "            self.items[key] = Entry(value, ttl)\n\n"
    "    def delete(self, key):\n"
    "        with self.lock:\n"
    "            return self.items.pop(key, None) is not None\n\n"
    "    def evict(self):\n"
    "        now = time.monotonic()\n"
    "        dead = [k for k, e in self.items.items() if e.expired(now)]\n"
    "        for k in dead:\n"
    "            del self.items[k]\n"
    "        if len(self.items) >= self.capacity:\n"
    "            oldest = next(iter(self.items))\n"
    "            del self.items[oldest]\n\n"
    "    def stats(self):\n"
    "        with self.lock:\n"
    "            total = self.hits + self.misses\n"
    "            rate = self.hits / total if total else 0.0\n"
    "            return {'size': len(self.items), 'hits': self.hits,\n"
    "                    'misses': self.misses, 'hit_rate': rate}\n\n"
    "    def clear(self):\n"
    "        with self.lock:\n"
    "            self.items.clear()\n"
    "            self.hits = 0\n"
    "            self.misses = 0\n\n\n"
    "def test_store():\n"
    "    store = Store(capacity=2)\n"
    "    store.put('a', 1)\n"
    "    store.put('b', 2)\n"
    "    store.put('c', 3)\n"
    "    assert store.get('a') is None\n"
    "    assert store.get('b') == 2\n"
    "    assert store.get('c') == 3\n"
    "    assert store.delete('b')\n"
    "    assert not store.delete('b')\n"
)


class Failure(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failure(what)


def expect_eq(got, want, what):
    if got != want:
        raise Failure(f"{what}: got {got!r}, want {want!r}")


# ---- references from the CLI ----

_refs = {}
_refs_lock = threading.Lock()


def reference(prompt, chat):
    """`fathom run --json` on `prompt`, greedy, MAX_NEW tokens; cached."""
    key = (prompt, chat)
    with _refs_lock:
        if key in _refs:
            return _refs[key]
        cmd = [BIN, "run", "--model", MODEL_DIR]
        if chat:
            cmd += ["--chat", "--no-thinking"]
        cmd += ["--prompt", prompt, "--max-new", str(MAX_NEW), "--json", "--draft", "off"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failure(f"fathom run did not finish within {CLI_TIMEOUT_S} s") from None
        if out.returncode != 0:
            raise Failure(f"fathom run exited {out.returncode}: {out.stderr.strip()[-800:]}")
        lines = [l for l in out.stdout.splitlines() if l.lstrip().startswith("{")]
        if not lines:
            raise Failure(f"fathom run printed no JSON object: {out.stdout[-400:]!r}")
        ref = json.loads(lines[-1])
        for field in ("text", "output_ids", "finish_reason") + (("content",) if chat else ()):
            if field not in ref:
                raise Failure(f"fathom run's JSON has no {field!r}")
        _refs[key] = ref
        return ref


_model_id = None


def model_id():
    global _model_id
    if _model_id is None:
        _model_id = client.models.list().data[0].id
    return _model_id


def chat_once(prompt, **kw):
    args = dict(temperature=0, max_tokens=MAX_NEW, extra_body=NO_THINKING)
    args.update(kw)
    return client.chat.completions.create(
        model=model_id(), messages=[{"role": "user", "content": prompt}], **args
    )


def check_chat(prompt):
    ref = reference(prompt, chat=True)
    resp = chat_once(prompt)
    expect_eq(len(resp.choices), 1, f"{prompt!r}: number of choices")
    choice = resp.choices[0]
    expect_eq(choice.message.content or "", ref["content"], f"{prompt!r}: content")
    expect_eq(choice.finish_reason, ref["finish_reason"], f"{prompt!r}: finish_reason")


# ---- tests (run in the order they are defined) ----


def test_models_list():
    global _model_id
    models = client.models.list().data
    expect_eq(len(models), 1, "number of models")
    expect(bool(models[0].id), "model has an id")
    _model_id = models[0].id


def test_completions():
    for prompt in COMPLETION_PROMPTS:
        ref = reference(prompt, chat=False)
        resp = client.completions.create(
            model=model_id(), prompt=prompt, temperature=0, max_tokens=MAX_NEW
        )
        expect_eq(len(resp.choices), 1, f"{prompt!r}: number of choices")
        expect_eq(resp.choices[0].text, ref["text"], f"{prompt!r}: text")
        expect_eq(resp.choices[0].finish_reason, ref["finish_reason"], f"{prompt!r}: finish_reason")
        expect(resp.usage is not None, f"{prompt!r}: response has usage")
        expect_eq(resp.usage.completion_tokens, len(ref["output_ids"]), f"{prompt!r}: completion_tokens")
        expect(resp.usage.prompt_tokens > 0, f"{prompt!r}: prompt_tokens > 0")


def test_completions_stream():
    for prompt in COMPLETION_PROMPTS:
        ref = reference(prompt, chat=False)
        stream = client.completions.create(
            model=model_id(), prompt=prompt, temperature=0, max_tokens=MAX_NEW,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = list(stream)
        expect(len(chunks) >= 2, f"{prompt!r}: at least two chunks")
        text = "".join(c.choices[0].text or "" for c in chunks if c.choices)
        expect_eq(text, ref["text"], f"{prompt!r}: streamed text")
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        expect_eq(finish, [ref["finish_reason"]], f"{prompt!r}: finish_reason chunks")
        last = chunks[-1]
        expect(last.usage is not None, f"{prompt!r}: last chunk has usage")
        expect_eq(len(last.choices), 0, f"{prompt!r}: usage chunk choices")
        expect_eq(last.usage.completion_tokens, len(ref["output_ids"]), f"{prompt!r}: completion_tokens")


def test_chat():
    for prompt in CHAT_PROMPTS[:2]:
        check_chat(prompt)


def test_chat_stream():
    for prompt in CHAT_PROMPTS[:2]:
        ref = reference(prompt, chat=True)
        stream = chat_once(prompt, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expect_eq(content, ref["content"], f"{prompt!r}: streamed content")
        usage = [c for c in chunks if c.usage is not None]
        expect_eq(len(usage), 1, f"{prompt!r}: number of usage chunks")
        expect(usage[0] is chunks[-1], f"{prompt!r}: usage chunk is the last")
        expect_eq(len(usage[0].choices), 0, f"{prompt!r}: usage chunk choices")
        expect(usage[0].usage.completion_tokens > 0, f"{prompt!r}: completion_tokens > 0")


def readme_example():
    """README's Python example: the one ```python block that makes an OpenAI client."""
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    clients = [b for b in blocks if "OpenAI(" in b]
    expect_eq(len(clients), 1, "README's Python blocks that make an OpenAI client")
    return clients[0]


def test_readme_example():
    code = readme_example()
    # Pointed at this server: its URL, key and model id.
    code, n = re.subn(r'base_url="http://[^"]*"', lambda _: f"base_url={URL + '/v1'!r}", code)
    expect_eq(n, 1, "base_url= in README's example")
    key = os.environ.get("FATHOM_API_KEY") or "none"
    code, n = re.subn(r'api_key="[^"]*"', lambda _: f"api_key={key!r}", code)
    expect_eq(n, 1, "api_key= in README's example")
    code, n = re.subn(r'model="[^"]*"', lambda _: f"model={model_id()!r}", code)
    expect_eq(n, 1, "model= in README's example")
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise Failure(f"README's example did not finish within {CLI_TIMEOUT_S} s") from None
    expect_eq(out.returncode, 0, f"README's example's exit status (stderr: {out.stderr.strip()[-800:]!r})")
    expect(out.stdout.strip() != "", f"README's example printed no reply: {out.stdout!r}")


def test_chat_concurrent():
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(8)]
    for p in CHAT_PROMPTS:
        reference(p, chat=True)  # the CLI first, so the 8 requests overlap
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(check_chat, p) for p in prompts]
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - report every request
                errors.append(f"{type(e).__name__}: {e}")
    expect(not errors, f"{len(errors)} of 8 failed: " + " | ".join(errors))


def test_prefix_cache():
    def once():
        return client.completions.create(
            model=model_id(), prompt=LONG_PROMPT, temperature=0, max_tokens=4
        )

    first = once()
    second = once()
    expect_eq(second.choices[0].text, first.choices[0].text, "text of the repeated prompt")
    expect(first.usage.prompt_tokens >= 200, f"long prompt has {first.usage.prompt_tokens} tokens")
    details = second.usage.prompt_tokens_details
    expect(details is not None, "second response has usage.prompt_tokens_details")
    cached = details.cached_tokens
    expect(cached is not None and cached > 0, f"cached_tokens of the second response: {cached!r}")
    expect(cached <= second.usage.prompt_tokens, "cached_tokens <= prompt_tokens")


def _expect_error(exc, what, fn):
    try:
        fn()
    except exc:
        return
    except openai.APIStatusError as e:
        raise Failure(f"{what}: got {type(e).__name__} ({e.status_code}), want {exc.__name__}") from None
    raise Failure(f"{what}: the request succeeded, want {exc.__name__}")


def test_errors():
    msgs = [{"role": "user", "content": "def f():"}]
    _expect_error(
        openai.BadRequestError, "top_p=2",
        lambda: client.chat.completions.create(model=model_id(), messages=msgs, max_tokens=4, top_p=2),
    )
    _expect_error(
        openai.NotFoundError, "unknown model",
        lambda: client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4),
    )
    _expect_error(
        openai.BadRequestError, "empty messages",
        lambda: client.chat.completions.create(model=model_id(), messages=[], max_tokens=4),
    )


def test_seed():
    prompt = "def fibonacci(n):"
    a = chat_once(prompt, temperature=0.8, seed=7)
    b = chat_once(prompt, temperature=0.8, seed=7)
    expect_eq(b.choices[0].message.content, a.choices[0].message.content, "content with seed 7")
    two = chat_once(prompt, temperature=0.8, n=2)
    expect_eq(len(two.choices), 2, "choices with n=2")
    expect_eq(sorted(c.index for c in two.choices), [0, 1], "choice indexes with n=2")


# ---- runner ----


def run_bounded(fn):
    """Runs fn in a daemon thread; returns an error string, or None on success."""
    result = {}

    def target():
        try:
            fn()
        except Failure as e:
            result["error"] = str(e)
        except openai.APIStatusError as e:
            result["error"] = f"{type(e).__name__} ({e.status_code}): {e.message}"
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=4)
        else:
            result["error"] = None

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(TEST_TIMEOUT_S)
    if t.is_alive():
        return f"did not finish within {TEST_TIMEOUT_S} s"
    return result["error"]


def main():
    if not MODEL_DIR:
        print("FATHOM_MODEL is not set", file=sys.stderr)
        return 2
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    passed = failed = 0
    for name, fn in tests:
        start = time.monotonic()
        error = run_bounded(fn)
        secs = time.monotonic() - start
        if error is None:
            passed += 1
            print(f"ok {name} ({secs:.1f} s)", flush=True)
        else:
            failed += 1
            print(f"FAIL {name}: {error}", flush=True)
    print(f"python: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
