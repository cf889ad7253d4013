"""Drafter training: data → hidden-state extraction → block-diffusion training → evaluation.

    python -m ddtree.train train/experiment=toy    # the built-in toy pair (see docs/training.md)
    python -m ddtree.train target.name_or_path=... data.prompts=... out_dir=...

From Python, each stage is a plain function: ddtree.train.data.generate_sequences,
ddtree.train.features.extract_features, ddtree.train.trainer.train_drafter,
ddtree.train.evaluate.evaluate; ddtree.train.pipeline.run chains them.
"""
