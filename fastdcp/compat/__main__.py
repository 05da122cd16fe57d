"""``python -m fastdcp.compat``: the torch internals fastdcp relies on, and what this torch has.

Exit status 0 when every required internal resolves, 1 otherwise (the missing ones are listed)."""

from __future__ import annotations

import sys

import torch

from .torch_internals import CHECKED_ON, INTERNALS, missing_internals


def main() -> int:
    missing = dict((i.qualified, why) for i, why in missing_internals())
    print(f"torch {torch.__version__}; fastdcp checked on {', '.join(CHECKED_ON)}")
    width = max(len(i.qualified) for i in INTERNALS)
    for internal in INTERNALS:
        why = missing.get(internal.qualified)
        state = "ok" if why is None else ("MISSING" if internal.required else "absent (optional)")
        print(f"{state:18} {internal.qualified:{width}}  {internal.used_by}: {internal.used_for}")
        if why is not None:
            print(f"{'':18} {why}")
    return 1 if any(i.required and i.qualified in missing for i in INTERNALS) else 0


if __name__ == "__main__":
    sys.exit(main())
