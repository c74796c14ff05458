r"""Parallel EAGLE-3 head (P-EAGLE / PARD style) for stories260K: one head pass drafts a chain of K tokens.

python train_heads.py --config=configs/eagle3_parallel.py --workdir=checkpoints/eagle3_parallel_stories260K
python train_heads.py --config=configs/eagle3_parallel.py:smoke --workdir=/tmp/eagle3_parallel_smoke   # seconds
python run_decode.py --drafter=eagle3 --heads=checkpoints/eagle3_parallel_stories260K --k=4
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("eagle3")
    c.heads.layers = (0, 2, 4)  # as configs/eagle3.py: stories260K's low, middle and last layers
    c.heads.draft_vocab = 0  # stories260K's 512 tokens
    c.heads.parallel = True  # depths 2..K read learned MASK slots: one head pass per round
    c.heads.unroll = 4  # K trained: the pending token's slot and 3 MASK slots (decode with --k <= 4)
    c.heads.step_weight = 0.8
    c.optimizer.lr = 3e-3
    return variant(c, name)
