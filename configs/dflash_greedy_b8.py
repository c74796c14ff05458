r"""DFlash block draft of B = 8 for greedy decoding of stories260K: configs/dflash_greedy.py's head fine-tuned on
blocks of 8, as configs/dflash_tvd_b8.py does for sampling. Masks attend to each other, so a head drafts best with
the block it was trained on, and a pass of 8 costs about 0.6 of a pass of 16 on the memory-bound target.

python train_heads.py --config=configs/dflash_greedy.py --workdir=checkpoints/dflash_greedy_stories260K  # first
python train_heads.py --config=configs/dflash_greedy_b8.py --workdir=checkpoints/dflash_greedy_b8_stories260K
python run_decode.py --drafter=dflash --heads=heads/stories260K_dflash_greedy_b8 --k=7
"""

import runpy
from pathlib import Path

from specjax.training.config import variant


def get_config(name: str = ""):
    c = runpy.run_path(str(Path(__file__).with_name("dflash_greedy.py")))["get_config"]()
    c.train.init_from = "heads/stories260K_dflash_greedy"
    c.heads.block_size = 8
    c.heads.blocks = 64  # as many drafted positions a sequence as configs/dflash.py's 32 blocks of 16
    c.optimizer.lr = 3e-3  # a fine-tune: configs/dflash_tvd.py's rate and warmup
    c.optimizer.warmup_steps = 50
    c.train.steps = 1000
    return variant(c, name)
