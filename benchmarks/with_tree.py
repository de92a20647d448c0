"""Run a script with the Python packages of another checkout (an older commit, say) in place
of this one's editable installs, for before/after numbers in the same session:

    git archive OLD packages/engine/src packages/models/src packages/scheduler/src \\
        | tar -x -C /tmp/old   (and copy each package's generated _version.py beside)
    python benchmarks/with_tree.py /tmp/old benchmarks/profile_loop.py [its arguments]

nano-kvcache (the compiled extension) stays this checkout's.
"""

from __future__ import annotations

import runpy
import sys
from importlib.machinery import PathFinder

PACKAGES = ("engine", "models", "scheduler")


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    tree, script = sys.argv[1], sys.argv[2]
    sys.path[:0] = [f"{tree}/packages/{p}/src" for p in PACKAGES]

    def redirects(finder) -> bool:  # an editable install's finder for one of PACKAGES
        for name in (f"nano_{p}" for p in PACKAGES):
            try:
                spec = finder.find_spec(name, None)
            except Exception:  # (finders that cannot answer for a top-level name)
                continue
            if spec is not None and spec.origin and not spec.origin.startswith(tree):
                return True
        return False

    sys.meta_path[:] = [f for f in sys.meta_path if f is PathFinder or not redirects(f)]
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
