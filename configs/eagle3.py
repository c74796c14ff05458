r"""EAGLE-3 head for stories260K (self-distilled corpus, the same as configs/eagle.py's; features computed online).

python train_heads.py --config=configs/eagle3.py --workdir=checkpoints/eagle3_stories260K
python train_heads.py --config=configs/eagle3.py:smoke --workdir=/tmp/eagle3_smoke   # seconds
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("eagle3")
    # The paper's rule (outputs of layers 1, L/2 - 1, L - 4) names layer 1 three times for stories260K's five
    # layers; the low, middle and last layers keep its spread.
    c.heads.layers = (0, 2, 4)
    c.heads.draft_vocab = 0  # stories260K's 512 tokens; 128/256/512 are compared in bench_heads
    c.heads.unroll = 4  # the paper unrolls 7; 4 keeps a run within 20 minutes on 2 cores
    c.heads.step_weight = 0.8
    c.optimizer.lr = 3e-3
    return variant(c, name)
