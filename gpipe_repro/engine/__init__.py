"""The GPipe engine: what ``from gpipe_repro import GPipe`` runs. Depends on torch only.

Schedule (what runs when) -> interpreter (its semantics in virtual time) -> StageExecutor (one
action on one stage) -> runtimes (local here; distributed is a plug-in in gpipe_repro.distributed).
See docs/design.md for the layers and the glossary.
"""

__all__: list[str] = []   # the API is re-exported by gpipe_repro/__init__.py
