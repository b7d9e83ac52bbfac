"""One module per `gpipe-repro` command group, each defining `register(app)`; `options` (the shared
options) and the `_*` modules are helpers the commands share."""
