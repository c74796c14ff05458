"""specjax: speculative decoding of Llama-family models in JAX/Flax.

Shape legend. Array names may end in their shape, one capital letter per axis, each letter with one meaning
everywhere in the package:

    B  batch rows                       K  draft tokens of a chain
    P  prompt width (padded)            N  tree nodes (the root excluded unless N + 1 is written)
    T  new tokens in one model pass     D  draft depth (nodes on one root-to-leaf path)
    S  cache slots / sequence buffer    V  vocabulary
    W  attention window of a pass       H  hidden width (the residual stream, a feature)
    R  rows of a data set               X  candidates of a search (e.g. n-gram matches)

e.g. `logits_BTV`, `mask_BTW`, `feats_BDH`.
"""
