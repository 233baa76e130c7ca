"""Policy snapshots for the experiments that need no training of their own: at init, after the supervised warm
start, and after RL from it (mid and late), each a local Hugging Face checkpoint directory.

    python experiments/snapshots.py            # runs/snapshots/<setting>/{init,warm,mid,late}
    python experiments/snapshots.py --quick    # a tiny setting, seconds
    python experiments/snapshots.py --quick --snapshots-dir /tmp/s   # under /tmp/s instead (the tests)

``snapshots(setting, cache)`` returns ``{"init": dir, "warm": dir, "mid": dir, "late": dir}`` and builds what is
missing (cached under ``cache``, by default ``runs/snapshots``; delete it to rebuild). RL is ``train.py --estimator
otb`` from the warm start; "mid" and "late" are its checkpoints after ``rl_steps // 2`` and ``rl_steps`` steps,
converted with DCP's ``dcp_to_torch_save`` and written next to the warm start's config and tokenizer. The code is
``common/snapshots.py`` (gradient_variance and proxy_fidelity read it from there); this is its command line.
"""

from __future__ import annotations

import argparse

from common.snapshots import SETTINGS, add_snapshots_dir, snapshots

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", default="copy16", choices=sorted(SETTINGS))
    parser.add_argument("--quick", action="store_true", help="the tiny setting")
    add_snapshots_dir(parser)
    args = parser.parse_args()
    for key, path in snapshots("quick" if args.quick else args.setting, args.snapshots_dir).items():
        print(key, path)
