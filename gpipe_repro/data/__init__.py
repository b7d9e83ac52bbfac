"""Data for the paper's experiments: the many-to-English translation corpus in its `corpus_*.py` modules
(layout and manifest, writer, builders, hub policy, readers), tokenizers and batching; images in
`images.py` (`load_image_dataset`) and its `image_*.py` modules (dataset and splits, offline sources,
hub, batches).

Nothing heavy is imported here: import the submodule you need (`gpipe_repro.data.corpus_readers`, ...).
"""
