"""A zoo of deliberately broken schedules, written out literally (as PyTorch keeps its
`schedule_registry.py`): each entry is (text, the error the validator must raise). The validator and
the link-order check are tested against every one in tests/engine/test_schedule_text.py."""
from __future__ import annotations

# name -> (schedule text, regex the ScheduleError message must match, check)
# check: "validate" (Schedule.validate) or "link_order" (Schedule.check_link_order)
BROKEN: dict[str, tuple[str, str, str]] = {
    "send_without_receive": ("""
        schedule broken stages=2 micro_batches=1 training=1
        stage 0: F0 sa0 rg0 B0 A U
        stage 1: F0 B0 sg0 A U
        """, r"ra0.*is missing", "validate"),
    "backward_before_forward": ("""
        schedule broken stages=1 micro_batches=2 training=1
        stage 0: F0 B1 F1 B0 A U
        """, r"B1 comes before F1", "validate"),
    "recompute_after_backward": ("""
        schedule broken stages=1 micro_batches=1 training=1
        stage 0: F0 B0 R0 A U
        """, r"B0 comes before R0", "validate"),
    "update_before_last_backward": ("""
        schedule broken stages=1 micro_batches=2 training=1
        stage 0: F0 F1 B1 A U B0
        """, r"B0 after the AGREE / optimizer step", "validate"),
    "two_updates": ("""
        schedule broken stages=1 micro_batches=1 training=1
        stage 0: F0 B0 A U U
        """, r"repeated", "validate"),
    "micro_batch_out_of_range": ("""
        schedule broken stages=1 micro_batches=1 training=1
        stage 0: F0 F1 B0 A U
        """, r"outside 0\.\.0", "validate"),
    "wait_for_gradient_before_sending": ("""
        schedule broken stages=2 micro_batches=1 training=1
        stage 0: F0 rg0 sa0 B0 A U
        stage 1: ra0 F0 B0 sg0 A U
        """, r"deadlocks", "validate"),
    "crossed_link_order": ("""
        schedule broken stages=2 micro_batches=2 training=1
        stage 0: F0 F1 sa1 sa0 rg1 B1 rg0 B0 A U
        stage 1: ra0 F0 ra1 F1 B1 sg1 B0 sg0 A U
        """, r"different order than it receives", "link_order"),
    "forward_only_with_update": ("""
        schedule broken stages=1 micro_batches=1 training=0
        stage 0: F0 U
        """, r"forward-only schedule cannot recompute or update", "validate"),
    "update_without_agree": ("""
        schedule broken stages=2 micro_batches=1 training=1
        stage 0: F0 sa0 rg0 B0 A U
        stage 1: ra0 F0 B0 sg0 U
        """, r"stage 1: A is missing", "validate"),
    "agree_after_update": ("""
        schedule broken stages=1 micro_batches=1 training=1
        stage 0: F0 B0 U A
        """, r"must end with AGREE \(A\) then the optimizer step", "validate"),
}
