r"""A distilled draft model for stories260K (DistillSpec): two layers initialised from the target's first and
last, trained to match the target's next-token distribution on its own samples and on the draft's.

python train_heads.py --config=configs/draft.py --workdir=checkpoints/draft_stories260K
python train_heads.py --config=configs/draft.py:smoke --workdir=/tmp/draft_smoke   # seconds
python -c "from specjax.drafters import distill; distill.export_model('checkpoints/draft_stories260K', \
    'heads/stories260K_draft', 'checkpoints/stories260K')"
python run_decode.py --drafter=draft_model --draft_model=heads/stories260K_draft
"""

from specjax.training.config import base_config, variant


def get_config(name: str = ""):
    c = base_config("distill")
    c.heads.n_layers = 2
    c.heads.init = "layers:0,4"
    c.heads.divergence = "forward_kl"
    c.data.on_policy_fraction = 0.5
    c.data.heldout = 64
    c.optimizer.lr = 3e-3
    c = variant(c, name)
    if name == "smoke":
        c.data.heldout = 8
    return c
