r"""A distilled draft model for stories260K (DistillSpec): two layers initialised from the target's first and
last, trained to match the target's next-token distribution (forward KL) on the target's own samples.

python train_heads.py --config=configs/draft.py --workdir=checkpoints/distill_stories260K
python train_heads.py --config=configs/draft.py:smoke --workdir=/tmp/draft_smoke   # seconds
python -c "from specjax.drafters import distill; distill.export_model('checkpoints/distill_stories260K', \
    'heads/stories260K_distill', 'checkpoints/stories260K')"
python run_decode.py --drafter=draft_model --draft_model=heads/stories260K_distill
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("distill")
    c.heads.n_layers = 2
    c.heads.init = "layers:0,4"
    c.heads.divergence = "forward_kl"
    # on-policy rows (data.on_policy_fraction) did not raise alpha here: the target's own samples are already
    # the text a draft meets when decoding (experiments/distill_table.py)
    c.data.on_policy_fraction = 0.0
    c.data.heldout = 64
    c.optimizer.lr = 3e-3
    c.train.steps = 1000  # about 5 minutes on 2 busy cores
    c.train.batch_size = 16
    c = variant(c, name)
    if name == "smoke":
        c.data.heldout = 8
    return c
