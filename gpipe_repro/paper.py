"""The GPipe paper's numbers, as data.

Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
arXiv 1811.06965 v5 / NeurIPS 2019. Values were read off the paper's tables; where one is derived or
approximate the comment says so. Every results table of this project puts these beside ours, so they
live in the package (users do not have the paper's source files).
"""
from __future__ import annotations

from typing import TypedDict


class Table1Row(TypedDict):
    """One column of Table 1: the largest model that fit, its parameters and memory (GB as printed)."""

    L: int
    params: float
    param_memory_gb: float
    peak_activation_gb: float


class AmoebaNetTable1Row(Table1Row):
    """An AmoebaNet-D (L, D) column of Table 1."""

    D: int


class Table1AmoebaNet(TypedDict):
    """Table 1's AmoebaNet-D half: the setting and a column per row name ("Naive-1", "Pipeline-K")."""

    device_memory_gb: int
    image_size: int
    batch: int
    rows: dict[str, AmoebaNetTable1Row]
    headline: str


class Table1Transformer(TypedDict):
    """Table 1's Transformer-L half: the setting and a column per row name."""

    device_memory_gb: int
    d_model: int
    d_ff: int
    heads: int
    vocab: int
    seq_len: int
    batch: int
    rows: dict[str, Table1Row]
    headline: str


class ImageNetResult(TypedDict):
    """The ImageNet result of v5 Table 4."""

    model: str
    params: float
    top1: float
    top5: float
    partitions: int
    image_size: int


class AmoebaNetRecipe(TypedDict):
    """The reference AmoebaNet training recipe (every value a number but the optimizer's name)."""

    optimizer: str
    rmsprop_decay: float
    momentum: float
    epsilon: float
    lr_per_32_examples: float
    lr_decay: float
    lr_decay_epochs: float
    warmup_epochs: float
    weight_decay: float
    label_smoothing: float
    aux_weight: float
    drop_path_keep_prob: float
    dropout_keep_prob: float
    grad_clip: float
    bn_decay: float
    bn_eps: float


CITATION = "Huang et al., GPipe, arXiv:1811.06965 v5 (NeurIPS 2019)"

# Table 1: maximum model size. Each parameter costs 12 bytes (weight + gradient + RMSProp state).
# AmoebaNet-D (L, D), 8 GB per accelerator, 224x224, mini-batch 128
TABLE1_AMOEBANET: Table1AmoebaNet = {
    "device_memory_gb": 8, "image_size": 224, "batch": 128,
    "rows": {
        "Naive-1": {"L": 18, "D": 208, "params": 82e6,
                    "param_memory_gb": 1.05, "peak_activation_gb": 6.26},
        "Pipeline-1": {"L": 18, "D": 416, "params": 318e6,
                       "param_memory_gb": 3.8, "peak_activation_gb": 3.46},
        "Pipeline-2": {"L": 18, "D": 544, "params": 542e6,
                       "param_memory_gb": 6.45, "peak_activation_gb": 8.11},
        "Pipeline-4": {"L": 36, "D": 544, "params": 1.05e9,
                       "param_memory_gb": 12.53, "peak_activation_gb": 15.21},
        "Pipeline-8": {"L": 72, "D": 512, "params": 1.8e9,
                       "param_memory_gb": 24.62, "peak_activation_gb": 26.24},
    },
    "headline": "25x larger AmoebaNet on 8 accelerators",
}
# Transformer-L, Cloud TPUv3 16 GB per core, d 2048, ff 8192, 32 heads, vocab 32k
TABLE1_TRANSFORMER: Table1Transformer = {
    "device_memory_gb": 16, "d_model": 2048, "d_ff": 8192, "heads": 32, "vocab": 32000,
    "seq_len": 1024, "batch": 32,
    "rows": {
        # The paper's Naive-1 memory cells look swapped (282.2M x 12 B = 3.15 GB), kept as printed.
        "Naive-1": {"L": 3, "params": 282.2e6, "param_memory_gb": 11.7, "peak_activation_gb": 3.15},
        "Pipeline-1": {"L": 13, "params": 785.8e6, "param_memory_gb": 8.8, "peak_activation_gb": 6.4},
        "Pipeline-8": {"L": 103, "params": 5.3e9, "param_memory_gb": 59.5, "peak_activation_gb": 50.9},
        "Pipeline-32": {"L": 415, "params": 21.0e9, "param_memory_gb": 235.1, "peak_activation_gb": 199.9},
        "Pipeline-128": {"L": 1663, "params": 83.9e9, "param_memory_gb": 937.9, "peak_activation_gb": 796.1},
    },
    "headline": "2.7x larger with re-materialization alone on one device, 298x on 128 partitions",
}
BYTES_PER_PARAM = 12

# Table 2: normalized training throughput on TPUs (normalized to K=2, M=1).
# Keys: (K, M). AmoebaNet-D (18, 256); Transformer-48.
TABLE2 = {
    "amoebanet": {(2, 1): 1.0, (4, 1): 1.13, (8, 1): 1.38,
                  (2, 4): 1.07, (4, 4): 1.26, (8, 4): 1.72,
                  (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48},
    "transformer": {(2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3,
                    (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
                    (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3},
}
TABLE2_MODELS = {"amoebanet": "AmoebaNet-D (18, 256)", "transformer": "Transformer-48"}

# Peer: torchgpipe (Kim et al. 2020), 8x P40, AmoebaNet-D (18, 256), same normalization, hand-tuned
# balances and batch sizes (e.g. K=8 M=32 balance [2,2,2,3,3,4,4,4], batch 1280).
TORCHGPIPE_TABLE2_AMOEBANET = {(2, 1): 1.0, (2, 4): 1.539, (2, 32): 1.773,
                               (4, 1): 1.004, (4, 4): 1.666, (4, 32): 2.709,
                               (8, 1): 0.932, (8, 4): 2.621, (8, 32): 4.953}

# Table 3: GPUs without NVLink (PCIe only, P100), M=32, normalized to K=2.
TABLE3 = {
    "amoebanet": {2: 1.0, 4: 1.7, 8: 2.7},     # AmoebaNet-D (18, 128)
    "transformer": {2: 1.0, 4: 1.8, 8: 3.3},   # Transformer-24
}
TABLE3_MODELS = {"amoebanet": "AmoebaNet-D (18, 128)", "transformer": "Transformer-24"}

# Time breakdown (NeurIPS version only; configuration not stated, probably K=2 on TPUs).
TIME_BREAKDOWN = {"computation": 0.656, "re-computation": 0.225, "bubble": 0.041,
                  "load imbalance": 0.032, "setup": 0.029, "optimizer update": 0.017}

# Image classification (v5 Table 4): AmoebaNet-B (18, 512), 557M params, 480x480, 4 partitions.
IMAGENET: ImageNetResult = {"model": "AmoebaNet-B (18, 512)", "params": 557e6, "top1": 84.4,
                            "top5": 97.0, "partitions": 4, "image_size": 480}
TRANSFER = {"cifar10": 99.0, "cifar100": 91.3, "stanford_cars": 94.6, "oxford_pets": 95.9,
            "food101": 93.0, "fgvc_aircraft": 92.7, "birdsnap": 83.6}  # mean of 5 fine-tuning runs
# Reference AmoebaNet recipe (tensorflow/tpu amoeba_net), a starting point NOT confirmed for GPipe.
AMOEBANET_RECIPE: AmoebaNetRecipe = {
    "optimizer": "rmsprop", "rmsprop_decay": 0.9, "momentum": 0.9, "epsilon": 1.0,
    "lr_per_32_examples": 0.015, "lr_decay": 0.97, "lr_decay_epochs": 2.4,
    "warmup_epochs": 3, "weight_decay": 4e-5, "label_smoothing": 0.1,
    "aux_weight": 0.4, "drop_path_keep_prob": 0.7, "dropout_keep_prob": 0.5,
    "grad_clip": 10.0, "bn_decay": 0.9997, "bn_eps": 1e-3}

# Machine translation (v5 section 5): T(L, H, A), d_model 1024, 64 channels per attention head.
TRANSLATION_MODELS = {  # name: (L, H, A, params, partitions, average BLEU read off Figure 1b: approximate)
    "T(6,8192,16)": (6, 8192, 16, 400e6, None, 30.35),
    "T(12,16384,32)": (12, 16384, 32, 1.3e9, 2, 32.8),   # "wide"
    "T(24,8192,16)": (24, 8192, 16, 1.3e9, 4, 34.5),     # "deep"
    "T(32,16384,32)": (32, 16384, 32, 3e9, 8, 35.45),
    "T(64,16384,32)": (64, 16384, 32, 6e9, 16, 36.2),
}
DEEP_VS_WIDE_CLAIM = ("At equal parameters (1.3B), the deep T(24,8192,16) and the wide T(12,16384,32) "
                      "are about equal on high-resource languages; the deep model wins by large margins "
                      "on low-resource languages (gains over bilingual baselines up to about +15 BLEU "
                      "deep vs +8..10 wide).")
LARGE_BATCH = {  # German-English, Transformer Big: tokens per batch -> (BLEU, NLL)
    260_000: (30.92, 2.58), 1_000_000: (31.86, 2.51), 4_000_000: (32.71, 2.46)}
