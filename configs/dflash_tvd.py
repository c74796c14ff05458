r"""DFlash block draft for sampled decoding of stories260K: configs/dflash.py's head fine-tuned on the TVD objective.

At T = 1 a block position drawn from q is accepted with probability sum_x min(p(x), q(x)), where p is the target's
distribution after the intermediate tokens, which the block does not see. Over their draws the forward KL is
minimised by the mean of the p's, and acceptance is maximised by a quantile of them: the TVD objective's optimum
(`experiments.dflash_bound.acceptance_optimum`: tau 3.61 against the mean's 3.16 on dflash_bound's T = 1 contexts).
TVD from random weights trains worse (the distilled drafts' table), so this run starts from the forward-KL head, with
a fresh optimiser, on 4x its documents.

python train_heads.py --config=configs/dflash.py --workdir=checkpoints/dflash_stories260K   # first, then export it
python train_heads.py --config=configs/dflash_tvd.py --workdir=checkpoints/dflash_tvd_stories260K
python run_decode.py --drafter=dflash --heads=heads/stories260K_dflash_tvd --k=7 --temperature=1
"""

import runpy
from pathlib import Path

from specjax.training.config import variant


def get_config(name: str = ""):
    c = runpy.run_path(str(Path(__file__).with_name("dflash.py")))["get_config"]()
    c.train.init_from = "heads/stories260K_dflash"
    c.heads.divergence = "tvd"
    c.data.num_samples = 32768
    c.data.cache = "checkpoints/stories260K_corpus32k.npy"
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 50
    c.train.steps = 2000
    return variant(c, name)
