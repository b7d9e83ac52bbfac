"""One module per `gpipe-repro` command group; each defines `register(app)`."""
