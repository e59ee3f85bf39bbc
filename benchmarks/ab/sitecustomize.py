"""Before/after runs across commits (benchmarks/costs_ab.py): with this folder on PYTHONPATH and HSD_ROOT set
to another checkout (a `git worktree` of the commit before), the editable install's packages (hetero_sd and
the three it maps into its namespace) are imported from that checkout instead. Nothing else changes: the
same venv, the same torch; each checkout builds its own kernels (their cache is keyed by the source)."""

import os

root = os.environ.get("HSD_ROOT")
if root:
    import glob
    import importlib
    import sys

    for path in sys.path:
        for finder in glob.glob(os.path.join(path, "__editable___hetero_sd_*_finder.py")):
            module = importlib.import_module(os.path.basename(finder)[:-3])
            here = os.path.dirname(module.MAPPING["hetero_sd"])
            for name, where in module.MAPPING.items():
                module.MAPPING[name] = where.replace(here, root, 1)
