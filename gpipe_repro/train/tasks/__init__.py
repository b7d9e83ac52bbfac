"""Training tasks: AmoebaNet image classification (+ transfer), and multilingual translation."""
