"""The EAGLE-3 head's training features for the Qwen2.5-Coder 1.5B (issue 52): draftwise/training/eagle_data.py.

    .venv/bin/python benchmarks/eagle_data.py --out out/eagle-data            # the recipe's step
    .venv/bin/python benchmarks/eagle_data.py --count --out out/eagle-data    # ShareGPT's turns and tokens, no model run

Run it through benchmarks/eagle_data_recipe.sh (niced, in the background, with a PID file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The recipe runs this file from the committed tree it exports (out/eagle-data-src), whose draftwise/ must be the one
# imported, not the shared working tree's that the editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftwise.training.eagle_data import run  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto", help="the target's format: auto = the GGUF's blocks, as it serves")
    p.add_argument("--out", default="out/eagle-data", help="directory of feature shards (git-ignored: ~12 KB a token)")
    p.add_argument("--answers", default="data/answers/qwen2.5-coder-1.5b", help="the target's answer chunks")
    p.add_argument("--skip-shards", default="out/eagle-own",
                   help="comma-separated shard directories whose sequences are not fed again (default: the own-answers "
                   "run's, which captures its features while it decodes)")
    p.add_argument("--budget", type=int, default=600_000, help="answer tokens in the shards at which ShareGPT stops")
    p.add_argument("--max-prompt", type=int, default=512, help="ShareGPT: prompt tokens at most (older turns dropped)")
    p.add_argument("--max-len", type=int, default=1024, help="ShareGPT: prompt + answer tokens at most")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="fed tokens a shard (what a kill can lose)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="fed tokens a prefill forward")
    p.add_argument("--count", action="store_true", help="count ShareGPT's usable turns and tokens (tokenizer only)")
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
