"""kvbridge's experiments on real pretrained models: the text corpus they read
(:mod:`~kvbridge.experiments.corpus`), the evaluation of a model pair
(:mod:`~kvbridge.experiments.real_eval`, ``kvbridge eval --source S --target T``) and the demo
(:mod:`~kvbridge.experiments.real_demo`, ``scripts/demo.sh``).

The library never imports this package; it builds on the library only.
"""
