"""Rebuild the demo target and demo conversations shipped in src/eyas/demo_target/assets/.

python scripts/build_demo_assets.py [--steps 1500]
"""

import argparse
import json
import shutil

from eyas.demo_target.build import (
    DEMO_CONVERSATIONS,
    DEMO_TARGET,
    build_demo_target,
    write_demo_conversations,
)

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--steps", type=int, default=1500)
args = p.parse_args()
shutil.rmtree(DEMO_TARGET, ignore_errors=True)
DEMO_TARGET.parent.mkdir(parents=True, exist_ok=True)
facts = build_demo_target(DEMO_TARGET, steps=args.steps)
write_demo_conversations(DEMO_CONVERSATIONS)
(DEMO_TARGET / "TRAINING.json").write_text(json.dumps(facts, indent=2) + "\n")
print(json.dumps(facts, indent=2))
