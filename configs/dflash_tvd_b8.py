r"""DFlash block draft of B = 8 for sampled decoding of stories260K: configs/dflash_tvd.py's head fine-tuned on blocks
of 8 (the block it drafts: masks attend to each other, so a head drafts best with the block it was trained on).

python train_heads.py --config=configs/dflash_tvd.py --workdir=checkpoints/dflash_tvd_stories260K   # first, exported
python train_heads.py --config=configs/dflash_tvd_b8.py --workdir=checkpoints/dflash_tvd_b8_stories260K
python run_decode.py --drafter=dflash --heads=heads/stories260K_dflash_tvd_b8 --k=7 --temperature=1
"""

import runpy
from pathlib import Path

from specjax.training.config import variant


def get_config(name: str = ""):
    c = runpy.run_path(str(Path(__file__).with_name("dflash_tvd.py")))["get_config"]()
    c.train.init_from = "heads/stories260K_dflash_tvd"
    c.heads.block_size = 8
    c.heads.decay = 4.0  # the paper's weight for B = 8
    c.heads.blocks = 64  # as many drafted positions a sequence as configs/dflash.py's 32 blocks of 16
    c.train.steps = 1000
    return variant(c, name)
