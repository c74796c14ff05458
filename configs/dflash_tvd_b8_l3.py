r"""DFlash block draft of B = 8 and three layers for sampled decoding of stories260K: configs/dflash_tvd_b8.py's head
deepened by a third layer that starts silent (`trainer.deepened`: it drafts what the two-layer head drafts), then
trained on the TVD objective with the rest.

python train_heads.py --config=configs/dflash_tvd_b8.py --workdir=checkpoints/dflash_tvd_b8_stories260K   # first
python train_heads.py --config=configs/dflash_tvd_b8_l3.py --workdir=checkpoints/dflash_tvd_b8_l3_stories260K
python run_decode.py --drafter=dflash --heads=heads/stories260K_dflash_tvd_b8_l3 --k=7 --temperature=1
"""

import runpy
from pathlib import Path

from specjax.training.config import variant


def get_config(name: str = ""):
    c = runpy.run_path(str(Path(__file__).with_name("dflash_tvd_b8.py")))["get_config"]()
    c.train.init_from = "heads/stories260K_dflash_tvd_b8"
    c.heads.n_layers = 3
    c.train.steps = 1000
    return variant(c, name)
