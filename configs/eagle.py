r"""EAGLE head for stories260K (self-distilled corpus, features computed online by the frozen target).

python train_heads.py --config=configs/eagle.py --workdir=checkpoints/eagle_stories260K
python train_heads.py --config=configs/eagle.py:smoke --workdir=/tmp/eagle_smoke   # seconds
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("eagle")
    c.heads.noise = 0.2
    c.heads.ce_weight = 0.1
    c.optimizer.lr = 3e-3
    return variant(c, name)
