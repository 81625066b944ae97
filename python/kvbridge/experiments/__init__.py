"""kvbridge's experiments: the measurements, demos and test models built on the library.

On the testbed (:mod:`~kvbridge.experiments.testbed`, three small models shipped with the
package): the evaluation of an adapter (:mod:`~kvbridge.experiments.eval`, ``kvbridge eval``)
and across tokenizers (:mod:`~kvbridge.experiments.eval_cross`), end-to-end refinement
(:mod:`~kvbridge.experiments.refine`), the demo (:mod:`~kvbridge.experiments.demo`,
``kvbridge demo``) and vLLM engines serving the testbed models
(:mod:`~kvbridge.experiments.vllm_testbed`). On real pretrained models: the text corpus
(:mod:`~kvbridge.experiments.corpus`), the evaluation of a model pair
(:mod:`~kvbridge.experiments.real_eval`, ``kvbridge eval --source S --target T``) and the demo
(:mod:`~kvbridge.experiments.real_demo`, ``scripts/demo.sh``). What they share is
:mod:`~kvbridge.experiments.common`.

The library never imports this package; it builds on the library only
(tests/python/test_imports.py checks both).
"""
