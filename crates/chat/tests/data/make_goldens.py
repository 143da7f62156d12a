#!/usr/bin/env python3
"""Dev tool: renders the test templates with Python jinja2 configured as HF
transformers does, writing jinja_goldens.json for fathom-chat's tests.

Needs `pip install jinja2`. CI only reads the JSON.
"""
import json
import os

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' replacement for jinja2's HTML-escaping tojson
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <b>now</b> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "simple": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hello <|im_start|> & 'bye'  "},
        {"role": "assistant", "content": "Hi.", "reasoning_content": "greet"},
        {"role": "user", "content": "日本語? 🦀"},
    ], "add_generation_prompt": True},
    "tools": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    ], "tools": TOOLS, "add_generation_prompt": True, "enable_thinking": False},
    "no_prompt": {"messages": [
        {"role": "user", "content": "a"}, {"role": "tool", "content": "skip me"},
        {"role": "assistant", "content": "b"},
    ], "add_generation_prompt": False},
}

TEMPLATES = ["chatml_tools.jinja", "blocks.jinja"]


def main():
    env = make_env()
    out = []
    for tname in TEMPLATES:
        with open(os.path.join(HERE, tname), encoding="utf-8") as f:
            tmpl = env.from_string(f.read())
        for cname, ctx in CONVERSATIONS.items():
            full = dict(ctx, bos_token="<s>", eos_token="</s>")
            out.append({"template": tname, "case": cname, "context": ctx,
                        "expected": tmpl.render(**full)})
    # raise_exception: a system message that is not first
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}
    try:
        env.from_string(open(os.path.join(HERE, "chatml_tools.jinja")).read()).render(**bad)
        raise SystemExit("expected an exception")
    except jinja2.exceptions.TemplateError as e:
        out.append({"template": "chatml_tools.jinja", "case": "raises", "context": bad,
                    "error": str(e)})
    with open(os.path.join(HERE, "jinja_goldens.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases")


if __name__ == "__main__":
    main()
