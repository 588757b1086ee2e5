"""Named tiktoken encodings (`tokenizer.encoding`) go through tiktoken's own registry, loader and cache. The
encodings tiktoken ships are downloaded from the internet, which tests cannot reach; so a plugin encoding (tiktoken's
`tiktoken_ext` namespace) is served by an HTTP server on 127.0.0.1: first run downloads into TIKTOKEN_CACHE_DIR,
a later run with the server gone reads the cache, and with an empty cache the error says how to fetch it."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from maester.config import TokenizerConfig
from tests.helpers import clean_env

PLUGIN = '''
from tiktoken.load import load_tiktoken_bpe

URL, SHA = {url!r}, {sha!r}

def tiny():
    return {{"name": "maester_tiny", "pat_str": r"""\\S+|\\s+""", "mergeable_ranks": load_tiktoken_bpe(URL, SHA),
            "special_tokens": {{"<|endoftext|>": 258, "<|fim|>": 259}}}}

ENCODING_CONSTRUCTORS = {{"maester_tiny": tiny}}
'''

LOAD = """
import json, sys
from maester.config import TokenizerConfig
from maester.data.tokenizers import build_tokenizer
try:
    tok = build_tokenizer(TokenizerConfig(kind="tiktoken", encoding=sys.argv[1]))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"ids": tok.encode("ab ab"), "eos": tok.eos_id, "vocab": tok.vocab_size,
                      "specials": tok.special_tokens(), "text": tok.decode(tok.encode("ab ab"))}))
"""


def rank_file() -> bytes:
    ranks = [bytes([b]) for b in range(256)] + [b"ab", b" ab"]
    return b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks))


class Served:
    def __init__(self, body: bytes):
        handler = type("H", (http.server.BaseHTTPRequestHandler,), {
            "do_GET": lambda h: (h.send_response(200), h.send_header("Content-Length", str(len(body))),
                                 h.end_headers(), h.wfile.write(body)),
            "log_message": lambda h, *a: None})
        self.server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/tiny.tiktoken"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def load(name: str, plugin_root: Path, cache: Path) -> dict:
    env = clean_env(PYTHONPATH=str(plugin_root), TIKTOKEN_CACHE_DIR=str(cache),
                    HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="", NO_PROXY="127.0.0.1")
    out = subprocess.run([sys.executable, "-c", LOAD, name], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_named_encoding_downloads_once_then_loads_from_the_cache(tmp_path):
    body = rank_file()
    server = Served(body)
    root = tmp_path / "plugins"
    (root / "tiktoken_ext").mkdir(parents=True)
    (root / "tiktoken_ext" / "maester_tiny.py").write_text(
        PLUGIN.format(url=server.url, sha=hashlib.sha256(body).hexdigest()))
    cache = tmp_path / "cache"
    try:
        first = load("maester_tiny", root, cache)
    finally:
        server.stop()
    # the merge, split by the plugin's pattern (cl100k's would give " ab" its own rank, 257)
    assert first["ids"] == [256, 32, 256] and first["text"] == "ab ab"
    assert first["eos"] == 258 and first["vocab"] == 260
    assert first["specials"] == {"<|endoftext|>": 258, "<|fim|>": 259}
    assert len(list(cache.iterdir())) == 1  # tiktoken's cache holds the download
    assert load("maester_tiny", root, cache) == first  # the server is gone: read from the cache

    offline = load("maester_tiny", root, tmp_path / "empty")
    assert "not in tiktoken's cache" in offline["error"] and "TIKTOKEN_CACHE_DIR" in offline["error"]
    assert "get_encoding('maester_tiny')" in offline["error"]


def test_a_shipped_encoding_offline_says_how_to_fetch_it(tmp_path):
    got = load("cl100k_base", tmp_path, tmp_path / "empty")
    assert got["error"].startswith("tokenizer.encoding = 'cl100k_base': not in tiktoken's cache")


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    got = load("cl100k", tmp_path, tmp_path / "empty")
    assert "is not a tiktoken encoding" in got["error"] and "cl100k_base" in got["error"]
    assert "o200k_base" in got["error"] and "gpt2" in got["error"]


@pytest.mark.parametrize("fields,problem", [
    ({"kind": "hf", "encoding": "gpt2", "path": "x"}, "tokenizer.encoding is only used when tokenizer.kind = "
                                                      "'tiktoken'"),
    ({"kind": "tiktoken", "encoding": "gpt2", "path": "x.tiktoken"}, "tokenizer.path must not be set with"),
    ({"kind": "tiktoken", "encoding": "gpt2", "special_tokens": {"<x>": 5}}, "tokenizer.special_tokens must not"),
    ({"kind": "tiktoken"}, "tokenizer.path is required .* \\(or tokenizer.encoding"),
])
def test_config_checks(fields, problem):
    with pytest.raises(ValueError, match=problem):
        TokenizerConfig(**fields)


def test_the_data_tools_name_an_encoding_as_tiktoken_name():
    from maester.tools.data_tokenize import tokenizer_config

    assert tokenizer_config("tiktoken:o200k_base") == TokenizerConfig(kind="tiktoken", encoding="o200k_base")
    with pytest.raises(ValueError, match="own special tokens"):
        tokenizer_config("tiktoken:o200k_base", special_tokens={"<x>": 1}, eos_token="<x>")
