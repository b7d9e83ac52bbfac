"""When a corpus build may reach the Hugging Face hub: it fails at once, saying what to do offline.

A build from a hub dataset (`corpus_builders.build_opus100_corpus`) checks first, with no retries and
no long timeouts, that offline mode is off (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)
and that huggingface.co answers; otherwise it raises :class:`HubUnavailableError`, naming the offline
corpus (gettext) and local files as the alternatives.
"""
from __future__ import annotations

import os
import socket

OFFLINE_ALTERNATIVE = ("build the offline corpus instead: `gpipe-repro corpus build --source gettext` "
                       "(real translations from this machine's gettext catalogs), or `--source local "
                       "--files FILE` for your own json/jsonl/parquet/csv with columns language, "
                       "source, target")


class HubUnavailableError(RuntimeError):
    """The hub dataset cannot be reached (offline mode or no network)."""


def _hub_offline() -> bool:
    flags = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in {"1", "true", "yes", "on"} for f in flags)


def _hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_hub_available(dataset: str) -> None:
    """Raise HubUnavailableError at once (no retries, no long timeouts) when the hub is out of reach."""
    if _hub_offline():
        raise HubUnavailableError(
            f"cannot load the hub dataset {dataset}: offline mode is on (HF_DATASETS_OFFLINE / "
            f"HF_HUB_OFFLINE); unset it on a machine with network access, or "
            f"{OFFLINE_ALTERNATIVE}")
    if not _hub_reachable():
        raise HubUnavailableError(
            f"cannot load the hub dataset {dataset}: huggingface.co is not reachable from this "
            f"machine; {OFFLINE_ALTERNATIVE}")

