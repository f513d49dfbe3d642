"""Training the demo checkpoint: the synthetic contract corpus, its tokenizer, the CPU trainer.

``contracts`` and ``questions`` draw contract facts and tied question groups; ``corpus`` makes
decision and generation cases in disjoint splits; ``rows`` turns cases into token rows exactly as
the engine will see them (``worker.decisions`` prompts and infill templates, the chat template);
``tokenizer`` trains the BPE on the corpus; ``trainer`` runs the block-diffusion objective.
"""
