"""Regenerate tests/data/qwen_tokenizer_samples.json: texts and the ids the Qwen2.5 GGUF's own tokenizer gives them.

The reference is the tokenizer embedded in the Qwen2.5-Coder GGUF (vocabulary and merges as Qwen ships them), loaded
two ways that must agree: our ``gguf_tokenizer`` and transformers' GGUF loader. Tests then check that
``qwen_tokenizer()``, built from tiktoken ranks alone, reproduces these ids without the GGUF.

Texts: BFCL prompts as ``bfcl_prompt`` formats them (plus a rendered call), and hand-picked tricky strings. All are
NFC (the tokenizer normalizes to NFC, so other texts would not round-trip) and avoid Qwen3-only special tokens
(``<think>``, ``<tool_response>``: ids 151665..151668 are padding in the Qwen2.5 GGUF).

    python scripts/make_tokenizer_samples.py [path/to/qwen2.5-coder-0.5b.gguf]
"""

from __future__ import annotations

import importlib.resources
import json
import sys
import unicodedata
from pathlib import Path

from pask_jax.experiments.bfcl.prompt import bfcl_prompt, format_tool_call
from pask_jax.models.fetch import cache_dir
from pask_jax.models.tokenizer import gguf_tokenizer

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen_tokenizer_samples.json"

# (category, item index): live_simple 58, live_multiple 6 and live_parallel 3 have a system message; live_simple 13,
# live_multiple 6 and live_parallel 3 have non-ASCII (Chinese, Spanish) questions.
BFCL_ITEMS = [
    ("simple_python", 0),
    ("simple_python", 6),
    ("multiple", 0),
    ("parallel", 0),
    ("parallel_multiple", 0),
    ("live_simple", 0),
    ("live_simple", 13),
    ("live_simple", 58),
    ("live_multiple", 6),
    ("live_parallel", 3),
]

TRICKY = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "empty": "",
    "one_space": " ",
    "one_newline": "\n",
    "edge_spaces": "  leading spaces and trailing   ",
    "whitespace_runs": "a  b   c    d\t\te\n\n\nf\r\ng \n \n\t\t  h   ",
    "crlf": "line one\r\nline two\r\n\r\nline four\r",
    "digits": "0 7 42 2024 123456789 3.14159 -2.5e-10 1,000,000 0x1F 1e9 007",
    "unicode_digits": "٣٤٥ ४५६ ①②③ ½ ²³",
    "contractions": "I'm you'RE it's they'll we'd I've DON'T y'all",
    "accents": "café naïve résumé Ångström Øresund Straße façade",
    "cjk": "你好，世界！我们今天去哪里吃饭？日本語のテキスト、カタカナ。한국어 텍스트입니다.",
    "scripts": "Привет мир, γειά σου κόσμε, مرحبا بالعالم, שלום עולם, नमस्ते दुनिया, ภาษาไทย",
    "emoji": "Emoji: 🤗🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇺🇸🇯🇵 ☃",
    "punctuation": "“smart quotes” — em dash … ellipsis «guillemets» ‘single’ ¿qué? ¡sí!",
    "math": "∑_{i=1}^{n} x_i² ≤ √(π·e) ∞ ≠ ± ∀x∈ℝ: ⌊x⌋ ≤ x",
    "invisible": "non\u00a0breaking\u2009thin\u200bzero\u200dwidth\ufeffbom",
    "control_chars": "nul\x00soh\x01del\x7fbell\x07esc\x1b[0m",
    "repeats": "a" * 120 + " " + "=" * 80 + "\n" + " " * 40 + "x" + "!" * 30,
    "url_path": "https://example.com/a/b?q=1&r=%20#frag C:\\Users\\me\\file.txt ~/.cache/pask-jax",
    "python": 'def f(x: int) -> list[int]:\n    """Doc."""\n    if x > 0:\n\t\treturn [x ** 2, x // 3]\n    return []',
    "json": '{"a": [1, 2.5, -3e4, true, null], "b": {"c": "d\\"e\\\\f", "g": "\\u00e9"}}',
    "json_fence": '```json\n{"name": "math.factorial", "arguments": {"number": 5}}\n```',
    "tool_call": format_tool_call("calculate_triangle_area", {"base": 10, "height": 5, "unit": "units"}),
    "tool_calls_adjacent": "<tool_call>\n{}\n</tool_call><tool_call></tool_call>\n</tool_call><tool_call>",
    "chat_specials": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "fim_specials": "<|endoftext|><|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>  pass<|fim_pad|><|repo_name|>",
    "specials_in_words": "abc<tool_call>def</tool_call>ghi<|im_end|>jkl<|vision_start|><|image_pad|><|vision_end|>",
    "near_specials": "<tool_call <|im_start| <tool_callx> < tool_call> <|IM_START|> </ tool_call>",
}


def bfcl_item(category: str, index: int) -> dict:
    path = importlib.resources.files("bfcl_eval").joinpath(f"data/BFCL_v4_{category}.json")
    return json.loads(path.read_text().splitlines()[index])


def main() -> None:
    gguf = Path(sys.argv[1]) if len(sys.argv) > 1 else cache_dir() / "models" / "qwen2.5-coder-0.5b.gguf"
    texts = dict(TRICKY)
    for category, index in BFCL_ITEMS:
        texts[f"bfcl_{category}_{index}"] = bfcl_prompt(bfcl_item(category, index))
    answer = format_tool_call("calculate_triangle_area", {"base": 10, "height": 5})
    texts["bfcl_with_answer"] = bfcl_prompt(bfcl_item("simple_python", 0)) + answer + "<|im_end|>\n"
    assert all(unicodedata.is_normalized("NFC", t) for t in texts.values())

    ours = gguf_tokenizer(gguf)
    samples = [{"name": name, "text": text, "ids": ours.encode(text)} for name, text in texts.items()]

    from transformers import AutoTokenizer  # the independent reader of the same GGUF

    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    mismatches = [s["name"] for s in samples if theirs.encode(s["text"], add_special_tokens=False) != s["ids"]]
    if mismatches:
        raise SystemExit(f"transformers' GGUF tokenizer disagrees on: {mismatches}")

    lines = ",\n".join(json.dumps(sample, ensure_ascii=False) for sample in samples)
    OUT.write_text(f'{{"gguf": "{gguf.name}", "samples": [\n{lines}\n]}}\n', encoding="utf-8")
    print(f"wrote {len(samples)} samples ({sum(len(s['ids']) for s in samples)} ids) to {OUT}")


if __name__ == "__main__":
    main()
