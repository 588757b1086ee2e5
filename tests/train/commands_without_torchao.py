"""Run maester commands one after another in this fresh process, which never imports torchao, and fail if one of
them imports it or fails: checkpoints of float8 runs must be readable without the library that trained them.

    python tests/train/commands_without_torchao.py '[["convert", "to-hf", "CKPT", "OUT"], ["generate", ...]]'
"""

from __future__ import annotations

import json
import sys

from maester.cli import main

if __name__ == "__main__":
    assert "torchao" not in sys.modules
    for command in json.loads(sys.argv[1]):
        try:
            main(command)
        except SystemExit as e:
            if e.code:
                sys.exit(f"maester {' '.join(command)} exited with {e.code}")
        assert "torchao" not in sys.modules, f"maester {' '.join(command)} imported torchao"
        print(f"ok: maester {' '.join(command)}", flush=True)
