"""draftwise's drafters inside vLLM (`draftwise.integrations.vllm_proposer`): acceptance against draftwise's own.

How: draftwise/bench/peers/plugin.py. vLLM is installed into `.peers/vllm` on first use. Writes JSON:

    .venv/bin/python benchmarks/vllm_plugin.py --json benchmarks/results/vllm-plugin.json
"""

from __future__ import annotations

import argparse
import json

from draftwise.atomic import write_json
from draftwise.bench.peers import PEERS
from draftwise.bench.peers.install import setup_vllm
from draftwise.bench.peers.plugin import compare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    log = PEERS / "logs" / "vllm-plugin.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    setup_vllm(log)
    report = compare(args.max_new_tokens, args.gamma, args.num_prompts)
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
