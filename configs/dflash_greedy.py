r"""DFlash block draft for greedy decoding of stories260K: configs/dflash.py's documents and as many at T = 0.25.

A block head learns each block position's marginal over the intermediate tokens as its corpus draws them, and greedy
verification accepts only the target's greedy path, which cold documents follow far more often (`dflash_bound`).
Cold documents alone drafted worse on the table's free and grounded prompts; mixed with the T = 1 ones (and block
positions weighted by the paper's decay for B = 8), the head drafts better at T = 0. configs/dflash.py's head drafts
for sampling.

python train_heads.py --config=configs/dflash_greedy.py --workdir=checkpoints/dflash_greedy_stories260K
python run_decode.py --drafter=dflash --heads=heads/stories260K_dflash_greedy --k=7
"""

import runpy
from pathlib import Path

from specjax.training.config import variant


def get_config(name: str = ""):
    c = runpy.run_path(str(Path(__file__).with_name("dflash.py")))["get_config"]()
    c.data.mix_temperature = 0.25
    c.data.cache = "checkpoints/stories260K_corpus8k_mix.npy"
    c.heads.decay = 4.0
    return variant(c, name)
