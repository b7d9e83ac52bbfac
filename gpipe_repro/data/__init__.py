"""Data for the paper's experiments: translation corpora, tokenizers, batching (and images elsewhere).

Nothing heavy is imported here: import the submodule you need (`gpipe_repro.data.translation`, ...).
"""
