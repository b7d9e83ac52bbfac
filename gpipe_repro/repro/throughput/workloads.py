"""The models of the throughput tables: the paper's exact ones and the scaled ones this host runs."""
from __future__ import annotations

from gpipe_repro.models.workload import Workload

# The paper's exact models (Table 2 and Table 3).
PAPER_WORKLOADS: dict[str, Workload] = {
    "amoebanet": Workload.create("AmoebaNet-D (18, 256), 224x224", "amoebanet-d", "image",
                                 (3, 224, 224), 1000, L=18, F=256, num_classes=1000, image_size=224,
                                 aux_head=False),
    "transformer": Workload.create("Transformer-48 (d 2048, ff 8192, 32 heads, seq 1024, 32k vocab)",
                                   "transformer-lm", "tokens", (1024,), 32000, L=48),
}
PAPER_TABLE3_WORKLOADS: dict[str, Workload] = {
    "amoebanet": Workload.create("AmoebaNet-D (18, 128), 224x224", "amoebanet-d", "image",
                                 (3, 224, 224), 1000, L=18, F=128, num_classes=1000, image_size=224,
                                 aux_head=False),
    "transformer": Workload.create("Transformer-24 (d 2048, ff 8192, 32 heads, seq 1024, 32k vocab)",
                                   "transformer-lm", "tokens", (1024,), 32000, L=24),
}
# AmoebaNet without its auxiliary head (as torchgpipe benchmarks it): 24 pipeline layers.
# Scaled down so the whole sweep (calibration and measured runs included) takes minutes on 2 CPU
# cores. Same depth as the paper's (24 and 50 pipeline layers), so the partitions have the same
# granularity; AmoebaNet keeps F/image ratios whose per-layer FLOP profile is closest to (18, 256)
# at 224x224 (the stem's fixed 32 filters would dominate a smaller F).
SCALED_WORKLOADS: dict[str, Workload] = {
    "amoebanet": Workload.create("AmoebaNet-D (18, 64), 32x32, 10 classes", "amoebanet-d", "image",
                                 (3, 32, 32), 10, L=18, F=64, num_classes=10, image_size=32,
                                 aux_head=False),
    "transformer": Workload.create("Transformer-48 (d 64, ff 256, 2 heads, seq 32, vocab 256)",
                                   "transformer-lm", "tokens", (32,), 256, L=48, d_model=64,
                                   d_ff=256, num_heads=2, vocab_size=256),
}
SCALED_TABLE3_WORKLOADS: dict[str, Workload] = {
    "amoebanet": Workload.create("AmoebaNet-D (18, 32), 32x32, 10 classes", "amoebanet-d", "image",
                                 (3, 32, 32), 10, L=18, F=32, num_classes=10, image_size=32,
                                 aux_head=False),
    "transformer": Workload.create("Transformer-24 (d 64, ff 256, 2 heads, seq 32, vocab 256)",
                                   "transformer-lm", "tokens", (32,), 256, L=24, d_model=64,
                                   d_ff=256, num_heads=2, vocab_size=256),
}
SCALED_MICROBATCH = {"amoebanet": 4, "transformer": 4}
PAPER_MICROBATCH = {"amoebanet": 8, "transformer": 1}     # images / 1024-token sequences

