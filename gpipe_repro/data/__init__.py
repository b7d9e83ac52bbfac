"""Data for the paper's experiments: translation corpora, tokenizers and batching; images in `images.py`
(`load_image_dataset`) and its `image_*.py` modules (dataset and splits, offline sources, hub, batches).

Nothing heavy is imported here: import the submodule you need (`gpipe_repro.data.translation`, ...).
"""
