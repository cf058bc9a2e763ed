r"""The `binary` baseline of the toy ablation: `configs/toy_gagar.py` with mode=binary.

    python scripts/train.py --config=configs/toy_binary.py --workdir=runs/toy_binary
    python scripts/train.py --config=configs/toy_binary.py:smoke --workdir=/tmp/s
"""

import importlib.util
import os


def _toy():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_gagar.py")
    spec = importlib.util.spec_from_file_location("_toy_gagar_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    return _toy().get_config(",".join(w for w in ("binary", arg or "") if w))
