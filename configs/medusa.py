r"""Medusa heads for stories260K (self-distilled corpus, features computed online by the frozen target).

python train_heads.py --config=configs/medusa.py --workdir=checkpoints/medusa_stories260K
python train_heads.py --config=configs/medusa.py:smoke --workdir=/tmp/medusa_smoke   # seconds
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("medusa")
    c.heads.num_heads = 4
    c.heads.num_layers = 1
    c.heads.decay = 0.8
    c.optimizer.lr = 1e-3
    return variant(c, name)
