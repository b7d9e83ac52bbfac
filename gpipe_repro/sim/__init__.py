"""What K devices would do: per-layer cost calibration, device and link models, and the simulator that
replays the runtime's own schedule over measured or modelled costs."""
